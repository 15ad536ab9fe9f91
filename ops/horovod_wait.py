"""Waiting on stock Horovod from Blink's engine thread: a deadline, and a peer check between polls.

Every framework adapter's cross-server stage (:mod:`.torch_cross`, :mod:`.tf_ops`) waits for
Horovod this way instead of blocking in Horovod's C++ wait, so that a stalled or failed peer ends the
wait with an error that names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import BlinkError, BlinkInternalError, BlinkTimeoutError

__all__ = ["cross_grace", "explained", "wait_horovod"]


def cross_grace(timeout: float) -> float:
    """How much longer than ``BLINK_TIMEOUT_SECONDS`` a cross-server wait lasts (half of it, 2 to 30 s)."""
    return min(max(0.5 * timeout, 2.0), 30.0)


def wait_horovod(poll: Callable[[Any], bool], synchronize: Callable[[Any], Any], handle: Any, timeout: float,
                 what: str, interrupt: Callable[[], None] | None = None,
                 explain: Callable[[str, float, BaseException | None], str | None] | None = None) -> Any:
    """Poll a stock Horovod handle until done (backing off from 20 us to 1 ms), then synchronize it.

    ``interrupt()``, called between polls, raises to give up the wait (a server-mate failed: its
    error, which it learnt from a server this rank's own exchange may never hear from).
    ``explain(what, timeout, None)`` gives the error line of a wait that timed out, naming the ranks
    that hold it up; ``explain(what, timeout, exc)`` that of a Horovod failure (Horovod shut down
    under it) where it knows the cause -- a rank that has exited -- or None
    (:func:`.peer_status.explain_timeout`, :func:`.peer_status.explain_failure`)."""
    deadline = time.monotonic() + timeout
    delay = 2e-5
    while not poll(handle):
        if interrupt is not None:
            interrupt()
        if time.monotonic() > deadline:
            if explain is not None:
                raise BlinkTimeoutError(explain(what, timeout, None))
            raise BlinkTimeoutError(f"{what}: stock Horovod did not complete within {timeout:g} s "
                                    f"(BLINK_TIMEOUT_SECONDS)")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    try:
        return synchronize(handle)
    except Exception as exc:
        out = explained(exc, explain, what, timeout)
        if out is exc:
            raise
        raise out from exc


def explained(exc: Exception, explain: Callable[[str, float, BaseException | None], str | None] | None,
              what: str, timeout: float) -> Exception:
    """What to raise for ``exc``, which stock Horovod raised in a cross-server stage: a
    ``BlinkInternalError`` naming the ranks that have exited where ``explain`` knows them, else
    ``exc`` itself (Blink's own errors always)."""
    if isinstance(exc, BlinkError) or explain is None:
        return exc
    line = explain(what, timeout, exc)
    return exc if line is None else BlinkInternalError(line)
