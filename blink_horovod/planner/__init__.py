"""Planner layer: exact optima, MWU packing, few-tree refinement, hybrid split, plan I/O.

Pure Python on networkx, scipy and cvxpy; never imports MPI, CUDA, a framework
or Horovod (../shared/DESIGN.md).
"""

from .plan import CHANNELS, COLLECTIVES, FORMAT, Plan, Tree, validate_plan

__all__ = ["CHANNELS", "COLLECTIVES", "FORMAT", "Plan", "Tree", "validate_plan"]
