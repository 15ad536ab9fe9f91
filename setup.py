"""Packaging for blink_horovod.

Layout: the main package lives in ``blink_horovod/``; two sub-packages live at the
repository root and are mapped into it:

    ops/       -> blink_horovod.ops
    launcher/  -> blink_horovod.launcher

Pinned dependency versions (and the horovod build) are handled by
``scripts/install.sh`` / ``requirements.txt``; ``install_requires`` below only names
what the package needs at run time. torch / tensorflow / horovod are deliberately
NOT listed: an unpinned torch would pull a multi-GB CUDA build, and horovod must be
compiled by install.sh against the installed frameworks.
"""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# Sub-directories at repo root that are installed as sub-packages of blink_horovod.
MAPPED = {
    "blink_horovod.ops": "ops",
    "blink_horovod.launcher": "launcher",
}


def _packages():
    packages = ["blink_horovod"]
    packages += ["blink_horovod." + p for p in find_packages(os.path.join(HERE, "blink_horovod"))]
    package_dir = {"blink_horovod": "blink_horovod"}
    for name, directory in MAPPED.items():
        if not os.path.isdir(os.path.join(HERE, directory)):
            continue
        package_dir[name] = directory
        if name not in packages:
            packages.append(name)
        packages += [name + "." + p for p in find_packages(os.path.join(HERE, directory))]
    return sorted(set(packages)), package_dir


PACKAGES, PACKAGE_DIR = _packages()

setup(
    name="blink_horovod",
    version="0.1.0",
    description="Blink-style topology-aware collectives for Horovod",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    python_requires=">=3.11",
    install_requires=[
        "numpy",
        "networkx",
        "scipy",
        "cvxpy",
    ],
    entry_points={
        "console_scripts": [
            "blink=blink_horovod.cli:main",
            "blinkrun=blink_horovod.launcher.blinkrun:main",
        ],
    },
)
