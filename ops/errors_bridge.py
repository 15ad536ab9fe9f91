"""Blink's errors as Horovod's: every error a collective raises is also a ``HorovodInternalError``.

Horovod raises ``HorovodInternalError`` (a ``RuntimeError``) from
``synchronize`` when a collective fails -- mismatched shapes across ranks, a
dead peer -- and Horovod's elastic mode treats exactly that class as "reset
and retry".  With ``BLINK_ENABLE=1`` the same user code must keep working, so
an error from Blink's path is raised as a class deriving from both the Blink
class (:mod:`blink_horovod.errors`, the one hierarchy) and
``HorovodInternalError``; ``except MismatchError`` and ``except
HorovodInternalError`` both catch it.
"""

from __future__ import annotations

import threading

from ..errors import BlinkError, BlinkInternalError

__all__ = ["as_horovod_error"]

_lock = threading.Lock()
_bridges: dict[type, type] = {}


def _horovod_internal_error() -> type:
    try:
        from horovod.common.exceptions import HorovodInternalError
    except Exception:  # horovod not installed: the Blink class alone
        return RuntimeError
    return HorovodInternalError


def as_horovod_error(exc: BaseException) -> BaseException:
    """``exc`` re-made as a subclass of its own class and ``HorovodInternalError`` (same message)."""
    hie = _horovod_internal_error()
    if isinstance(exc, hie) or not isinstance(exc, Exception):
        return exc
    cls = type(exc) if isinstance(exc, BlinkError) else BlinkInternalError
    with _lock:
        bridge = _bridges.get(cls)
        if bridge is None:
            bridge = type(cls.__name__, (cls, hie), {"__module__": cls.__module__,
                                                    "__doc__": f"{cls.__name__} raised as Horovod's HorovodInternalError."})
            _bridges[cls] = bridge
    msg = str(exc) if isinstance(exc, BlinkError) else f"{type(exc).__name__}: {exc}"
    out = bridge(msg)
    out.__cause__ = exc if out is not exc else None
    return out
