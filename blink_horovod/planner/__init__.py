"""Planner layer: exact optima, MWU packing, few-tree refinement, hybrid split, plan I/O.

Pure Python on networkx, scipy and cvxpy; never imports MPI, CUDA, a framework
or Horovod (../shared/DESIGN.md).  ``make_plan`` is the entry point.
"""

from importlib import import_module
from typing import Any

from .plan import CHANNELS, COLLECTIVES, FORMAT, Plan, Tree, validate_plan

# The solver stack (scipy, cvxpy) loads on first use of make_plan (PEP 562), so
# that reading a cached plan (planner.cache) does not pay seconds of imports.
_LAZY = {"PLANNER_VERSION": "api", "available_channels": "api", "make_plan": "api"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHANNELS",
    "COLLECTIVES",
    "FORMAT",
    "PLANNER_VERSION",
    "Plan",
    "Tree",
    "available_channels",
    "make_plan",
    "validate_plan",
]
