"""Planner layer: exact optima, MWU packing, few-tree refinement, hybrid split, plan I/O.

Pure Python on numpy, scipy and HiGHS (highspy); never imports MPI, CUDA, a
framework or Horovod (docs/architecture.md).  ``make_plan`` (:mod:`.api`) is the entry
point; it is imported on first use (PEP 562), so that reading plans and the
plan cache's lookups do not pay for numpy/scipy/HiGHS.
"""

from __future__ import annotations

from typing import Any

from .plan import CHANNELS, COLLECTIVES, FORMAT, Plan, Tree, validate_plan

__all__ = [
    "CHANNELS",
    "COLLECTIVES",
    "FORMAT",
    "Plan",
    "Tree",
    "available_channels",
    "make_plan",
    "validate_plan",
]

_LAZY = {"make_plan", "available_channels"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
