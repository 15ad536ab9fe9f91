"""Who is stalled: following the chain of sleeps through real shared-memory segments.

A rank that waits on a rank that itself waits must name the one at the end of
the chain (transport ``_chain``), and a sleep token left behind by a frozen
process (SIGSTOP inside a futex wait) must not send the chain past it once
what it waited for has arrived (``W_SLEEP_SEEN``).
"""

from __future__ import annotations

import os
import uuid

import pytest
from support.ranks import run_ranks

from blink_horovod.runtime.shm import ShmTransport
from blink_horovod.runtime.transport import (
    W_DONE,
    W_SLEEP,
    W_SLEEP_SEEN,
    WaitContext,
    sleep_token,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def three():
    job = "chain" + uuid.uuid4().hex[:10]

    def make(r: int) -> ShmTransport:
        ctx = WaitContext.start("setup", 20.0, 20.0)
        return ShmTransport(r, 3, job, ctx, pids=[os.getpid()] * 3, data_bytes=4096, nflags=16)

    ts = run_ranks(make, 3, 30)
    yield ts
    for t in ts:
        t.close()


def _pretend_sleep(t: ShmTransport, on: int, word: int, seen: int) -> None:
    """Write what ShmTransport.block writes before its futex wait."""
    t.store(W_SLEEP_SEEN, seen)
    t.store(W_SLEEP, sleep_token(on, word))


def test_the_chain_goes_through_a_rank_that_sleeps_on_an_unposted_word(three) -> None:
    t0, t1, t2 = three
    t0.store(W_DONE, 5)
    _pretend_sleep(t2, 0, W_DONE, 5)  # rank 2 waits for rank 0's word to leave 5: a real wait
    assert t1._chain(2) == [2, 0]
    assert "rank 0 is the one stalled" in t1._wait_chain(2)


def test_a_stale_token_of_a_frozen_rank_ends_the_chain_there(three) -> None:
    t0, t1, t2 = three
    t0.store(W_DONE, 6)
    _pretend_sleep(t2, 0, W_DONE, 5)  # rank 0 has since posted 6: rank 2 would have woken, unless frozen
    assert t1._chain(2) == [2]
    assert t1._wait_chain(2) == ""


def test_a_rank_awake_ends_the_chain_and_a_loop_back_stops_it(three) -> None:
    _, t1, t2 = three
    assert t1._chain(2) == [2]  # no token: rank 2 waits on no one
    t1.store(W_DONE, 3)
    _pretend_sleep(t2, 1, W_DONE, 3)  # rank 2 waits for the asker itself
    assert t1._chain(2) == [2]
