"""The GPU executor's host code (executor, graph builder, harness) run on an emulated device.

tests/unit/gpu_emulator.py emulates the CUDA calls (one in-order hardware
queue per rank, shared address space, IPC handles = addresses).  This checks
the Python that had never run: metadata exchange, IPC handle exchange and
buffer growth by generations, argument slots, the graph cache (captures per
program/dtype/op/residue, none on repeats), launch order, ``average`` fused
into staging, the hierarchical stages and close.  It says nothing about real
CUDA behaviour (benchmarks/gpu_probe_run.sh on the GPU machine does).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_emulator import EmuCuda, Heap
from gpu_rank import as_f64, expected, hand_plans, host_values
from rank_threads import run_rank_threads

from blink_horovod.runtime.dtypes import numpy_dtype
from blink_horovod.runtime.gpu.harness import GpuServer
from blink_horovod.runtime.loopback import LoopbackWorld

pytestmark = pytest.mark.timeout(180)


def run_emulated(n: int, body, chunk_bytes: int = 256):
    heap = Heap(96 << 20)
    world = LoopbackWorld(n, data_bytes=4096, nflags=8)
    results: list = [None] * n
    errors: list = []

    def rank_main(r: int) -> None:
        cuda = EmuCuda(heap)
        srv = None
        try:
            srv = GpuServer(r, n, "emu", [os.getpid()] * n, timeout=30.0, planner=hand_plans(n),
                            chunk_bytes=chunk_bytes, transport=world.transport(r), cuda=cuda)
            results[r] = body(r, srv, cuda, heap)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append((r, exc))
            if srv is not None:
                srv.ex.fail(exc)
        finally:
            if srv is not None:
                srv.close()
            cuda.shutdown()

    run_rank_threads(rank_main, n, 150)
    assert not errors, errors
    return results


def put(cuda: EmuCuda, heap: Heap, x: np.ndarray) -> int:
    ptr = cuda.malloc(max(x.nbytes, 8))
    cuda.copy_to_device(ptr, x)
    return ptr


def get(cuda: EmuCuda, heap: Heap, ptr: int, like: np.ndarray) -> np.ndarray:
    cuda.synchronize()
    return heap.mem[ptr : ptr + like.nbytes].view(like.dtype).copy()


@pytest.mark.parametrize("n", [2, 4])  # average data (multiples of 8) is exact for powers of two
def test_all_collectives_every_op_through_the_real_executor(n: int) -> None:
    def body(r, srv, cuda, heap):
        bad = {}
        for dt in ("float32", "bfloat16", "int64", "float16"):
            for op in ("sum", "average", "min", "max", "product"):
                for count in (1, 37, 1500):
                    x = host_values(r, count, dt, op)
                    p = put(cuda, heap, x)
                    srv.allreduce(p, count, dt, op)
                    got = as_f64(get(cuda, heap, p, x), dt)
                    if not np.array_equal(got, expected(n, count, dt, op)):
                        bad[("allreduce", dt, op, count)] = got[:5]
            for root in range(n):
                x = host_values(r, 999, dt, "sum", seed=3)
                p = put(cuda, heap, x)
                srv.broadcast(p, 999, dt, root)
                if not np.array_equal(as_f64(get(cuda, heap, p, x), dt), as_f64(host_values(root, 999, dt, "sum", 3), dt)):
                    bad[("broadcast", dt, root)] = 1
            x = host_values(r, 1001, dt, "sum", seed=4)
            p = put(cuda, heap, x)
            lo, hi = srv.reduce_to_roots(p, 1001, dt, "sum")
            got = as_f64(get(cuda, heap, p, x), dt)
            want = as_f64(x, dt)
            want[lo:hi] = expected(n, 1001, dt, "sum", seed=4)[lo:hi]
            if not np.array_equal(got, want):
                bad[("reduce_to_roots", dt)] = 1
            srv.broadcast_from_roots(p, 1001, dt)
            if not np.array_equal(as_f64(get(cuda, heap, p, x), dt), expected(n, 1001, dt, "sum", seed=4)):
                bad[("broadcast_from_roots", dt)] = 1
        return bad, srv.ex.captures, cuda.launches

    for bad, captures, launches in run_emulated(n, body):
        assert bad == {}
        assert captures <= launches


def test_repeats_reuse_graphs_and_growth_remaps_buffers() -> None:
    n = 3

    def body(r, srv, cuda, heap):
        out = []
        for count in (10, 10, 10, 10, 400_000, 400_000, 400_000, 400_000, 10):
            x = host_values(r, count, "float32", "sum", seed=count)
            p = put(cuda, heap, x)
            before = srv.ex.captures
            srv.allreduce(p, count, "float32", "sum")
            out.append((count, srv.ex.captures - before, srv.ex._gen,
                        np.array_equal(as_f64(get(cuda, heap, p, x), "float32"), expected(n, count, "float32", "sum", seed=count))))
        return out

    for rows in run_emulated(n, body, chunk_bytes=4096):
        assert all(ok for *_, ok in rows), rows
        # Three residues -> three captures for the first three calls of a program, none after;
        # growing the buffer (400 000 floats > 1 MiB) drops the graphs and maps the new generation.
        assert [c for _, c, _, _ in rows[:4]] == [1, 1, 1, 0]
        assert rows[4][2] > rows[3][2]
        assert [c for _, c, _, _ in rows[4:8]] == [1, 1, 1, 0]
        assert rows[8][1] == 1  # back to the small size: its graphs were dropped at growth


def test_repeats_take_the_replay_path_and_stay_exact() -> None:
    """A repeated collective (same key) goes through GpuExecutor.replay once every epoch residue's graph
    exists: no pieces built, one exchange; results exact, also when two keys alternate on new data."""
    n = 3

    def body(r, srv, cuda, heap):
        out = []
        for i in range(10):
            for name, count in (("a", 1000), ("b", 5000)):
                x = host_values(r, count, "float32", "sum", seed=i)
                p = put(cuda, heap, x)
                before = srv.ex.replays
                srv.allreduce(p, count, "float32", "sum", name=name)
                ok = np.array_equal(as_f64(get(cuda, heap, p, x), "float32"), expected(n, count, "float32", "sum", seed=i))
                out.append((srv.ex.replays - before, ok))
        return out

    for rows in run_emulated(n, body, chunk_bytes=1024):
        assert all(ok for _, ok in rows), rows
        # calls 1-3 of each key capture the three residues' graphs; every later one replays
        assert [rep for rep, _ in rows] == [0] * 6 + [1] * 14, rows


def test_many_launches_without_sync_respect_the_argument_slots() -> None:
    n = 2

    def body(r, srv, cuda, heap):
        ptrs = []
        for i in range(12):
            x = host_values(r, 300 + i, "int32", "sum", seed=i)
            p = put(cuda, heap, x)
            srv.allreduce(p, 300 + i, "int32", "sum")  # no synchronize in between
            ptrs.append((p, x, i))
        cuda.synchronize()
        return [np.array_equal(as_f64(get(cuda, heap, p, x), "int32"), expected(n, 300 + i, "int32", "sum", seed=i))
                for p, x, i in ptrs]

    for oks in run_emulated(n, body):
        assert all(oks)


def test_itemsize_of_every_gpu_dtype() -> None:
    for dt, size in {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}.items():
        assert numpy_dtype(dt).itemsize == size


def test_host_work_of_a_collective_does_not_grow_with_chunks() -> None:
    """The host path of a collective makes the same number of Python calls at 1 and at 256 chunks per
    tree (graphs are looked up, never rebuilt, and nothing walks the program): counted with cProfile,
    which is deterministic where timings on a shared 2-core machine are not.  Times are printed."""
    import cProfile
    import pstats

    n = 2
    count = 2 * n * 256 * 16  # 16 elements per chunk at 256 chunks per tree

    def body(r, srv, cuda, heap):
        x = np.zeros(count, np.float32)
        p = put(cuda, heap, x)
        rows = {}
        # Time blocked on the peer is not host work, and how often a wait loop spins depends on the
        # peer thread's timing on a loaded machine: the profiler is off inside the transport's waits.
        live: list = []
        waits = srv.ex.t.wait_words

        def unprofiled_wait(*args, **kwargs):
            if live:
                live[0].disable()
            try:
                return waits(*args, **kwargs)
            finally:
                if live:
                    live[0].enable()

        srv.ex.t.wait_words = unprofiled_wait
        for chunks in (1, 16, 256):
            srv.chunk_bytes = 4 * count // (2 * n) // chunks
            for _ in range(4):  # three residues captured, then steady state
                srv.allreduce(p, count, "float32", "sum")
            cuda.synchronize()
            prof = cProfile.Profile()
            wall = []
            for _ in range(20):
                cuda.synchronize()  # an idle device: no wait for a free argument slot inside the call
                t0 = time.perf_counter()
                live[:] = [prof]
                prof.enable()
                srv.allreduce(p, count, "float32", "sum")
                prof.disable()
                live.clear()
                wall.append(time.perf_counter() - t0)
            cuda.synchronize()
            calls = sum(v[1] for v in pstats.Stats(prof).stats.values())  # primitive calls, all functions
            ops = max(len(o) for k, prog in srv.programs.items() if k[1] == count and k[2] == srv.chunk_bytes // 4
                      for o in prog.ranks)
            rows[chunks] = (calls / 20, ops, 1e6 * float(np.median(wall)))
        return rows

    for rows in run_emulated(n, body):
        print({c: f"{calls:.0f} calls, {ops} ops, {us:.0f} us (profiled, emulated)" for c, (calls, ops, us) in rows.items()})
        assert rows[256][1] > 100 * rows[1][1]  # the program really is > 100x longer
        # Nothing proportional to the program (waits on the peer are not profiled, see above).
        assert rows[256][0] <= rows[1][0] + 10, rows


def test_mismatched_collectives_raise_on_every_rank_also_after_repeats() -> None:
    """The reused encoding of repeated collectives must not hide a rank that suddenly differs."""
    from blink_horovod.errors import MismatchError

    n = 3

    def body(r, srv, cuda, heap):
        x = host_values(r, 64, "float32", "sum")
        p = put(cuda, heap, x)
        for _ in range(4):
            srv.allreduce(p, 64, "float32", "sum", name="g")
        try:
            srv.allreduce(p, 64 if r != 2 else 63, "float32", "sum", name="g")
        except MismatchError as exc:
            return str(exc)
        return None

    msgs = run_emulated(n, body)
    assert all(m and "mismatched shape" in m and "rank 2" in m for m in msgs), msgs


def test_graph_cache_eviction_keeps_results_right() -> None:
    n = 2

    def body(r, srv, cuda, heap):
        srv.ex.max_graphs = 6
        ok = []
        for i in range(14):
            count = 50 + (i % 5) * 7
            x = host_values(r, count, "int32", "sum", seed=i)
            p = put(cuda, heap, x)
            srv.allreduce(p, count, "int32", "sum")
            ok.append(np.array_equal(as_f64(get(cuda, heap, p, x), "int32"), expected(n, count, "int32", "sum", seed=i)))
        return ok, len(srv.ex._graphs)

    for ok, kept in run_emulated(n, body):
        assert all(ok) and kept <= 6


def test_flag_mode_follows_sharing_and_mps(tmp_path) -> None:
    """BLINK_GPU_FLAGS=auto: stream memory operations only where processes are time-sliced on a GPU."""
    from blink_horovod.errors import ConfigError
    from blink_horovod.runtime.gpu.executor import flag_mode, mps_active

    assert flag_mode("auto", 4, 4) == "fused"
    assert flag_mode("kernel", 4, 1) == "kernel" and flag_mode("memop", 2, 2) == "memop"
    assert flag_mode("fused", 4, 1) == "fused"
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").write_text("")
    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    with pytest.raises(ConfigError, match="BLINK_GPU_FLAGS"):
        flag_mode("spin", 2, 1)
