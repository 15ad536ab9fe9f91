"""Schedule layer: plan + size -> per-rank programs; the symbolic checker; the MIAD tuner.

Never imports MPI, CUDA or a framework (docs/architecture.md).
"""

from .check import check_program, clear_check_cache, describe_op
from .compile import chunk_count, compile_program, tree_ranges
from .miad import MiadTuner, tune
from .program import DONE_FLAG, PROGRAM_KINDS, START_FLAG, Op, Program
from .replay import replay

__all__ = [
    "DONE_FLAG",
    "PROGRAM_KINDS",
    "START_FLAG",
    "MiadTuner",
    "Op",
    "Program",
    "check_program",
    "chunk_count",
    "clear_check_cache",
    "compile_program",
    "describe_op",
    "replay",
    "tree_ranges",
    "tune",
]
