"""The GPU executor's lowering, run by the reference interpreter: same results as the CPU executor.

No GPU needed: programs from the real schedule compiler (random plans) are
lowered per rank to device commands (barrier, reset, staging, waits, writes,
copies, reductions, event joins) and executed by
:mod:`blink_horovod.runtime.gpu.interpret` under random interleavings, with
every rank's commands also serialised onto few FIFO queues (as CUDA may map
graph branches), and with a happens-before race check.  Results must equal,
bit for bit, those of the CPU executor (real ``Executor`` over the loopback
transport) for the same sequence of collectives.  Broken lowerings (no order
edges, no barrier, no flag reset, unordered launches) must fail, so the
checks have teeth.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import numpy as np
import pytest

from blink_horovod.errors import BlinkInternalError
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.dtypes import (
    DTYPES,
    OPS,
    bf16_to_f32,
    f32_to_bf16,
    finish_average,
    numpy_dtype,
)
from blink_horovod.runtime.executor import Executor, Piece
from blink_horovod.runtime.gpu.interpret import Launch, World, run_launches
from blink_horovod.runtime.gpu.lowering import (
    DONE_WORD,
    JOIN,
    RESET,
    WAIT,
    WRITE,
    accept_mask,
    epoch_value,
    lower,
    plain_runs,
)
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.schedule import check_program, compile_program

pytestmark = pytest.mark.timeout(240)


# -- programs ------------------------------------------------------------------------------------


def random_plan(rng: random.Random, n: int, collective: str) -> Plan:
    gpus = tuple(rng.sample(range(8), n))

    def edges(root: int) -> tuple[tuple[int, int], ...]:
        order = [root] + rng.sample([g for g in gpus if g != root], n - 1)
        return tuple((order[rng.randrange(i)], order[i]) for i in range(1, n))

    trees = []
    if collective == "allreduce":
        for g in gpus:
            k = rng.randint(1, 2)
            ws = [rng.uniform(0.2, 1.0) for _ in range(k)]
            trees += [Tree(g, w / sum(ws) / n, edges(g), rng.choice(["nvlink", "nvlink", "pcie"])) for w in ws]
        root = None
    else:
        root = rng.choice(gpus)
        ws = [rng.uniform(0.2, 1.0) for _ in range(rng.randint(1, 3))]
        trees = [Tree(root, w / sum(ws), edges(root), rng.choice(["nvlink", "pcie"])) for w in ws]
    return Plan(collective, "custom", gpus, root, tuple(trees), 1.0, 1.0)


@dataclasses.dataclass
class Collective:
    """One collective as the communicator issues it: per-rank pieces (here one), dtype, op, inputs."""

    kind: str
    pieces: list[Piece]  # per rank
    dtype: str
    op: str
    inputs: list[np.ndarray]


def values(rng: np.random.Generator, count: int, dtype: str, op: str, n: int = 1) -> np.ndarray:
    if op == "average":  # multiples of n: the average is exact in every dtype
        v = n * rng.integers(0 if dtype == "uint8" else -3, 4, count)
    elif op == "product":
        v = rng.choice([1, 1, 2, -1] if dtype != "uint8" else [1, 1, 2], count)
    else:
        v = rng.integers(0 if dtype == "uint8" else -6, 7, count)
    if dtype == "bfloat16" and numpy_dtype(dtype) == np.uint16:  # no ml_dtypes: bit patterns
        return f32_to_bf16(v.astype(np.float32))
    return v.astype(numpy_dtype(dtype))


def as_f64(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16" and x.dtype == np.uint16:
        return bf16_to_f32(x).astype(np.float64)
    return x.astype(np.float64)


def make_collective(rng: random.Random, plan: Plan, kind: str, count: int, chunk: int, dtype: str, op: str,
                    broadcast_root: int | None = None) -> Collective:
    prog = compile_program(plan, count, chunk, kind)
    check_program(prog, plan)
    n = plan.n
    if kind == "allreduce":
        pieces = [Piece(prog, direct=0) for _ in range(n)]
    elif kind == "broadcast" and plan.collective == "broadcast":
        root = prog.root
        pieces = [Piece(prog, direct=0, has_input=r == root, wants_output=r != root) for r in range(n)]
        op = "sum"
    else:
        runs = [(lo, lo, hi - lo) for lo, hi in prog.segments]
        if kind == "reduce":
            pieces = [Piece(prog, runs, [runs[r]]) for r in range(n)]
        else:  # broadcast_from_roots
            pieces = [Piece(prog, [runs[r]], [x for i, x in enumerate(runs) if i != r]) for r in range(n)]
            op = "sum"
    g = np.random.default_rng(rng.randrange(1 << 30))
    return Collective(kind, pieces, dtype, op, [values(g, count, dtype, op, n) for _ in range(n)])


def stage_runs(piece: Piece):
    if piece.direct is not None:
        return plain_runs(piece.program, piece.has_input, piece.wants_output)
    return tuple(piece.stage_in), tuple(piece.stage_out)


def out_regions(piece: Piece) -> list[tuple[int, int]]:
    _, out = stage_runs(piece)
    return [(u, u + m) for u, _, m in out]


# -- the two executors ----------------------------------------------------------------------------


def cpu_results(seq: list[Collective]) -> list[list[np.ndarray]]:
    """Every rank's arrays after each collective, from the real CPU executor over loopback."""
    n = len(seq[0].pieces)
    world = LoopbackWorld(n, data_bytes=1 << 12, nflags=8)
    out: list[list[np.ndarray | None]] = [[None] * n for _ in seq]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        ex = Executor(world.transport(r), 30.0, 60.0)
        try:
            for k, c in enumerate(seq):
                arr = c.inputs[r].copy()
                checked = {"collective": c.kind, "name": f"c{k}", "dtype": c.dtype, "shape": [arr.size], "op": c.op}
                ex.collective(f"c{k}", checked, {}, arr, c.dtype, c.op, lambda _e, p=c.pieces[r]: [p])
                if c.op == "average":  # the communicator's job on CPU
                    for a, b in out_regions(c.pieces[r]):
                        finish_average(arr[a:b], n, c.dtype)
                out[k][r] = arr
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            ex.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out  # type: ignore[return-value]


def gpu_results(seq: list[Collective], seed: int | None, channels: int | None = None, transform=None,
                same_stream: bool = True, first_epoch: int = 1) -> list[list[np.ndarray]]:
    """The same collectives through the lowering and the interpreter (one graph launch per piece)."""
    n = len(seq[0].pieces)
    cap = max(c.inputs[0].size for c in seq) + 3
    launches: list[list[Launch]] = [[] for _ in range(n)]
    outs = [[c.inputs[r].copy() for r in range(n)] for c in seq]
    nwords = 1
    for k, c in enumerate(seq):
        for r in range(n):
            piece = c.pieces[r]
            si, so = stage_runs(piece)
            lw = lower(piece.program, r, si, so)
            if transform is not None:
                lw = transform(lw)
            nwords = max(nwords, lw.nwords)
            launches[r].append(Launch(lw, first_epoch + k, outs[k][r], c.op, c.dtype))
    dt = numpy_dtype(seq[0].dtype)
    world = World.make(n, cap, nwords + 2, dt, epoch=first_epoch - 1)
    run_launches(world, launches, seed=seed, channels=channels, same_stream=same_stream)
    return outs


def expected(c: Collective, r: int) -> np.ndarray:
    """The mathematically right result of rank r (integer data: exact in every dtype)."""
    xs = [as_f64(x, c.dtype) for x in c.inputs]
    n = len(xs)
    full = {"sum": np.sum, "average": np.sum, "min": np.min, "max": np.max, "product": np.prod}[c.op](xs, axis=0)
    if c.op == "average":
        full = full / n
        if numpy_dtype(c.dtype).kind in "iu":
            full = np.trunc(np.sum(xs, axis=0) * (1.0 / n))
    prog = c.pieces[r].program
    want = xs[r].copy()
    if c.kind == "allreduce":
        return full
    if c.kind == "broadcast" and c.pieces[r].direct is not None:
        return xs[prog.root]
    if c.kind == "reduce":
        lo, hi = prog.segments[r]
        want[lo:hi] = full[lo:hi]
        return want
    for i, (lo, hi) in enumerate(prog.segments):
        want[lo:hi] = xs[i][lo:hi]
    return want


def random_sequence(seed: int, n: int | None = None, length: int = 4, dtype: str | None = None) -> list[Collective]:
    rng = random.Random(seed)
    n = n or rng.randint(2, 5)
    ar = random_plan(rng, n, "allreduce")
    bc = random_plan(rng, n, "broadcast")
    dt = dtype or rng.choice(DTYPES)
    seq = []
    for _ in range(length):
        kind, plan = rng.choice([("allreduce", ar), ("reduce", ar), ("broadcast", ar), ("broadcast", bc), ("allreduce", ar)])
        count = rng.randint(1, 160)
        chunk = rng.choice([3, 8, 16, 64])
        seq.append(make_collective(rng, plan, kind, count, chunk, dt, rng.choice(OPS)))
    return seq


def assert_same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> None:
    for k, (xa, xb) in enumerate(zip(a, b)):
        for r, (u, v) in enumerate(zip(xa, xb)):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8), err_msg=f"collective {k}, rank {r}")


# -- tests ------------------------------------------------------------------------------------------


def test_epoch_values_are_one_hot_and_masks_separate_neighbouring_epochs() -> None:
    for e in range(1, 10):
        assert epoch_value(e) in (1, 2, 4)
        assert epoch_value(e) != epoch_value(e - 1)
        assert epoch_value(e) == epoch_value(e + 3)
        # A flag of epoch e-1 never satisfies a wait of epoch e; a barrier accepts e-1 and e, not e-2.
        assert not epoch_value(e - 1) & accept_mask(e, (0,))
        assert accept_mask(e, (-1, 0)) & epoch_value(e - 1) and accept_mask(e, (-1, 0)) & epoch_value(e)
        assert not accept_mask(e, (-1, 0)) & epoch_value(e - 2)


def test_lowering_shape_header_lanes_footer() -> None:
    rng = random.Random(3)
    plan = random_plan(rng, 4, "allreduce")
    prog = compile_program(plan, 200, 16, "allreduce")
    for r in range(4):
        lw = lower(prog, r, ((0, 0, 200),), ((0, 0, 200),))
        cmds = lw.cmds
        assert [c.kind for c in cmds[:4]] == [WAIT] * 4 and {c.peer for c in cmds[:4]} == {0, 1, 2, 3}
        assert all(c.word == DONE_WORD and c.accept == (-1, 0) for c in cmds[:4])
        assert cmds[4].kind == RESET
        assert cmds[-1].kind == WRITE and cmds[-1].word == DONE_WORD and cmds[-1].stream == 0
        streams = lw.by_stream()
        assert len(streams) == prog.nstreams[r] + 1
        for s in streams[1:]:
            assert s[0].kind == JOIN  # every lane enters the capture by an event
        # Every op of the program is there, on its lane.
        ops_seen = {c.op for c in cmds if c.op >= 0 and c.kind != JOIN}
        assert ops_seen == {i for i, o in enumerate(prog.ranks[r]) if o.kind == "post" or o.count}
        for c in cmds:
            if c.op >= 0:
                assert c.stream == prog.ranks[r][c.op].stream + 1
        # A lane waits for a (peer, flag) once.
        for s in streams:
            keys = [(c.peer, c.word) for c in s if c.kind == WAIT]
            assert len(keys) == len(set(keys))
        assert lw.nwords == 1 + max(prog.nflags)


def test_single_lane_program_needs_no_order_edges() -> None:
    plan = Plan("broadcast", "custom", (0, 1, 2), 0, (Tree(0, 1.0, ((0, 1), (1, 2))),), 1.0, 1.0)
    prog = compile_program(plan, 50, 8)
    for r in range(3):
        assert lower(prog, r).order_edges == 0


@pytest.mark.parametrize("seed", range(24))
def test_random_sequences_match_the_cpu_executor(seed: int) -> None:
    seq = random_sequence(seed)
    cpu = cpu_results(seq)
    for k, c in enumerate(seq):
        for r in range(len(c.inputs)):
            np.testing.assert_array_equal(as_f64(cpu[k][r], c.dtype), expected(c, r), err_msg=f"cpu {k} {r}")
    assert_same(gpu_results(seq, seed=seed), cpu)
    assert_same(gpu_results(seq, seed=seed + 1000, channels=1), cpu)
    assert_same(gpu_results(seq, seed=seed + 2000, channels=2), cpu)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_non_integer_floats_bit_identical_to_cpu(dtype: str) -> None:
    """Same reduction order as the CPU executor: identical bits, not just close values."""
    rng = random.Random(11)
    plan = random_plan(rng, 4, "allreduce")
    seq = [make_collective(rng, plan, "allreduce", 150, 16, dtype, "sum")]
    g = np.random.default_rng(5)
    seq[0].inputs = [g.standard_normal(150).astype(dtype) for _ in range(4)]
    assert_same(gpu_results(seq, seed=1, channels=1), cpu_results(seq))


def _multi_tree_sequence(length: int = 3) -> list[Collective]:
    rng = random.Random(7)
    gpus = (0, 1, 2, 3)
    trees = (
        Tree(0, 0.25, ((0, 1), (1, 2), (2, 3))),
        Tree(1, 0.25, ((1, 0), (1, 2), (2, 3))),
        Tree(2, 0.25, ((2, 3), (3, 0), (0, 1))),
        Tree(3, 0.25, ((3, 2), (3, 1), (1, 0))),
    )
    plan = Plan("allreduce", "custom", gpus, None, trees, 1.0, 1.0)
    return [make_collective(rng, plan, "allreduce", 103, 8, "float32", "sum") for _ in range(length)]


def test_without_order_edges_a_serialised_queue_deadlocks() -> None:
    """CUDA may put independent branches on one hardware queue: the order edges are what keeps that safe."""
    seq = _multi_tree_sequence(1)
    no_edges = lambda lw: lower(
        seq[0].pieces[lw.rank].program, lw.rank, *stage_runs(seq[0].pieces[lw.rank]), order_edges=False
    )
    deadlocks = 0
    for seed in range(8):
        try:
            gpu_results(seq, seed=seed, channels=1, transform=no_edges)
        except BlinkInternalError as exc:
            assert "deadlock" in str(exc)
            deadlocks += 1
    assert deadlocks > 0
    cpu = cpu_results(seq)
    for seed in range(8):
        assert_same(gpu_results(seq, seed=seed, channels=1), cpu)


def test_without_the_barrier_the_race_check_fires() -> None:
    seq = _multi_tree_sequence(3)
    drop = lambda lw: dataclasses.replace(
        lw, cmds=tuple(c for c in lw.cmds if not (c.kind == WAIT and c.word == DONE_WORD))
    )
    failures = 0
    for seed in range(6):
        try:
            gpu_results(seq, seed=seed, transform=drop)
        except BlinkInternalError as exc:
            assert "race" in str(exc) or "deadlock" in str(exc)
            failures += 1
    assert failures > 0


def test_without_the_flag_reset_stale_flags_three_epochs_old_are_read() -> None:
    """A flag unused for two epochs still holds the value of e-3 == the value of e: the reset is needed."""
    rng = random.Random(2)
    plan = random_plan(rng, 3, "allreduce")
    big = make_collective(rng, plan, "allreduce", 120, 2, "int32", "sum")  # many flags
    small = make_collective(rng, plan, "allreduce", 6, 64, "int32", "sum")  # few flags
    seq = [big, small, small, make_collective(rng, plan, "allreduce", 120, 2, "int32", "sum")]
    cpu = cpu_results(seq)
    for seed in range(4):
        assert_same(gpu_results(seq, seed=seed), cpu)
    drop = lambda lw: dataclasses.replace(lw, cmds=tuple(c for c in lw.cmds if c.kind != RESET))
    failures = 0
    for seed in range(6):
        try:
            out = gpu_results(seq, seed=seed, transform=drop)
            failures += any(not np.array_equal(u, v) for xs, ys in zip(out, cpu) for u, v in zip(xs, ys))
        except BlinkInternalError:
            failures += 1
    assert failures > 0


def test_graphs_must_be_launched_in_order() -> None:
    """Graphs of one rank running concurrently (different streams, unordered) break the 3-residue
    barrier; the executor orders every launch after the previous one, which the interpreter models."""
    seq = _multi_tree_sequence(4)
    failures = 0
    for seed in range(6):
        try:
            out = gpu_results(seq, seed=seed, same_stream=False)
            failures += any(not np.array_equal(u, v) for xs, ys in zip(out, cpu_results(seq)) for u, v in zip(xs, ys))
        except BlinkInternalError:
            failures += 1
    assert failures > 0


def test_epochs_far_from_zero_and_every_residue() -> None:
    seq = _multi_tree_sequence(3)
    cpu = cpu_results(seq)
    for first in (1, 2, 3, 1000, 2**31 + 5):
        assert_same(gpu_results(seq, seed=first, first_epoch=first), cpu)


def test_bad_programs_are_refused() -> None:
    plan = Plan("broadcast", "custom", (0, 1, 2), 0, (Tree(0, 1.0, ((0, 1), (1, 2))),), 1.0, 1.0)
    prog = compile_program(plan, 20, 8)
    with pytest.raises(BlinkInternalError, match="rank 5"):
        lower(prog, 5)
    bad = dataclasses.replace(prog, ranks=(prog.ranks[0], tuple(dataclasses.replace(o, peer=1) if o.kind == "copy" else o
                                                                for o in prog.ranks[1]), prog.ranks[2]))
    with pytest.raises(BlinkInternalError, match="reads rank 1"):
        lower(bad, 1)
    with pytest.raises(BlinkInternalError, match="staging run"):
        lower(prog, 1, ((0, 0, 21),))
