"""Ranks as threads of the test process: every rank's result, or its exception with its traceback.

In the manner of PyTorch's ``MultiProcessTestCase``: each rank runs the same
function, a rank's failure comes back to the test with the rank's own
traceback and is raised there, and a rank that does not finish in time fails
the test naming it instead of hanging it.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RankOutcome", "rank_outcomes", "run_ranks"]


@dataclass
class RankOutcome:
    """What one rank did: its return value, or the exception it raised and its traceback."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    finished: bool = False


def rank_outcomes(target: Callable[[int], Any], n: int, timeout: float = 60.0) -> list[RankOutcome]:
    """Run ``target(rank)`` for ranks 0..n-1 on threads; every rank's outcome, none raised.

    Raises ``AssertionError`` naming the ranks still running after ``timeout``
    seconds (for all ranks together), with the failures of the others.
    """
    outcomes = [RankOutcome(r) for r in range(n)]

    def main(r: int) -> None:
        try:
            outcomes[r].value = target(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcomes[r].error = exc
            outcomes[r].traceback = traceback.format_exc()
        finally:
            outcomes[r].finished = True

    threads = [threading.Thread(target=main, args=(r,), daemon=True, name=f"rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        failed = "".join(f"\nrank {o.rank} raised:\n{o.traceback}" for o in outcomes if o.error is not None)
        raise AssertionError(f"ranks {stuck} still running after {timeout:g} s{failed}")
    return outcomes


def run_ranks(target: Callable[[int], Any], n: int, timeout: float = 60.0) -> list[Any]:
    """Run ``target(rank)`` for ranks 0..n-1 on threads; their return values, in rank order.

    If ranks raise, the lowest such rank's exception is raised here, carrying
    its own traceback (``raise`` keeps it) and a note naming the rank and what
    the other failing ranks raised; every rank's traceback text is also on
    ``exc.rank_tracebacks``.
    """
    outcomes = rank_outcomes(target, n, timeout)
    failed = [o for o in outcomes if o.error is not None]
    if not failed:
        return [o.value for o in outcomes]
    first = failed[0]
    exc = first.error
    assert exc is not None
    others = "".join(f"\n  rank {o.rank}: {type(o.error).__name__}: {o.error}" for o in failed[1:])
    exc.add_note(f"raised on rank {first.rank} of {n}" + (f"; the other failing ranks:{others}" if others else ""))
    exc.rank_tracebacks = [o.traceback for o in outcomes]  # type: ignore[attr-defined]
    raise exc
