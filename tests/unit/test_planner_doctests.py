"""The planner modules' docstring examples run (numpydoc Examples sections)."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("module", ["api", "hybrid", "spanning"])
def test_examples(module: str) -> None:
    mod = importlib.import_module(f"blink_horovod.planner.{module}")
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
