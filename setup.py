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


# --- BLINK_ENABLE import hook ----------------------------------------------------------------
# ops/blink_horovod_hook.pth must land at the top of site-packages so that it runs at
# interpreter start-up (see ops/hook.py). build_py covers wheels / `pip install .`;
# editable_wheel covers `pip install -e .` (PEP 660), which would otherwise skip it.
import shutil  # noqa: E402

from setuptools.command.build_py import build_py as _build_py  # noqa: E402
from setuptools.command.editable_wheel import editable_wheel as _editable_wheel  # noqa: E402

HOOK_PTH = os.path.join("ops", "blink_horovod_hook.pth")


class build_py_with_hook(_build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, HOOK_PTH), os.path.join(self.build_lib, os.path.basename(HOOK_PTH)))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, os.path.basename(HOOK_PTH))]


class editable_wheel_with_hook(_editable_wheel):
    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copy(os.path.join(HERE, HOOK_PTH), os.path.join(installation_dir, os.path.basename(HOOK_PTH)))


CMDCLASS = {"build_py": build_py_with_hook, "editable_wheel": editable_wheel_with_hook}
# ---------------------------------------------------------------------------------------------

setup(
    name="blink_horovod",
    version="0.1.0",
    description="Blink-style topology-aware collectives for Horovod",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    # The simulator's event loop in C (sim/native.py compiles it on first use).
    package_data={"blink_horovod.sim": ["_fluid.c"], "blink_horovod.runtime": ["_streamcopy.c", "_last_words.cc"],
                  "blink_horovod.runtime.gpu": ["trees.cu", "_replay.c"]},
    python_requires=">=3.11",
    install_requires=[
        "numpy",
        "scipy",
        "highspy",
    ],
    cmdclass=CMDCLASS,
    entry_points={
        "console_scripts": [
            "blink=blink_horovod.cli:main",
            "blinkrun=blink_horovod.launcher.blinkrun:main",
        ],
    },
)
