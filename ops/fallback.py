"""What Blink does not carry goes to stock Horovod: counted, and logged once per kind.

The paper's Blink replaces only the collectives it implements and leaves the
rest to NCCL; here the rest (Adasum, sparse gradients, allgather, alltoall,
reducescatter, process sets that do not cover whole servers, ops recorded by
the timeline, device tensors without a GPU runtime) goes to stock Horovod.
Every such call is counted in ``blink_horovod.stats()["fallback"]``
(docs/formats.md, Python API) and each *kind* is logged once per process, at
``warning`` level, so a user sees what Blink left alone without a flood.
"""

from __future__ import annotations

import logging
import threading

from .._stats import record_fallback

__all__ = ["fallback", "kinds_seen", "log"]

log = logging.getLogger("blink_horovod.ops")
_lock = threading.Lock()
_seen: dict[str, int] = {}


def fallback(kind: str, detail: str = "") -> None:
    """Count one call handed to stock Horovod; log the first call of each ``kind``.

    Parameters
    ----------
    kind:
        A short stable label, e.g. ``"allgather"`` or ``"adasum"``.
    detail:
        Why, for the one log line.
    """
    record_fallback()
    with _lock:
        first = kind not in _seen
        _seen[kind] = _seen.get(kind, 0) + 1
    if first:
        log.warning("blink: %s goes to stock Horovod%s (logged once)", kind, f": {detail}" if detail else "")


def kinds_seen() -> dict[str, int]:
    """How many calls of each kind went to stock Horovod in this process."""
    with _lock:
        return dict(_seen)
