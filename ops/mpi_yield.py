"""While a Blink collective runs, Open MPI's idle progress loop in this process yields the CPU.

Why.  Under ``horovodrun``/``blinkrun`` with the MPI controller (the default
where Horovod is built with MPI), every rank's Horovod background thread runs
its coordination cycle every ``HOROVOD_CYCLE_TIME`` (1 ms): one small
``MPI_Allreduce`` of cache bits among all ranks
(``Controller::CoordinateCacheAndState``), even when no Horovod tensor is
queued.  Open MPI waits for that allreduce by polling (``opal_progress`` in a
loop), and it polls *without* yielding unless it believes the host is
oversubscribed, which it does not when the host is listed with as many slots
as ranks (``-H localhost:4`` on 2 cores).  While Blink's collectives run, the
background threads therefore spin: a cycle whose allreduce waits for a rank
that is off the CPU lasts longer than the cycle time, so the next cycle starts
without sleeping, and the threads of all ranks keep each other spinning.
Measured on the 2-core machine (4 ranks, a loop of 64 MB Blink allreduces,
per-thread CPU from ``/proc/self/task``): the background thread of every rank
burnt 14-16 ms of CPU per allreduce, as much as Blink's own work, and the
allreduce took 50-55 ms against 30 ms with no Horovod in the process
(docs/benchmarks.md).

What.  Open MPI's own remedy for an oversubscribed host is
``mpi_yield_when_idle``: ``opal_progress`` calls ``sched_yield`` after a
poll that found nothing to do.  Its value is a process-wide flag that
``opal_progress_set_yield_when_idle`` sets at run time.  :func:`yielding`
sets it on entry to a Blink collective and puts the previous value back on
exit, so the coordination cycle that spins *during Blink's collectives* gives
the cores to Blink's ranks, and everything else (stock Horovod's own
collectives, fallback ops between Blink's collectives) runs with Open MPI's
setting unchanged.  Nothing is loaded: only an Open MPI already in the
process is touched (found in ``/proc/self/maps``, opened with
``RTLD_NOLOAD``); with Gloo, MPICH or no MPI at all this is a no-op.
``BLINK_MPI_YIELD=0`` turns it off (to measure what it saves).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .outermost import Outermost

__all__ = ["reset", "setter", "yielding"]

_LIBRARY = "libopen-pal.so"  # Open MPI's portability layer, which holds the progress engine
_SYMBOL = "opal_progress_set_yield_when_idle"
_RECHECK_SECONDS = 1.0  # while Open MPI is not (yet) loaded, look again after 1, 2, 4, ... 64 s

_lock = threading.Lock()
_holders = Outermost()  # Blink collectives in progress in this process (several communicators, threads)
_saved = False  # Open MPI's value before the outermost one began
_setter: Callable[[bool], bool] | None = None
_checked_at: float | None = None
_recheck = _RECHECK_SECONDS


def _loaded_path() -> str | None:
    """The path of the ``libopen-pal`` mapped into this process, if any."""
    try:
        with open("/proc/self/maps", "r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                if len(fields) == 6 and _LIBRARY in os.path.basename(fields[5].strip()):
                    return fields[5].strip()
    except OSError:
        return None
    return None


def _find() -> Callable[[bool], bool] | None:
    path = _loaded_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_LOCAL)
        fn = getattr(lib, _SYMBOL)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_bool]
    fn.restype = ctypes.c_bool
    return fn


def setter() -> Callable[[bool], bool] | None:
    """``opal_progress_set_yield_when_idle`` of the Open MPI in this process (it returns the old
    value), or None.  While absent it is looked up again after 1, 2, 4, ... 64 s (reading
    ``/proc/self/maps`` of a process holding torch costs about a millisecond), since Horovod
    may load Open MPI after Blink's communicator exists."""
    global _setter, _checked_at, _recheck
    if _setter is None:
        now = time.monotonic()
        if _checked_at is None or now - _checked_at >= _recheck:
            if _checked_at is not None:
                _recheck = min(_recheck * 2, 64.0)
            _checked_at = now
            _setter = _find()
    return _setter


def reset() -> None:
    """Forget the lookup (tests)."""
    global _setter, _checked_at, _recheck
    with _lock:
        _setter, _checked_at, _recheck = None, None, _RECHECK_SECONDS


@contextmanager
def yielding(enabled: bool = True) -> Iterator[None]:
    """Open MPI's idle polling yields the CPU for the duration (module docstring).

    Nested and concurrent uses count: the outermost entry saves Open MPI's
    value and the last exit restores it.  ``enabled=False``: a no-op.
    """
    if not enabled:
        yield
        return
    fn = setter()
    if fn is None:
        yield
        return

    def enter() -> None:
        global _saved
        _saved = bool(fn(True))

    with _holders.held(enter, lambda: fn(_saved)):
        yield
