"""Schedule layer: plan + size -> per-rank programs; the symbolic checker; the MIAD tuner.

Never imports MPI, CUDA or a framework (../shared/DESIGN.md).
"""

from .check import check_program, clear_check_cache, describe_op
from .compile import compile_program, tree_ranges
from .program import DONE_FLAG, PROGRAM_KINDS, START_FLAG, Op, Program

__all__ = [
    "PROGRAM_KINDS",
    "START_FLAG",
    "DONE_FLAG",
    "Op",
    "Program",
    "compile_program",
    "tree_ranges",
    "check_program",
    "clear_check_cache",
    "describe_op",
]
