"""Ranks as threads of the test process: start ``n``, join them, fail naming any still running."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_rank_threads(target: Callable[[int], object], n: int, timeout: float) -> None:
    """Run ``target(rank)`` for ranks 0..n-1 on threads; assert every one ended within ``timeout`` s."""
    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still running after {timeout:g} s"
