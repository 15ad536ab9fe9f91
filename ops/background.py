"""While a Blink collective runs, the threads Horovod's ``init`` started run at idle priority.

Why.  Horovod's background thread runs its coordination cycle every
millisecond whether or not a Horovod tensor is queued.  With the MPI
controller it polls inside ``MPI_Allreduce``; :mod:`.mpi_yield` makes that
poll yield, but a yielding thread is still picked again and again by the
scheduler, and with 4 ranks on 2 cores each pick takes a core from a Blink
rank.  Measured (a loop of 64 MB Blink allreduces, 4 ranks, 2 cores, Horovod
initialised with MPI): 50 ms per allreduce as Horovod leaves it, 34 ms with
Open MPI yielding, 29 ms when the background thread was also at
``SCHED_IDLE``, the same as with no Horovod in the process (30 ms).
``SCHED_IDLE`` threads run only when nothing else wants the core, and a
waking normal thread preempts them at once.

What.  :func:`noting_new_threads` wraps ``hvd.init`` (the ``BLINK_ENABLE``
hook's ``init`` and ``blink perf``'s): the threads that appear during it are
Horovod's (its background thread, and the MPI library's own threads, which
it starts from there).  :func:`idled` puts them at ``SCHED_IDLE`` for the
duration of a Blink collective and gives them their policy back afterwards,
so stock Horovod's own collectives, and anything between Blink's
collectives, run as before.  Giving the policy back needs ``CAP_SYS_NICE``
(or ``RLIMIT_NICE`` >= 20), so it is first tried on a scratch thread: where
it is refused (an unprivileged user), nothing is ever changed, since a
thread left at idle priority would slow stock Horovod for good.
``BLINK_BACKGROUND_IDLE=0`` turns it off (to measure what it saves).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .outermost import Outermost

__all__ = ["can_restore", "forget", "idled", "noting_new_threads", "registered"]

_lock = threading.Lock()
_threads: set[int] = set()  # native ids of the threads Horovod's init started
_holders = Outermost()  # Blink collectives in progress in this process
_saved: dict[int, tuple[int, int]] = {}  # tid -> (policy, priority) before the outermost collective
_restorable: bool | None = None


def _tids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


@contextmanager
def noting_new_threads() -> Iterator[None]:
    """Remember the threads started inside the block (wrap ``hvd.init`` in it)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    before = _tids()
    try:
        yield
    finally:
        new = _tids() - before - {threading.get_native_id()}
        with _lock:
            _threads.update(new)


def registered() -> set[int]:
    """The threads noted so far (tests)."""
    with _lock:
        return set(_threads)


def forget() -> None:
    """Drop every noted thread (tests, ``hvd.shutdown``)."""
    with _lock:
        _threads.clear()


def can_restore() -> bool:
    """Whether this process may give a thread its normal policy back after ``SCHED_IDLE``
    (tried once, on a scratch thread)."""
    global _restorable
    if _restorable is None:
        result = [False]

        def probe() -> None:
            try:
                old = os.sched_getscheduler(0)
                param = os.sched_getparam(0)
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                os.sched_setscheduler(0, old, param)
                result[0] = os.sched_getscheduler(0) == old
            except (OSError, AttributeError):
                result[0] = False

        if hasattr(os, "SCHED_IDLE"):
            t = threading.Thread(target=probe, name="blink-sched-probe", daemon=True)
            t.start()
            t.join(10)
        _restorable = result[0]
    return _restorable


def _idle_all() -> None:
    for tid in list(_threads):
        try:
            policy = os.sched_getscheduler(tid)
            if policy == os.SCHED_IDLE:
                continue
            _saved[tid] = (policy, os.sched_getparam(tid).sched_priority)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            _threads.discard(tid)  # the thread ended (hvd.shutdown)
        except OSError:
            _saved.pop(tid, None)


def _restore_all() -> None:
    for tid, (policy, priority) in list(_saved.items()):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
        except ProcessLookupError:
            _threads.discard(tid)
        except OSError:  # pragma: no cover - can_restore() said it works
            pass
    _saved.clear()


@contextmanager
def idled(enabled: bool = True) -> Iterator[None]:
    """Horovod's threads at ``SCHED_IDLE`` for the duration (module docstring); nested and
    concurrent uses count, the last exit restores.  A no-op when disabled, when no thread
    was noted, or when the policy could not be given back."""
    if not enabled or not _threads or not can_restore():
        yield
        return
    with _holders.held(_idle_all, _restore_all):
        yield
