"""Schedule layer: plan + size -> per-rank programs; the symbolic checker; the MIAD tuner.

Never imports MPI, CUDA or a framework (../shared/DESIGN.md).
"""

from .program import PROGRAM_KINDS, Op, Program

__all__ = ["PROGRAM_KINDS", "Op", "Program"]
