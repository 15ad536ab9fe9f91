"""A rank dies (or fails) mid-collective: the others raise, naming it, long before the timeout.

Reliability requirement ("A rank dies"): under ``horovodrun`` the launcher ends the job when a
rank exits, but where nobody does (a lost host, a rank whose transport is
gone) Blink's own detection must: the surviving ranks raise
``BlinkInternalError`` within ``BLINK_TIMEOUT_SECONDS``, naming the dead
rank, and exit non-zero.  The ranks here are started by the test itself
(FileRendezvous), so no launcher kills them first.

Three ways to fail a rank:

* the test SIGKILLs it from outside while every rank loops over allreduces;
* the runtime's fault hook kills it at its K-th chunk operation
  (``BLINK_FAULT=kill:after=K:rank=R``), so the death is inside a collective;
* the hook makes it raise ``BlinkInternalError`` instead (an error in one rank
  only: the others must not wait for it).
"""

from __future__ import annotations

import signal
import time

import pytest

from conftest import error_of

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("blink_horovod.runtime.communicator", reason="the CPU runtime is not in this checkout yet")

N = 4
TIMEOUT_S = 5.0

LOOP = """
import numpy as np

def body():
    comm = make_communicator()
    arr = np.empty(PARAMS.get("count", 1 << 18), np.float32)
    i = 0
    while True:
        arr.fill(RANK + 1)
        comm.allreduce(arr, name="grad")
        assert arr[0] == SIZE * (SIZE + 1) / 2
        i += 1
        STATE["iterations"] = i
        STATE["last_ok"] = time.time()
        if i == 3:
            emit("looping")

main(body)
"""


def _survivor_errors(results, victim: int):
    out = []
    for r in results:
        if r.rank == victim:
            continue
        ev = error_of(r)
        assert r.returncode == 1, (r.rank, r.returncode, r.tail())
        out.append((r, ev))
    return out


def test_rank_sigkilled_from_outside_others_raise_naming_it(ranks, record) -> None:
    victim = 2
    group = ranks.start(N, LOOP, timeout_seconds=TIMEOUT_S, limit=60)
    group.wait_event(victim, "looping")
    time.sleep(0.2)  # well inside the allreduce loop
    killed_at = group.kill(victim, signal.SIGKILL)
    results = group.wait()
    assert results[victim].returncode == -signal.SIGKILL
    survivors = _survivor_errors(results, victim)
    delays = [ev["t"] - killed_at for _, ev in survivors]
    record(
        case=f"rank {victim} of {N} SIGKILLed mid-allreduce (from outside)",
        fault="a rank dies",
        injected="the test sends SIGKILL while all ranks loop over 1 MiB allreduces",
        behaviour=f"{len(survivors)} survivors raise {'/'.join(sorted({ev['type'] for _, ev in survivors}))}, "
                  f"exit 1: \"{survivors[0][1]['message']}\"",
        seconds=max(delays),
        limits=f"timeout {TIMEOUT_S:g} s",
    )
    for r, ev in survivors:
        assert ev["type"] == "BlinkInternalError", (r.rank, ev)
        assert f"rank {victim}" in ev["message"], (r.rank, ev["message"])
    assert max(delays) < TIMEOUT_S, delays


def test_rank_killed_by_fault_hook_inside_a_collective(ranks, record) -> None:
    victim = 1
    fault = "kill:after=40:rank=1"
    group = ranks.start(N, LOOP, timeout_seconds=TIMEOUT_S, limit=60, env={"BLINK_FAULT": fault})
    died_at = group.wait_exit(victim)
    results = group.wait()
    assert results[victim].returncode == -signal.SIGKILL
    survivors = _survivor_errors(results, victim)
    delays = [ev["t"] - died_at for _, ev in survivors]
    record(
        case=f"rank {victim} of {N} killed inside a collective (fault hook)",
        fault="a rank dies",
        injected=f"BLINK_FAULT={fault}: SIGKILL of itself before its 41st chunk operation",
        behaviour=f"{len(survivors)} survivors raise {'/'.join(sorted({ev['type'] for _, ev in survivors}))}, "
                  f"exit 1: \"{survivors[0][1]['message']}\"",
        seconds=max(delays),
        limits=f"timeout {TIMEOUT_S:g} s",
    )
    for r, ev in survivors:
        assert ev["type"] == "BlinkInternalError", (r.rank, ev)
        assert f"rank {victim}" in ev["message"], (r.rank, ev["message"])
    # Within the timeout; the death is seen to within the harness's 5 ms exit polling.
    assert max(delays) < TIMEOUT_S, delays


def test_rank_raising_inside_a_collective_fails_every_rank(ranks, record) -> None:
    victim = 3
    fault = f"raise:after=40:rank={victim}"
    group = ranks.start(N, LOOP, timeout_seconds=TIMEOUT_S, limit=60, env={"BLINK_FAULT": fault})
    results = group.wait()
    own = error_of(results[victim])
    assert own["type"] == "BlinkInternalError" and "fault injected" in own["message"]
    survivors = _survivor_errors(results, victim)
    delays = [ev["t"] - own["t"] for _, ev in survivors]
    record(
        case=f"rank {victim} of {N} raises inside a collective (fault hook)",
        fault="a rank fails",
        injected=f"BLINK_FAULT={fault}: BlinkInternalError before its 41st chunk operation",
        behaviour=f"the rank raises, exit 1; {len(survivors)} others raise "
                  f"{'/'.join(sorted({ev['type'] for _, ev in survivors}))}, exit 1: \"{survivors[0][1]['message']}\"",
        seconds=max(delays),
        limits=f"timeout {TIMEOUT_S:g} s",
    )
    for r, ev in survivors:
        assert "BlinkError" in ev["mro"], (r.rank, ev)
        assert f"rank {victim}" in ev["message"], (r.rank, ev["message"])
    assert max(delays) < TIMEOUT_S, delays
