"""A rank stalls: a warning naming the missing ranks after the stall check, an error at the timeout.

Reliability requirement ("A rank stalls"): like Horovod's stall inspector ("Missing ranks:
..."), waiting ranks warn every ``BLINK_STALL_CHECK_SECONDS`` naming the
ranks not yet arrived, and raise on every waiting rank at
``BLINK_TIMEOUT_SECONDS``.  Small values here (1 s and 3 s) keep the test
short; the defaults are 60 s and 600 s.

Two stalls: the fault hook stops a rank inside a collective
(``BLINK_FAULT=stall:after=K:rank=R``, a rank stuck in user code or a
deadlock), and the test SIGSTOPs a rank from outside (a process frozen with
its transport intact, which no death check can see).  Afterwards the stalled
rank must end too (it finds its peers gone), so nothing is left running.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from conftest import error_of

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("blink_horovod.runtime.communicator", reason="the CPU runtime is not in this checkout yet")

N = 3
STALL_S = 1.0
TIMEOUT_S = 3.0
SLACK_S = 1.5  # scheduling on 2 shared cores, the waits' 50 ms slices

LOOP = """
import numpy as np

def body():
    comm = make_communicator()
    arr = np.empty(1 << 16, np.float32)
    i = 0
    while True:
        arr.fill(RANK + 1)
        comm.allreduce(arr, name="grad")
        i += 1
        STATE["last_ok"] = time.time()
        if i == 3:
            emit("looping")

main(body)
"""


def _missing_ranks(message: str) -> set[int]:
    m = re.search(r"missing ranks:?\s*\[?([\d,\s]+)\]?", message, re.IGNORECASE)
    return {int(x) for x in re.findall(r"\d+", m.group(1))} if m else set()


def _check_waiters(results, victim: int, t_stall: dict[int, float]):
    """Every other rank warned naming the victim, then raised BlinkTimeoutError naming it."""
    first_warnings, errors = [], []
    for r in results:
        if r.rank == victim:
            continue
        # Only warnings of the stalled wait (on 2 loaded cores an earlier collective may take > 1 s too).
        warnings = [e for e in r.events if e["kind"] == "warning" and _missing_ranks(e["message"])
                    and e["t"] >= t_stall[r.rank] - 0.01]
        assert warnings, (r.rank, [e for e in r.events if e["kind"] == "warning"], r.tail())
        assert any(victim in _missing_ranks(w["message"]) for w in warnings), (r.rank, warnings)
        ev = error_of(r)
        assert r.returncode == 1
        assert ev["type"] == "BlinkTimeoutError", (r.rank, ev)
        assert f"rank {victim}" in ev["message"], (r.rank, ev["message"])
        first_warnings.append(warnings[0]["t"] - t_stall[r.rank])
        errors.append(ev["t"] - t_stall[r.rank])
    return first_warnings, errors


def test_stalled_rank_by_fault_hook_warns_then_times_out(ranks, record) -> None:
    victim = 1
    fault = f"stall:after=30:rank={victim}"
    group = ranks.start(N, LOOP, timeout_seconds=TIMEOUT_S, stall_seconds=STALL_S, limit=60,
                        env={"BLINK_FAULT": fault})
    results = group.wait()
    # The stalled collective began when each waiting rank finished its previous one.
    t_stall = {r.rank: error_of(r)["last_ok"] for r in results if r.rank != victim}
    warn, err = _check_waiters(results, victim, t_stall)
    stuck = results[victim]
    record(
        case=f"rank {victim} of {N} stalls inside a collective (fault hook)",
        fault="a rank stalls",
        injected=f"BLINK_FAULT={fault}: the rank sleeps before its 31st chunk operation",
        behaviour=(
            f"waiting ranks warn after {min(warn):.2f}-{max(warn):.2f} s: \"{_first_warning(results, victim)}\"; "
            f"then raise BlinkTimeoutError: \"{error_of(results[0 if victim else 1])['message']}\"; "
            f"the stalled rank then ends with {stuck.event('error')['type'] if stuck.event('error') else stuck.returncode}, "
            f"exit {stuck.returncode}"
        ),
        seconds=max(err),
        limits=f"stall check {STALL_S:g} s, timeout {TIMEOUT_S:g} s",
        first_warning_s=min(warn),
    )
    assert STALL_S * 0.9 <= min(warn) and max(warn) < TIMEOUT_S, warn
    assert TIMEOUT_S * 0.95 <= min(err) and max(err) < TIMEOUT_S + SLACK_S, err
    assert stuck.returncode != 0 and stuck.event("done") is None


def _first_warning(results, victim: int) -> str:
    for r in results:
        if r.rank != victim:
            for e in r.events:
                if e["kind"] == "warning" and _missing_ranks(e["message"]):
                    return e["message"]
    return ""


def test_rank_frozen_by_sigstop_warns_then_times_out_and_it_ends_after_sigcont(ranks, record) -> None:
    victim = 2
    group = ranks.start(N, LOOP, timeout_seconds=TIMEOUT_S, stall_seconds=STALL_S, limit=60)
    group.wait_event(victim, "looping")
    time.sleep(0.1)
    stopped_at = group.kill(victim, signal.SIGSTOP)
    others = [r for r in range(N) if r != victim]
    for r in others:
        group.wait_exit(r, timeout=TIMEOUT_S + 10)
    resumed_at = group.kill(victim, signal.SIGCONT)
    results = group.wait(timeout=TIMEOUT_S + 10)
    # Waits began at the latest when the victim was stopped: time from there.
    warn, err = _check_waiters(results, victim, {r: stopped_at for r in others})
    stuck = results[victim]
    end = group.procs[victim]
    record(
        case=f"rank {victim} of {N} frozen by SIGSTOP (from outside)",
        fault="a rank stalls",
        injected="the test sends SIGSTOP while all ranks loop over allreduces, SIGCONT after the others exit",
        behaviour=(
            f"waiting ranks warn after {min(warn):.2f}-{max(warn):.2f} s naming rank {victim}; raise BlinkTimeoutError at "
            f"{min(err):.2f}-{max(err):.2f} s: \"{error_of(results[others[0]])['message']}\"; after SIGCONT the frozen "
            f"rank raises {stuck.event('error')['type'] if stuck.event('error') else '?'}, exit {end.returncode}"
        ),
        seconds=max(err),
        limits=f"stall check {STALL_S:g} s, timeout {TIMEOUT_S:g} s",
        first_warning_s=min(warn),
    )
    assert min(warn) > 0 and max(warn) < TIMEOUT_S + SLACK_S, warn
    assert max(err) < TIMEOUT_S + SLACK_S, err
    assert stuck.returncode == 1 and stuck.event("error") is not None, stuck.tail()
    assert error_of(stuck)["t"] - resumed_at < 5.0
