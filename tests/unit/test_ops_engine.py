"""The Blink engine end to end in one process: real communicators (loopback shared buffers), real plans.

Each "rank" is a thread with its own engine; servers are loopback worlds of
the runtime and the cross-server stage is :mod:`blink_horovod.ops.loopback`
(the in-process stand-in for Horovod's rings).  Data are small integers, so
every result is checked exactly: sums, Horovod's integer average, pre/post
scaling, broadcasts from a root on the second server, fusion of queued
collectives, mismatches raised on every rank, ``join`` and duplicate names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from blink_horovod.ops.engine import Engine, Work
from blink_horovod.ops.hierarchical import Hierarchy
from blink_horovod.ops.layout import Layout
from blink_horovod.ops.loopback import LoopbackCrossWorld
from blink_horovod.ops.negotiation import Meta
from blink_horovod.ops.scaling import scale_into
from support.ranks import run_ranks

from blink_horovod.config import load_config
from blink_horovod.errors import BlinkInternalError, MismatchError
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.topology.machines import cpu

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config({"BLINK_PLAN_CACHE": str(tmp_path_factory.mktemp("plans")), "BLINK_TIMEOUT_SECONDS": "30"})


def run_job(cfg, servers: int, local: int, body: Callable[[int, Engine], Any], fusion_bytes: int = 1 << 20,
            eager_bytes: int = 0) -> list:
    """Run ``body(rank, engine)`` on ``servers x local`` thread ranks; re-raise the lowest failing rank's error."""
    size = servers * local
    worlds = [LoopbackWorld(local) for _ in range(servers)]
    cross_world = LoopbackCrossWorld(size, timeout=30)

    def rank_main(rank: int) -> Any:
        layout = Layout(rank, size, local)
        comm = engine = None
        try:
            if local > 1:
                comm = Communicator(layout.local_rank, local, cpu(local), None, cfg,
                                    transport=worlds[layout.server].transport(layout.local_rank))
            cross = cross_world.transport(rank) if servers > 1 else None
            intra = comm.allgather_object if comm is not None else (lambda o: [o])
            xag = (lambda row, name: cross.allgather_rows(row, layout.cross_ranks(), name)) if cross else None
            engine = Engine(rank, size, layout.server, Hierarchy(layout, comm, cross), intra, xag, 30.0, fusion_bytes,
                            eager_bytes=eager_bytes)
            return body(rank, engine)
        finally:
            if engine is not None:
                engine.close()
            if comm is not None:
                comm.close()

    return run_ranks(rank_main, size, 120)


def allreduce(engine: Engine, arr: np.ndarray, op: str = "sum", name: str | None = None, pre: float = 1.0,
              post: float = 1.0, wait: bool = True):
    if pre != 1.0:
        scale_into(arr, arr, pre)
    meta = Meta("allreduce", name, (arr.dtype.name,), (arr.shape,), op=op, prescale=pre, postscale=post)
    h = engine.submit(Work(meta=meta, handle=engine.new_handle(name), arrays=[arr], finish=lambda: arr))
    return h.wait() if wait else h


def broadcast(engine: Engine, arr: np.ndarray, root: int, name: str | None = None):
    meta = Meta("broadcast", name, (arr.dtype.name,), (arr.shape,), root=root)
    return engine.submit(Work(meta=meta, handle=engine.new_handle(name), arrays=[arr], finish=lambda: arr)).wait()


def join(engine: Engine) -> int:
    h = engine.new_handle(None)
    engine.submit(Work(meta=Meta("barrier", None, (), ()), handle=h, join=True))
    return h.wait()


def barrier(engine: Engine) -> None:
    h = engine.new_handle(None)
    engine.submit(Work(meta=Meta("barrier", None, (), ()), handle=h))
    h.wait()


def data(rank: int, n: int, dtype: str) -> np.ndarray:
    return ((np.arange(n) % 7) - 3 + rank).astype(dtype)


@pytest.mark.parametrize("servers,local", [(1, 3), (2, 2), (3, 1)])
def test_allreduce_sum_min_max_exact(cfg, servers: int, local: int) -> None:
    size = servers * local

    def body(rank, engine):
        out = {}
        for dt in ("int32", "float32", "int8", "uint8", "int16", "float64", "float16"):
            x = data(rank, 1001, dt)
            allreduce(engine, x, "sum")
            out[dt] = x
        lo = allreduce(engine, data(rank, 10, "int64"), "min")
        hi = allreduce(engine, data(rank, 10, "int64"), "max")
        return out, lo, hi

    for out, lo, hi in run_job(cfg, servers, local, body):
        for dt, x in out.items():
            want = sum(data(r, 1001, "int64") for r in range(size)).astype(dt)
            np.testing.assert_array_equal(x, want, err_msg=dt)
        np.testing.assert_array_equal(lo, data(0, 10, "int64"))
        np.testing.assert_array_equal(hi, data(size - 1, 10, "int64"))


def test_average_and_scaling_follow_horovod(cfg) -> None:
    """Average = sum * (post / size) with Horovod's rules: ints truncate toward zero, float32 math in float32."""
    size = 4

    def body(rank, engine):
        a = np.array([-7, -3, 1, 5, 6], dtype=np.int32) + rank
        allreduce(engine, a, "average")
        f = np.linspace(-2, 2, 9, dtype=np.float32) * (rank + 1)
        allreduce(engine, f, "sum", pre=0.3, post=1.7)
        return a, f

    for a, f in run_job(cfg, 2, 2, body):
        s = sum(np.array([-7, -3, 1, 5, 6], dtype=np.int64) + r for r in range(size))
        np.testing.assert_array_equal(a, np.trunc(s * (1.0 / size)).astype(np.int32))
        parts = [np.linspace(-2, 2, 9, dtype=np.float32) * (r + 1) * np.float32(0.3) for r in range(size)]
        # The tree sums in its own order; compare to float64 within float32 rounding.
        np.testing.assert_allclose(f, np.sum(parts, axis=0, dtype=np.float64) * np.float32(1.7), rtol=1e-6, atol=1e-6)


def test_broadcast_from_every_root_including_second_server(cfg) -> None:
    size = 4

    def body(rank, engine):
        got = []
        for root in range(size):
            x = np.full(37, rank * 10, dtype=np.int64)
            broadcast(engine, x, root)
            got.append(x.copy())
        return got

    for got in run_job(cfg, 2, 2, body):
        for root, x in enumerate(got):
            np.testing.assert_array_equal(x, np.full(37, root * 10))


def test_queued_collectives_fuse_into_few_rounds(cfg) -> None:
    def body(rank, engine):
        arrays = [np.full(5 + i, i + rank, dtype=np.float32) for i in range(20)]
        handles = [allreduce(engine, a, "sum", wait=False) for a in arrays]
        outs = [h.wait() for h in handles]
        return outs, engine._round

    for outs, rounds in run_job(cfg, 2, 2, body):
        for i, o in enumerate(outs):
            np.testing.assert_array_equal(o, np.full(5 + i, 4 * i + 6, dtype=np.float32))
        assert rounds < 20  # several queued allreduces ran as one fused round


def test_mismatched_shapes_raise_on_every_rank(cfg) -> None:
    def body(rank, engine):
        with pytest.raises(MismatchError) as info:
            allreduce(engine, np.zeros(17 + (rank == 2), dtype=np.float32))
        # the engine keeps working after a mismatch
        ok = allreduce(engine, np.ones(3, dtype=np.float32))
        return str(info.value), ok

    for msg, ok in run_job(cfg, 2, 2, body):
        assert msg.startswith("allreduce") and "shape differs: rank 2 sent [18], ranks 0, 1, 3 sent [17]" in msg, msg
        np.testing.assert_array_equal(ok, np.full(3, 4.0, dtype=np.float32))


@pytest.mark.parametrize("servers,local,odd", [(2, 2, {0}), (2, 2, {2, 3}), (4, 1, {3}), (1, 4, {1})])
def test_every_rank_of_every_server_names_field_values_and_ranks(cfg, servers, local, odd) -> None:
    def body(rank, engine):
        with pytest.raises(MismatchError) as info:
            allreduce(engine, np.zeros(8, dtype=np.float64 if rank in odd else np.float32))
        return str(info.value)

    rest = [r for r in range(4) if r not in odd]
    def fmt(rs):
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

    groups = sorted([(sorted(odd), "float64"), (rest, "float32")], key=lambda g: (len(g[0]), g[0][0]))
    expected = "dtype differs: " + ", ".join(f"{fmt(rs)} sent {v}" for rs, v in groups)
    msgs = run_job(cfg, servers, local, body)
    assert len(set(msgs)) == 1 and expected in msgs[0], msgs


def test_mismatch_is_also_horovods_error_class(cfg) -> None:
    hie = pytest.importorskip("horovod.common.exceptions").HorovodInternalError

    def body(rank, engine):
        with pytest.raises(hie):
            allreduce(engine, np.zeros(3, dtype=np.float32 if rank else np.float64))
        return True

    assert all(run_job(cfg, 1, 2, body))


def test_join_contributes_zeros_and_returns_last_rank(cfg) -> None:
    size = 4

    def body(rank, engine):
        if rank == 1:  # joins at once; the others run two allreduces first
            return "joined", join(engine)
        x = np.array([4, 8, -6], dtype=np.int32) * (rank + 1)
        allreduce(engine, x, "sum")
        y = np.array([4, 8, -6], dtype=np.int32)
        allreduce(engine, y, "average")
        return (x, y), join(engine)

    results = run_job(cfg, 2, 2, body)
    lasts = {last for _, last in results}
    assert len(lasts) == 1 and lasts.pop() in (0, 2, 3)
    for rank, (res, _) in enumerate(results):
        if rank == 1:
            continue
        x, y = res
        np.testing.assert_array_equal(x, np.array([4, 8, -6]) * (1 + 3 + 4))
        # Horovod: joined ranks count in the divisor: 3 contributions over size 4
        np.testing.assert_array_equal(y, np.trunc(np.array([4, 8, -6]) * 3 * (1.0 / size)).astype(np.int32))


def test_broadcast_while_a_rank_has_joined_fails_cleanly(cfg) -> None:
    def body(rank, engine):
        if rank == 0:
            return join(engine)
        with pytest.raises(BlinkInternalError, match="join"):
            broadcast(engine, np.zeros(4, dtype=np.float32), 1)
        return join(engine)

    assert len(set(run_job(cfg, 1, 3, body))) == 1


def test_duplicate_inflight_name_is_a_value_error(cfg) -> None:
    import time

    def body(rank, engine):
        if rank == 2:  # holds the collective back, so "dup" stays in flight on ranks 0 and 1
            time.sleep(0.5)
            return allreduce(engine, np.ones(8, dtype=np.float32), name="dup")
        h = allreduce(engine, np.ones(8, dtype=np.float32), name="dup", wait=False)
        with pytest.raises(ValueError, match="same name"):
            allreduce(engine, np.ones(8, dtype=np.float32), name="dup", wait=False)
        return h.wait()

    for out in run_job(cfg, 1, 3, body):
        np.testing.assert_array_equal(out, np.full(8, 3.0, dtype=np.float32))


def test_named_collectives_meet_whatever_the_submission_order(cfg) -> None:
    """As Horovod: ops are keyed by name, so ranks may submit them in different orders."""
    def body(rank, engine):
        names = ["a", "b", "c"] if rank % 2 == 0 else ["c", "a", "b"]
        arrays = {n: np.full(4, ord(n) + rank, dtype=np.int64) for n in names}
        handles = [allreduce(engine, arrays[n], name=n, wait=False) for n in names]
        for h in handles:
            h.wait()
        return arrays

    for arrays in run_job(cfg, 2, 2, body):
        for n, a in arrays.items():
            np.testing.assert_array_equal(a, np.full(4, 4 * ord(n) + 6))


def test_a_named_op_left_pending_across_a_barrier(cfg) -> None:
    """Horovod's test_horovod_allreduce_duplicate_name_error: rank 0 submits first, a barrier, then the others."""
    def body(rank, engine):
        h = None
        if rank == 0:
            h = allreduce(engine, np.ones(3, dtype=np.float32), name="late", wait=False)
        barrier(engine)
        if rank > 0:
            h = allreduce(engine, np.ones(3, dtype=np.float32), name="late", wait=False)
        barrier(engine)
        return h.wait()

    for out in run_job(cfg, 1, 3, body):
        np.testing.assert_array_equal(out, np.full(3, 3.0, dtype=np.float32))


@pytest.mark.parametrize("local", [1, 3, 4])
def test_small_allreduces_reduced_inside_the_agreement_round(cfg, local: int) -> None:
    """BLINK_EAGER_BYTES: the proposals carry small inputs; the same exact results as the data rounds give,
    the same bits on every rank, and the data round skipped only where every rank carried every input."""
    def body(rank, engine):
        out = {}
        for dt in ("int32", "float32", "int8", "uint8", "int16", "int64", "float64", "float16"):
            x = data(rank, 101, dt)
            allreduce(engine, x, "sum")
            out[dt] = x
        lo = allreduce(engine, data(rank, 10, "int64"), "min")
        hi = allreduce(engine, data(rank, 10, "int64"), "max")
        prod = allreduce(engine, np.array([1, 2, -1, 3], dtype=np.int32) + (rank % 2), "product")
        avg = allreduce(engine, np.array([-7, -3, 1, 5, 6], dtype=np.int32) + rank, "average")
        f = allreduce(engine, np.linspace(-2, 2, 9, dtype=np.float32) * (rank + 1), "sum", pre=0.3, post=1.7)
        eager = engine.eager_rounds
        big = allreduce(engine, data(rank, 4096, "float32"), "sum")  # 16 KB: past 4 KB, a data round
        # queued small ones, fused into few rounds, then one joined rank: data rounds again
        handles = [allreduce(engine, np.full(5 + i, i + rank, dtype=np.float32), "sum", wait=False) for i in range(12)]
        fused = [h.wait() for h in handles]
        return out, lo, hi, prod, avg, f, eager, engine.eager_rounds, big, fused

    rows = run_job(cfg, 1, local, body, eager_bytes=4096)
    for out, lo, hi, prod, avg, f, eager, eager_after, big, fused in rows:
        for dt, x in out.items():
            want = sum(data(r, 101, "int64") for r in range(local)).astype(dt)
            np.testing.assert_array_equal(x, want, err_msg=dt)
        np.testing.assert_array_equal(lo, data(0, 10, "int64"))
        np.testing.assert_array_equal(hi, data(local - 1, 10, "int64"))
        np.testing.assert_array_equal(prod, np.prod([np.array([1, 2, -1, 3]) + (r % 2) for r in range(local)], axis=0))
        s = sum(np.array([-7, -3, 1, 5, 6], dtype=np.int64) + r for r in range(local))
        np.testing.assert_array_equal(avg, np.trunc(s * (1.0 / local)).astype(np.int32))
        parts = [np.linspace(-2, 2, 9, dtype=np.float32) * (r + 1) * np.float32(0.3) for r in range(local)]
        np.testing.assert_allclose(f, np.sum(parts, axis=0, dtype=np.float64) * np.float32(1.7), rtol=1e-6, atol=1e-6)
        assert eager == 13  # every one of the 13 small allreduces above, none through a data round
        np.testing.assert_array_equal(big, sum(data(r, 4096, "float32") for r in range(local)))
        for i, o in enumerate(fused):
            np.testing.assert_array_equal(o, np.full(5 + i, local * i + local * (local - 1) // 2, dtype=np.float32))
        assert eager_after > eager  # the queued small ones too
    for got in rows[1:]:  # the same bits on every rank
        np.testing.assert_array_equal(got[5].view(np.uint32), rows[0][5].view(np.uint32))


def test_eager_rounds_leave_the_mismatch_and_join_paths_as_they_are(cfg) -> None:
    def body(rank, engine):
        with pytest.raises(MismatchError) as info:
            allreduce(engine, np.zeros(17 + (rank == 2), dtype=np.float32))
        if rank == 0:
            last = join(engine)
            return str(info.value), None, last, engine.eager_rounds
        x = allreduce(engine, np.ones(6, dtype=np.int32) * rank, "sum")  # rank 0 joined: a data round
        last = join(engine)
        return str(info.value), x, last, engine.eager_rounds

    for rank, (msg, x, last, eager) in enumerate(run_job(cfg, 1, 3, body, eager_bytes=4096)):
        assert "shape differs: rank 2 sent [18], ranks 0, 1 sent [17]" in msg
        if rank:
            np.testing.assert_array_equal(x, np.full(6, 3, dtype=np.int32))
        assert last in (1, 2)
        assert eager == 0
