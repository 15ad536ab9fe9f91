"""One rank of a GPU runtime test, started as a subprocess by tests/parallel/test_gpu_*.py (no tests here).

``python gpu_rank.py DIR RANK NRANKS SCENARIO [ARGS...]``: joins the server
through a :class:`FileRendezvous` in DIR, drives the real
:class:`~blink_horovod.runtime.gpu.executor.GpuExecutor` on CUDA device
``RANK % devices`` (all ranks share one GPU on a one-GPU machine), runs
SCENARIO and prints one JSON line; an error prints ``{"error": class,
"message": ...}`` and exits 3.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.dtypes import (
    OPS,
    bf16_to_f32,
    f32_to_bf16,
    numpy_dtype,
)
from blink_horovod.runtime.gpu.harness import GpuServer
from blink_horovod.runtime.rendezvous import FileRendezvous

GPU_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


def hand_plans(n: int):
    """Hand-made multi-tree plans (two trees per root: a chain and a star), no planner needed."""
    gpus = tuple(range(n))

    def chain(root: int) -> tuple[tuple[int, int], ...]:
        order = [root] + [g for g in range(n) if g != root]
        return tuple((order[i], order[i + 1]) for i in range(n - 1))

    def star(root: int) -> tuple[tuple[int, int], ...]:
        return tuple((root, g) for g in range(n) if g != root)

    def planner(collective: str, root: int | None) -> Plan:
        if collective == "allreduce":
            trees = []
            for r in range(n):
                trees += [Tree(r, 0.6 / n, chain(r)), Tree(r, 0.4 / n, star(r), "nvlink")]
            return Plan("allreduce", "custom", gpus, None, tuple(trees), 1.0, 1.0)
        return Plan("broadcast", "custom", gpus, root, (Tree(root, 0.5, chain(root)), Tree(root, 0.5, star(root))),
                    1.0, 1.0)

    return planner


def host_values(rank: int, count: int, dtype: str, op: str, seed: int = 0) -> np.ndarray:
    """Integer-valued data, different per rank, exact in every dtype (nccl-tests' idea)."""
    rng = np.random.default_rng(seed * 1009 + rank)
    if op == "product":
        v = rng.choice([1, 1, 2, -1], count)
    elif op == "average":
        v = 8 * rng.integers(-3, 4, count)
    else:
        v = rng.integers(-8, 9, count)
    if dtype == "bfloat16":
        return f32_to_bf16(v.astype(np.float32))
    return v.astype(numpy_dtype(dtype) if dtype != "bfloat16" else np.uint16)


def as_f64(x: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(x).astype(np.float64) if dtype == "bfloat16" else x.astype(np.float64)


def expected(n: int, count: int, dtype: str, op: str, seed: int = 0) -> np.ndarray:
    xs = [as_f64(host_values(r, count, dtype, op, seed), dtype) for r in range(n)]
    if op in ("sum", "average"):
        s = np.sum(xs, axis=0)
        if op == "average":
            return np.trunc(s * (1.0 / n)) if numpy_dtype(dtype).kind in "iu" else s / n
        return s
    return {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op].reduce(xs)


def device(x: np.ndarray):
    import cupy

    return cupy.asarray(x)


def wrong(d, want: np.ndarray, dtype: str) -> int:
    import cupy

    return int(np.count_nonzero(as_f64(cupy.asnumpy(d), dtype) != want))


def scenario(name: str, rank: int, n: int, srv: GpuServer, args: list[str]) -> dict:
    import cupy

    out: dict = {"rank": rank}
    if name == "dtypes":
        counts = [int(a) for a in args[0].split(",")]
        bad = {}
        for dt in GPU_DTYPES:
            for op in OPS:
                for count in counts:
                    x = device(host_values(rank, count, dt, op))
                    srv.allreduce(x, count, dt, op, name=f"{dt}.{op}.{count}")
                    srv.synchronize()
                    w = wrong(x, expected(n, count, dt, op), dt)
                    if w:
                        bad[f"allreduce {dt} {op} {count}"] = w
            for count in counts:
                for root in range(n):
                    x = device(host_values(rank, count, dt, "sum", seed=5))
                    srv.broadcast(x, count, dt, root, name=f"b{root}")
                    srv.synchronize()
                    w = wrong(x, as_f64(host_values(root, count, dt, "sum", seed=5), dt), dt)
                    if w:
                        bad[f"broadcast {dt} root {root} {count}"] = w
                x = device(host_values(rank, count, dt, "sum", seed=6))
                lo, hi = srv.reduce_to_roots(x, count, dt, "sum", name="r1")
                srv.synchronize()
                got = as_f64(cupy.asnumpy(x), dt)
                want = as_f64(host_values(rank, count, dt, "sum", seed=6), dt)
                want[lo:hi] = expected(n, count, dt, "sum", seed=6)[lo:hi]
                if np.count_nonzero(got != want):
                    bad[f"reduce_to_roots {dt} {count}"] = int(np.count_nonzero(got != want))
                # stage 3 on the stage-1 result: everyone ends with the full reduction
                srv.broadcast_from_roots(x, count, dt, name="r3")
                srv.synchronize()
                w = wrong(x, expected(n, count, dt, "sum", seed=6), dt)
                if w:
                    bad[f"broadcast_from_roots {dt} {count}"] = w
        out["wrong"] = bad
        out["captures"] = srv.ex.captures
        return out
    if name == "loop":
        # Back-to-back collectives of mixed sizes and dtypes, no host sync in between.
        iters = int(args[0])
        rng = np.random.default_rng(7)
        keep = []
        for i in range(iters):
            count = int(rng.integers(1, 300_000))
            dt = GPU_DTYPES[int(rng.integers(0, len(GPU_DTYPES)))]
            op = OPS[int(rng.integers(0, len(OPS)))]
            x = device(host_values(rank, count, dt, op, seed=i))
            stream = None
            if i % 3 == 0:  # another stream: it must first see the upload made on CuPy's current stream
                stream = cupy.cuda.Stream(non_blocking=True)
                stream.wait_event(cupy.cuda.get_current_stream().record())
            srv.allreduce(x, count, dt, op, stream=stream, name=f"loop{i}")
            keep.append((x, count, dt, op, i))
        srv.synchronize()
        bad = 0
        for x, count, dt, op, i in keep:
            bad += wrong(x, expected(n, count, dt, op, seed=i), dt)
        out["wrong"] = bad
        return out
    if name == "hosttime":
        # Host time of a collective vs the number of chunks per tree (acceptance: <= 20 us, 1..256).
        # Optional: CHUNKS ("1,4,16") and MODE: "back" (back to back, the acceptance) or "idle" (the
        # device drained before each timed call: host time on an idle GPU, for diagnosis);
        # BLINK_TEST_SPIN_S overrides how long the executor's waits spin.
        reps = int(args[0]) if args else 200
        counts = tuple(int(c) for c in args[1].split(",")) if len(args) > 1 else (1, 4, 16, 64, 256)
        mode = args[2] if len(args) > 2 else "back"
        idle = mode == "idle" or mode.startswith("spin")
        # "spinMS": the device drained, then the host spins MS milliseconds (as the executor's waits do)
        # before each timed call: host time after a long host wait, with no device work pending.
        spin_s = float(mode[4:]) * 1e-3 if mode.startswith("spin") else 0.0
        if os.environ.get("BLINK_TEST_BIND") == "1":
            # Diagnosis: each rank on its own physical core (first hardware thread of the rank-th core).
            from pathlib import Path

            cores = sorted({Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
                            for c in os.sched_getaffinity(0)}, key=lambda x: int(x.replace("-", ",").split(",")[0]))
            first = int(cores[srv.rank % len(cores)].replace("-", ",").split(",")[0])
            os.sched_setaffinity(0, {first})
        if os.environ.get("BLINK_TEST_SPIN_S"):
            srv.ex._spin_s = float(os.environ["BLINK_TEST_SPIN_S"])
        res = []
        for chunks in counts:
            count = 64 * 1024 * n  # 256 KiB float32 per rank
            ntrees = 2 * n
            srv.chunk_bytes = max(4, (count // ntrees // chunks) * 4)
            x = cupy.zeros(count, cupy.float32)
            for _ in range(5):
                srv.allreduce(x, count, "float32", "sum", name=f"h{chunks}")
            srv.synchronize()
            row: dict = {"chunks_per_tree": chunks}
            for gc_on in (True, False):
                # Host time: wall time of the call less the time it sat blocked on the device (argument
                # slot of three collectives ago), and the calling thread's CPU time.
                meta, launch, total, cpu, api, waited = [], [], [], [], [], []
                if not gc_on:
                    gc.disable()
                for _ in range(reps):
                    if idle:
                        srv.synchronize()
                        end = time.monotonic() + spin_s
                        while time.monotonic() < end:
                            pass
                    c0 = time.thread_time()  # a system call: outside the wall-time window
                    t0 = time.perf_counter()
                    srv.allreduce(x, count, "float32", "sum", name=f"h{chunks}")
                    t1 = time.perf_counter()
                    total.append(t1 - t0 - srv.ex.last_wait_seconds)
                    cpu.append(time.thread_time() - c0)
                    meta.append(srv.ex.last_meta_seconds)
                    launch.append(srv.ex.last_launch_seconds)
                    api.append(srv.ex.last_api_seconds)
                    waited.append(srv.ex.last_wait_seconds)
                gc.enable()
                srv.synchronize()
                sfx = "" if gc_on else "_nogc"
                row |= {f"launch_us{sfx}": 1e6 * float(np.median(launch)), f"meta_us{sfx}": 1e6 * float(np.median(meta)),
                        f"total_us{sfx}": 1e6 * float(np.median(total)), f"cpu_us{sfx}": 1e6 * float(np.median(cpu)),
                        f"api_us{sfx}": 1e6 * float(np.median(api)), f"waited_us{sfx}": 1e6 * float(np.median(waited))}
            prog = next(iter(p for k, p in srv.programs.items() if k[1] == count and k[2] == srv.chunk_bytes // 4))
            row["ops"] = prog.num_ops()
            res.append(row)
        out["hosttime"] = res
        return out
    if name == "mismatch":
        # Rank 1 names its third collective differently; both names were seen before, so no host
        # exchange runs: a fused program must find it on the device and every rank raise MismatchError.
        count = 4096
        x = device(host_values(rank, count, "float32", "sum"))

        def body() -> None:
            srv.allreduce(x, count, "float32", "sum", name="a")
            srv.allreduce(x, count, "float32", "sum", name="b")
            srv.allreduce(x, count, "float32", "sum", name="b" if rank == 1 else "a")
            srv.synchronize()
            srv.allreduce(x, count, "float32", "sum", name="a")
            srv.synchronize()

        return out | expect_failure(body)
    if name == "kill":
        # Rank 1 dies in the middle; the others must fail fast, not hang.
        victim = 1
        count = 1 << 20
        x = device(host_values(rank, count, "float32", "sum"))

        def body() -> None:
            for i in range(50):
                if rank == victim and i == 10:
                    os._exit(9)
                srv.allreduce(x, count, "float32", "sum", name="k")
            srv.synchronize()

        return out | expect_failure(body)
    raise SystemExit(f"unknown scenario {name}")


def expect_failure(body) -> dict:
    """Run ``body``; what it raised (class name and message, or None) and how long it took."""
    t0 = time.monotonic()
    out: dict = {"raised": None}
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - reported
        out = {"raised": type(exc).__name__, "message": str(exc)[:300]}
    out["seconds"] = time.monotonic() - t0
    return out


def main() -> None:
    directory, rank, n, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = float(os.environ.get("BLINK_TIMEOUT_SECONDS", "60"))
    rdv = FileRendezvous(directory, rank, n, timeout=timeout)
    srv = None
    try:
        pids = rdv.allgather(os.getpid())
        srv = GpuServer(rank, n, rdv.job_id, pids, timeout=timeout, planner=hand_plans(n),
                        chunk_bytes=int(os.environ.get("BLINK_CHUNK_BYTES", str(64 << 10))))
        out = scenario(name, rank, n, srv, sys.argv[5:])
        srv.close()
        srv = None
        print(json.dumps(out), flush=True)
    except BaseException as exc:  # noqa: BLE001
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc),
                          "trace": traceback.format_exc()[-2000:]}), flush=True)
        if srv is not None:
            try:
                srv.close()
            except BaseException:  # noqa: BLE001, S110 - the first error is reported
                pass
        sys.exit(3)
    finally:
        rdv.close()


if __name__ == "__main__":
    main()
