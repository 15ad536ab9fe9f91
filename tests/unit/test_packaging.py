"""What a non-editable install (a wheel) carries: every native source the package compiles at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
NATIVE = (".c", ".cc", ".cu")


def _package_data() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no package_data")


def test_every_native_source_is_package_data() -> None:
    """cbuild compiles .c/.cc at first use and the GPU runtime compiles trees.cu: a wheel without them
    imports fine and fails on the first collective."""
    data = _package_data()
    listed = {ROOT / pkg.replace(".", "/") / name for pkg, names in data.items() for name in names}
    found = {p for p in (ROOT / "blink_horovod").rglob("*") if p.suffix in NATIVE}
    assert found, "no native sources found: the test looks in the wrong place"
    assert sorted(map(str, found - listed)) == [], "add these to package_data in setup.py"
    assert sorted(map(str, listed - found)) == [], "package_data names files that do not exist"
