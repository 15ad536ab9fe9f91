"""Horovod's threads at idle priority during Blink collectives (ops/background.py), and only then."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from blink_horovod.ops import background

from blink_horovod.config import BLINK_BACKGROUND_IDLE, load_config

linux_sched = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"),
                                 reason="Linux scheduling policies")


@pytest.fixture
def parked_thread():
    """A thread started inside noting_new_threads(), as Horovod's background thread is inside hvd.init."""
    background.forget()
    stop = threading.Event()
    with background.noting_new_threads():
        t = threading.Thread(target=stop.wait, daemon=True)
        t.start()
    yield t
    stop.set()
    t.join(10)
    background.forget()


@linux_sched
def test_threads_started_in_the_block_are_noted(parked_thread):
    assert background.registered() == {parked_thread.native_id}
    assert threading.get_native_id() not in background.registered()


@linux_sched
def test_idle_inside_and_policy_back_after(parked_thread):
    if not background.can_restore():
        pytest.skip("this process may not give a thread its policy back (no CAP_SYS_NICE)")
    tid = parked_thread.native_id
    before = os.sched_getscheduler(tid)
    with background.idled():
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        with background.idled():  # nested: still idle, restored once
            pass
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    assert os.sched_getscheduler(tid) == before
    assert os.sched_getscheduler(threading.get_native_id()) == before  # the caller never changes


@linux_sched
def test_restored_when_the_collective_raises(parked_thread):
    if not background.can_restore():
        pytest.skip("no CAP_SYS_NICE")
    before = os.sched_getscheduler(parked_thread.native_id)
    with pytest.raises(RuntimeError), background.idled():
        raise RuntimeError("peer failed")
    assert os.sched_getscheduler(parked_thread.native_id) == before


@linux_sched
def test_nothing_changes_where_the_policy_could_not_be_given_back(parked_thread, monkeypatch):
    monkeypatch.setattr(background, "_restorable", False)
    before = os.sched_getscheduler(parked_thread.native_id)
    with background.idled():
        assert os.sched_getscheduler(parked_thread.native_id) == before


@linux_sched
def test_disabled_or_nothing_noted_is_a_no_op(parked_thread):
    before = os.sched_getscheduler(parked_thread.native_id)
    with background.idled(False):
        assert os.sched_getscheduler(parked_thread.native_id) == before
    background.forget()
    with background.idled():
        assert os.sched_getscheduler(parked_thread.native_id) == before


@linux_sched
def test_an_ended_thread_is_dropped(parked_thread):
    if not background.can_restore():
        pytest.skip("no CAP_SYS_NICE")
    stop = threading.Event()
    with background.noting_new_threads():
        gone = threading.Thread(target=stop.wait, daemon=True)
        gone.start()
    tid = gone.native_id
    stop.set()
    gone.join(10)
    with background.idled():
        pass
    assert tid not in background.registered()


@linux_sched
def test_the_hierarchy_idles_them_during_blink_collectives(parked_thread):
    if not background.can_restore():
        pytest.skip("no CAP_SYS_NICE")
    from blink_horovod.ops.hierarchical import Hierarchy
    from blink_horovod.ops.layout import Layout
    from support.loopback import run_loopback

    from blink_horovod.runtime import executor as executor_mod

    seen: list[int] = []
    originals = {n: getattr(executor_mod.Executor, n) for n in ("collective", "eager_collective")}

    def spy(name):
        def run(self, *args, **kwargs):
            seen.append(os.sched_getscheduler(parked_thread.native_id))
            return originals[name](self, *args, **kwargs)
        return run

    for n in originals:
        setattr(executor_mod.Executor, n, spy(n))
    out = [np.arange(1 << 16, dtype=np.float32) + r for r in range(2)]  # eager (small) and program paths
    try:
        run_loopback(2, lambda r, comm: comm.allreduce(out[r]), eager=True, join_timeout=60)
        assert not seen or all(p != os.SCHED_IDLE for p in seen)  # the raw communicator leaves them alone
        seen.clear()
        run_loopback(2, lambda r, comm: Hierarchy(Layout(r, 2, 2), comm, None).allreduce(out[r], "sum", "t"),
                     eager=True, join_timeout=60)
    finally:
        for n, fn in originals.items():
            setattr(executor_mod.Executor, n, fn)
    assert seen and all(p == os.SCHED_IDLE for p in seen)
    assert os.sched_getscheduler(parked_thread.native_id) != os.SCHED_IDLE
    assert np.array_equal(out[0], (np.arange(1 << 16, dtype=np.float32) * 2 + 1) * 2)


def test_config_variable():
    assert load_config({}).background_idle is True
    assert load_config({BLINK_BACKGROUND_IDLE: "0"}).background_idle is False
