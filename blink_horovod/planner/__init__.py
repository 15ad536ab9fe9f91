"""Planner layer: exact optima, MWU packing, few-tree refinement, hybrid split, plan I/O.

Pure Python on networkx, scipy and cvxpy; never imports MPI, CUDA, a framework
or Horovod (../shared/DESIGN.md).  ``make_plan`` is the entry point.
"""

from .api import PLANNER_VERSION, available_channels, make_plan
from .plan import CHANNELS, COLLECTIVES, FORMAT, Plan, Tree, validate_plan

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
