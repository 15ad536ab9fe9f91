"""Interleaved staging (placement.interleave): each staged input region gets its own flag and is
staged just before a peer reads it, with the same results as staging everything first.

Two checks: an adversarial simulation (every rank's placed ops run one at a time, the next rank
picked at random among those whose wait is satisfied; shared buffers start as NaN, so a read
before the owner's write, or after its next write, shows in the result), and the real executor
on the loopback transport, bit for bit against staging everything first.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.loopback import hand_planner, run_loopback
from support.plans import expected, values

from blink_horovod.runtime import executor as executor_mod
from blink_horovod.runtime.placement import SHARED, STAGE, USER, interleave, place
from blink_horovod.schedule import compile_program
from blink_horovod.topology.machines import cpu

pytestmark = pytest.mark.timeout(120)

SHAPES = [("star", 1, 4), ("chain", 1, 4), ("chain", 2, 4), ("star", 2, 3), ("chain", 2, 5)]


def _placements(shape: str, trees: int, n: int, count: int = 997, chunk: int = 64):
    plan = hand_planner(shape, trees)(cpu(n), "allreduce", None)
    prog = compile_program(plan, count, chunk, "allreduce")
    every = [place(prog, r, True, True) for r in range(n)]
    return prog, every


@pytest.mark.parametrize("shape,trees,n", SHAPES)
def test_every_staged_region_gets_its_own_flag_before_any_use(shape: str, trees: int, n: int) -> None:
    prog, every = _placements(shape, trees, n)
    base = max(prog.nflags)
    mixed = [interleave(prog, r, every) for r in range(n)]
    assert all(m is not None for m in mixed)
    assert len({m[1] for m in mixed}) == 1  # every rank reserves the same flags
    for r, (pl, nflags) in enumerate(mixed):
        assert pl.stage_in == ()  # all of it interleaved
        assert pl.stage_out == every[r].stage_out
        staged = [(i, o) for i, o in enumerate(pl.ops) if o[0] == STAGE]
        assert sum(o[4] - o[3] for _, o in staged) == sum(b - a for a, b in every[r].stage_in)
        for i, o in staged:
            post = pl.ops[i + 1]
            assert post[0] == 2 and base <= post[2] < nflags and (post[3], post[4]) == (o[3], o[4])
            writes = [j for j, w in enumerate(pl.ops) if w[0] in (0, 1) and (w[3], w[4]) == (o[3], o[4])]
            assert all(j > i for j in writes)
        # Reads under START_FLAG are gone: each waits for the owner's flag of that region.
        assert not any(o[0] in (0, 1) and o[2] == 0 for o in pl.ops)
        # Same ops otherwise, in the same order.
        rest = [o for o in pl.ops if o[0] != STAGE and not (o[0] == 2 and o[2] >= base)]
        assert [o[:2] + o[3:] for o in rest] == [o[:2] + o[3:] for o in every[r].ops]


def _simulate(prog, pls, seed: int) -> list[np.ndarray]:
    n, count = prog.nranks, prog.count
    rng = random.Random(seed)
    user = [np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(n)]
    shared = [np.full(count, np.nan) for _ in range(n)]
    flags = [set() for _ in range(n)]
    for r in range(n):
        for a, b in pls[r].stage_in:
            shared[r][a:b] = user[r][a:b]
    pos = [0] * n
    while True:
        ready = []
        for r in range(n):
            if pos[r] < len(pls[r].ops):
                kind, peer, flag = pls[r].ops[pos[r]][:3]
                if kind in (0, 1) and flag not in flags[peer]:
                    continue
                ready.append(r)
        if not ready:
            break
        r = rng.choice(ready)
        kind, peer, flag, a, b, src, dst = pls[r].ops[pos[r]]
        pos[r] += 1
        where = (shared[r], user[r])
        if kind == 2:
            flags[r].add(flag)
        elif kind == STAGE:
            shared[r][a:b] = user[r][a:b]
        elif kind == 0:
            where[dst][a:b] = shared[peer][a:b]
        else:
            where[dst][a:b] = where[src][a:b] + shared[peer][a:b]
    assert all(pos[r] == len(pls[r].ops) for r in range(n)), "deadlock"
    for r in range(n):
        for a, b in pls[r].stage_out:
            user[r][a:b] = shared[r][a:b]
    return user


@pytest.mark.parametrize("shape,trees,n", SHAPES)
def test_adversarial_schedules_give_the_sum(shape: str, trees: int, n: int) -> None:
    prog, every = _placements(shape, trees, n)
    mixed = [interleave(prog, r, every)[0] for r in range(n)]
    want = sum(np.arange(prog.count, dtype=np.float64) * (r + 1) + r for r in range(n))
    for seed in range(20):
        for pls in (every, mixed):
            for got in _simulate(prog, pls, seed):
                np.testing.assert_array_equal(got, want)


def test_simulation_catches_a_missing_stage() -> None:
    """The check has teeth: drop one staging op and some schedule reads NaN or deadlocks."""
    prog, every = _placements("chain", 2, 4)
    mixed = [interleave(prog, r, every)[0] for r in range(4)]
    r, i = next((r, i) for r in range(4) for i, o in enumerate(mixed[r].ops) if o[0] == STAGE)
    ops = list(mixed[r].ops)
    ops[i] = (2, -1, 0, 0, 0, SHARED, SHARED)  # a harmless post instead of the copy
    mixed[r] = type(mixed[r])(tuple(ops), mixed[r].stage_in, mixed[r].stage_out, True)
    want = sum(np.arange(prog.count, dtype=np.float64) * (q + 1) + q for q in range(4))
    assert any(not np.array_equal(got, want) for got in _simulate(prog, mixed, 0))


def test_not_interleaved_when_a_placement_is_plain() -> None:
    prog, every = _placements("chain", 1, 4)
    every[2] = type(every[2])(every[2].ops, every[2].stage_in, every[2].stage_out, False)
    assert interleave(prog, 0, every) is None
    assert USER != SHARED


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape,trees", [("star", 1), ("chain", 2)])
def test_executor_results_bit_identical_with_and_without(monkeypatch, shape: str, trees: int, fused: bool) -> None:
    monkeypatch.setattr(executor_mod, "_FUSE", fused)
    count, dtype = 3001, "float32"

    def run(on: bool) -> list:
        monkeypatch.setattr(executor_mod, "_INTERLEAVE", on)

        def body(r, comm):
            outs = []
            for op in ("sum", "average", "max"):
                for _ in range(2):  # a second epoch over the same program and flags
                    x = values(r, count, dtype, op)
                    comm.allreduce(x, op)
                    outs.append(x)
            staged = [any(o[0] == STAGE for o in lw.placement.ops) for lw in comm._executor._lowered.values()]
            assert staged and all(staged) == on
            return outs

        return run_loopback(4, body, planner=hand_planner(shape, trees), env={"BLINK_CHUNK_BYTES": "1000"})

    on, off = run(True), run(False)
    for a, b in zip(on, off):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()
    np.testing.assert_array_equal(on[0][0].astype(np.float64), expected(4, count, dtype, "sum"))
