"""Process-wide counters behind :func:`blink_horovod.stats` (docs/formats.md, Python API)."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["record", "record_fallback", "reset", "stats"]

_lock = threading.Lock()
_counters: dict[str, Any] = {"allreduce": 0, "broadcast": 0, "bytes": 0, "fallback": 0, "seconds": 0.0}


def stats() -> dict[str, Any]:
    """Counters of this process since start.

    ``{"allreduce": n, "broadcast": n, "bytes": n, "fallback": n, "seconds": t}``;
    ``fallback`` counts calls handed to stock Horovod.
    """
    with _lock:
        return dict(_counters)


def record(collective: str, nbytes: int, seconds: float) -> None:
    """Count one collective Blink carried."""
    with _lock:
        _counters[collective] = _counters.get(collective, 0) + 1
        _counters["bytes"] += int(nbytes)
        _counters["seconds"] += float(seconds)


def record_fallback() -> None:
    """Count one call handed to stock Horovod."""
    with _lock:
        _counters["fallback"] += 1


def reset() -> None:
    """Zero every counter (tests only)."""
    with _lock:
        for k in _counters:
            _counters[k] = 0.0 if k == "seconds" else 0
