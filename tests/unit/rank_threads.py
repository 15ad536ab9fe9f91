"""``run_rank_threads``: the name the emulated GPU executor tests import; the runner is ``support.ranks``."""

from __future__ import annotations

from support.ranks import run_ranks as run_rank_threads

__all__ = ["run_rank_threads"]
