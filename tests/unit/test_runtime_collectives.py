"""The executor and communicator over the loopback transport: exact results for every dtype and op.

Data are small integers, exactly representable in every dtype (nccl-tests'
idea), so results are compared exactly.  Programs come from the real schedule
compiler on hand-made chain and star plans (``support.loopback``).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.loopback import hand_planner, run_loopback
from support.plans import expected, values

from blink_horovod.runtime import communicator as communicator_mod
from blink_horovod.runtime import executor as executor_mod
from blink_horovod.runtime.communicator import segment_bounds
from blink_horovod.runtime.dtypes import DTYPES, OPS

pytestmark = pytest.mark.timeout(120)


def test_hand_plans_are_valid() -> None:
    from blink_horovod.planner.plan import validate_plan
    from blink_horovod.topology.machines import cpu

    topo = cpu(4)
    for shape in ("chain", "star"):
        for k in (1, 2):
            validate_plan(hand_planner(shape, k)(topo, "allreduce", None), topo)
            validate_plan(hand_planner(shape, k)(topo, "broadcast", 2), topo)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_dtype_and_op(dtype: str, op: str) -> None:
    n, count = 4, 1031

    def body(r, comm):
        x = values(r, count, dtype, op)
        comm.allreduce(x, op, name="x")
        return x.astype(np.float64)

    env = {"BLINK_CHUNK_BYTES": "256"}
    for out in run_loopback(n, body, env=env):
        np.testing.assert_array_equal(out, expected(n, count, dtype, op))


@pytest.mark.parametrize("shape", ["chain", "star"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_allreduce_shapes_and_sizes(shape: str, n: int) -> None:
    counts = [1, 2, 7, 100, 4099]

    def body(r, comm):
        outs = []
        for i, c in enumerate(counts):
            x = values(r, c, "float32", "sum", seed=i)
            comm.allreduce(x)
            outs.append(x)
        return outs

    for outs in run_loopback(n, body, planner=hand_planner(shape, 2), env={"BLINK_CHUNK_BYTES": "64"}):
        for i, (c, x) in enumerate(zip(counts, outs)):
            np.testing.assert_array_equal(x, expected(n, c, "float32", "sum", seed=i))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_root(dtype: str) -> None:
    n, count = 4, 777

    def body(r, comm):
        outs = []
        for root in range(n):
            x = values(r, count, dtype, "sum", seed=root)
            comm.broadcast(x, root)
            outs.append(x.astype(np.float64))
        return outs

    for r, outs in enumerate(run_loopback(n, body, env={"BLINK_CHUNK_BYTES": "512"})):
        for root, x in enumerate(outs):
            np.testing.assert_array_equal(x, values(root, count, dtype, "sum", seed=root).astype(np.float64))


def test_root_array_is_untouched_and_multidimensional_shapes_work() -> None:
    def body(r, comm):
        x = np.arange(24, dtype=np.int64).reshape(2, 3, 4) * (r + 1)
        keep = x.copy()
        comm.broadcast(x, 1)
        y = np.full((3, 5), r, np.float64)
        comm.allreduce(y, "max")
        return r, x, keep, y

    for r, x, keep, y in run_loopback(3, body):
        np.testing.assert_array_equal(x, np.arange(24).reshape(2, 3, 4) * 2)
        if r == 1:
            np.testing.assert_array_equal(x, keep)
        assert y.shape == (3, 5) and (y == 2).all()


def test_hierarchical_stages_equal_allreduce(monkeypatch) -> None:
    # Small pieces: the stages must keep each rank's segment across pieces.
    monkeypatch.setattr(communicator_mod, "MAX_PIECE_BYTES", 4 * 40)
    n = 3
    counts = [5, 119, 120, 121, 1000]

    def body(r, comm):
        outs = []
        for i, c in enumerate(counts):
            x = values(r, c, "int64", "sum", seed=i)
            start, end = comm.reduce_to_roots(x, "sum")
            assert (start, end) == segment_bounds(c, n, r)
            seg = x[start:end].copy()
            comm.broadcast_from_roots(x)
            outs.append((seg, x))
        return outs

    for r, outs in enumerate(run_loopback(n, body, env={"BLINK_CHUNK_BYTES": "48"})):
        for i, (c, (seg, x)) in enumerate(zip(counts, outs)):
            want = expected(n, c, "int64", "sum", seed=i)
            lo, hi = segment_bounds(c, n, r)
            np.testing.assert_array_equal(seg, want[lo:hi])
            np.testing.assert_array_equal(x, want)


def test_pieces_and_buffer_growth(monkeypatch) -> None:
    monkeypatch.setattr(communicator_mod, "MAX_PIECE_BYTES", 8 * 1000)
    counts = [10, 5000, 3, 20000, 999, 1001]

    def body(r, comm):
        outs = []
        for i, c in enumerate(counts):
            x = values(r, c, "float64", "sum", seed=i)
            comm.allreduce(x)
            b = values(r, c, "float64", "sum", seed=i)
            comm.broadcast(b, i % 4)
            outs.append((x, b))
        return outs

    for outs in run_loopback(4, body, env={"BLINK_CHUNK_BYTES": "800"}):
        for i, (c, (x, b)) in enumerate(zip(counts, outs)):
            np.testing.assert_array_equal(x, expected(4, c, "float64", "sum", seed=i))
            np.testing.assert_array_equal(b, values(i % 4, c, "float64", "sum", seed=i))


def test_direct_placement_matches_plain_staging(monkeypatch) -> None:
    """The placement optimisation changes where values live, never the results."""
    def run(place: bool):
        monkeypatch.setattr(executor_mod, "_PLACE", place)

        def body(r, comm):
            x = values(r, 3000, "float32", "sum")
            comm.allreduce(x)
            b = values(r, 3000, "float32", "sum")
            comm.broadcast(b, 2)
            return x, b

        return run_loopback(4, body, planner=hand_planner("chain", 2), env={"BLINK_CHUNK_BYTES": "400"})

    for (x1, b1), (x2, b2) in zip(run(True), run(False)):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(b1, b2)


def test_allgather_object_and_barrier() -> None:
    def body(r, comm):
        got = comm.allgather_object({"rank": r, "blob": "x" * (100 * r)})
        comm.barrier()
        return got

    for got in run_loopback(3, body):
        assert [g["rank"] for g in got] == [0, 1, 2] and len(got[2]["blob"]) == 200


def test_single_rank_is_the_identity() -> None:
    from blink_horovod.config import load_config
    from blink_horovod.runtime.communicator import Communicator

    comm = Communicator(0, 1, None, None, load_config({}))
    x = np.arange(10, dtype=np.float32)
    comm.allreduce(x, "average")
    comm.broadcast(x, 0)
    assert comm.reduce_to_roots(x) == (0, 10)
    np.testing.assert_array_equal(x, np.arange(10))
    comm.close()


def test_miad_tunes_the_chunk_the_same_on_every_rank() -> None:
    count = 1 << 18  # 1 MiB of float32: MIAD starts at 1 MiB, tries smaller sizes after

    def body(r, comm):
        sizes = []
        for i in range(16):
            x = values(r, count, "float32", "sum", seed=i % 2)
            comm.allreduce(x)
            np.testing.assert_array_equal(x, expected(4, count, "float32", "sum", seed=i % 2))
            sizes.append(dict(comm.chunk_sizes()))
        return sizes

    per_rank = run_loopback(4, body)
    assert all(s == per_rank[0] for s in per_rank)  # every rank took the same decisions
    assert ("allreduce", 1 << 20) in per_rank[0][-1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_path_every_op_and_kind(dtype: str) -> None:
    """Small messages on a fully connected server take one round; same results."""
    n, count = 4, 301

    def body(r, comm):
        assert comm.eager_bytes > 0
        outs = {}
        for op in OPS:
            x = values(r, count, dtype, op)
            comm.allreduce(x, op)
            outs[op] = x.astype(np.float64)
        b = values(r, count, dtype, "sum", seed=3)
        comm.broadcast(b, 2)
        outs["bcast"] = b.astype(np.float64)
        h = values(r, count, dtype, "sum", seed=4)
        start, end = comm.reduce_to_roots(h, "sum")
        outs["seg"] = (start, end, h[start:end].astype(np.float64))
        comm.broadcast_from_roots(h)
        outs["stages"] = h.astype(np.float64)
        return outs

    for outs in run_loopback(n, body, eager=True):
        for op in OPS:
            np.testing.assert_array_equal(outs[op], expected(n, count, dtype, op))
        np.testing.assert_array_equal(outs["bcast"], values(2, count, dtype, "sum", seed=3).astype(np.float64))
        start, end, seg = outs["seg"]
        np.testing.assert_array_equal(seg, expected(n, count, dtype, "sum", seed=4)[start:end])
        np.testing.assert_array_equal(outs["stages"], expected(n, count, dtype, "sum", seed=4))


def test_eager_results_are_bitwise_identical_on_every_rank() -> None:
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]

    def body(r, comm):
        x = data[r].copy()
        comm.allreduce(x)
        return x

    outs = run_loopback(5, body, eager=True)
    for x in outs[1:]:
        assert x.tobytes() == outs[0].tobytes()


def test_eager_only_on_fully_connected_servers() -> None:
    from blink_horovod.runtime.communicator import fully_connected
    from blink_horovod.topology.machines import cpu, resolve

    assert fully_connected(cpu(4)) and fully_connected(resolve("dgx2")) and fully_connected(resolve("dgx1v:0,1,2,3"))
    assert not fully_connected(resolve("dgx1v:0,1,4,5")) and not fully_connected(resolve("dgx1v"))
