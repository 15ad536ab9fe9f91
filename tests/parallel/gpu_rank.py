"""One rank of a GPU runtime test, started as a subprocess by tests/parallel/test_gpu_collectives.py.

``python gpu_rank.py DIR RANK NRANKS SCENARIO [ARGS...]``: joins the server
through a :class:`FileRendezvous` in DIR, drives a real
``Communicator(device="cuda")`` on torch CUDA tensors of device
``RANK % devices`` (all ranks share one GPU on a one-GPU machine), runs
SCENARIO and prints one JSON line; an error prints ``{"error": class,
"message": ...}`` and exits 3.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.dtypes import (
    OPS,
    bf16_to_f32,
    f32_to_bf16,
    numpy_dtype,
)
from blink_horovod.runtime.rendezvous import FileRendezvous
from blink_horovod.topology import machines

GPU_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "int8", "uint8", "int16")


def hand_plans(n: int):
    """Hand-made multi-tree plans (two trees per root: a chain and a star), no planner needed."""
    gpus = tuple(range(n))

    def chain(root: int) -> tuple[tuple[int, int], ...]:
        order = [root] + [g for g in range(n) if g != root]
        return tuple((order[i], order[i + 1]) for i in range(n - 1))

    def star(root: int) -> tuple[tuple[int, int], ...]:
        return tuple((root, g) for g in range(n) if g != root)

    def planner(topology, collective: str, root: int | None) -> Plan:
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
    low = 0 if dtype == "uint8" else -1  # unsigned: no negative values (the reference does not wrap)
    if op == "product":
        v = rng.choice([1, 1, 2, -1 if low else 1], count)
    elif op == "average":
        v = 8 * rng.integers(3 * low, 4, count)
    else:
        v = rng.integers(8 * low, 9, count)
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


def device(x: np.ndarray, dtype: str):
    import torch

    if dtype == "bfloat16":
        t = torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    else:
        t = torch.from_numpy(x).cuda()
    torch.cuda.synchronize()
    return t


def host(t, dtype: str) -> np.ndarray:
    import torch

    if dtype == "bfloat16":
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def wrong(d, want: np.ndarray, dtype: str) -> int:
    return int(np.count_nonzero(as_f64(host(d, dtype), dtype) != want))


def scenario(name: str, rank: int, n: int, comm: Communicator, args: list[str]) -> dict:
    import torch

    out: dict = {"rank": rank}
    if name == "dtypes":
        counts = [int(a) for a in args[0].split(",")]
        bad = {}
        for dt in GPU_DTYPES:
            for op in OPS:
                for count in counts:
                    x = device(host_values(rank, count, dt, op), dt)
                    comm.allreduce(x, op, name=f"{dt}.{op}.{count}")
                    comm.synchronize()
                    w = wrong(x, expected(n, count, dt, op), dt)
                    if w:
                        bad[f"allreduce {dt} {op} {count}"] = w
            for count in counts:
                for root in range(n):
                    x = device(host_values(rank, count, dt, "sum", seed=5), dt)
                    comm.broadcast(x, root, name=f"b{root}")
                    comm.synchronize()
                    w = wrong(x, as_f64(host_values(root, count, dt, "sum", seed=5), dt), dt)
                    if w:
                        bad[f"broadcast {dt} root {root} {count}"] = w
        out["wrong"] = bad
        return out
    if name == "stages":
        # The hierarchical stages on CUDA: the kernel's reduce phase (each rank's segment reduced), then
        # its broadcast phase (every segment everywhere): with no cross-server stage between, an allreduce.
        counts = [int(a) for a in args[0].split(",")]
        bad = {}
        for dt in GPU_DTYPES:
            for op in OPS:
                for count in counts:
                    want = expected(n, count, dt, op)
                    x = device(host_values(rank, count, dt, op), dt)
                    start, end = comm.reduce_to_roots(x, op, name=f"r.{dt}.{op}.{count}")
                    comm.synchronize()
                    got = as_f64(host(x, dt), dt)
                    w = int(np.count_nonzero(got[start:end] != want[start:end]))
                    if w:
                        bad[f"reduce_to_roots {dt} {op} {count}"] = w
                    comm.broadcast_from_roots(x, name=f"b.{dt}.{op}.{count}")
                    comm.synchronize()
                    w = wrong(x, want, dt)
                    if w:
                        bad[f"broadcast_from_roots {dt} {op} {count}"] = w
        out["wrong"] = bad
        return out
    if name == "loop":
        # Back-to-back collectives of mixed sizes, dtypes and streams, no host sync in between.
        iters = int(args[0])
        rng = np.random.default_rng(7)
        keep = []
        for i in range(iters):
            count = int(rng.integers(1, 300_000))
            dt = GPU_DTYPES[int(rng.integers(0, len(GPU_DTYPES)))]
            op = OPS[int(rng.integers(0, len(OPS)))]
            x = device(host_values(rank, count, dt, op, seed=i), dt)
            if i % 3 == 0:  # another stream: it must first see the upload made on the current one
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    comm.allreduce(x, op, name=f"loop{i}")
                torch.cuda.current_stream().wait_stream(stream)
            else:
                comm.allreduce(x, op, name=f"loop{i}")
            keep.append((x, count, dt, op, i))
        comm.synchronize()
        torch.cuda.synchronize()
        out["wrong"] = sum(wrong(x, expected(n, count, dt, op, seed=i), dt) for x, count, dt, op, i in keep)
        return out
    if name == "hosttime":
        # Host time of a repeated collective at sizes of 1 to 256 items per tree (acceptance: <= 20 us).
        reps = int(args[0]) if args else 200
        ex = comm._executor
        res = []
        for elems in (64, 16 << 10, 256 << 10, 4 << 20, 64 << 20):
            x = torch.zeros(elems * n, dtype=torch.float32, device="cuda")
            for _ in range(5):
                comm.allreduce(x, name=f"h{elems}")
            comm.synchronize()
            total, meta, launch, phases = [], [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                comm.allreduce(x, name=f"h{elems}")
                total.append(time.perf_counter() - t0)
                meta.append(ex.last_meta_seconds)
                launch.append(ex.last_launch_seconds)
                c = ex.last_native  # the native call's phases (ns): allocation check, post, wait, launch
                if c is not None:
                    phases.append(c.phases_ns())
            comm.synchronize()
            items = max((int(r.nitems) for r in [w for w, _, _ in ex._tables.values()]), default=0)
            res.append({"elements": elems * n, "items": items, "total_us": 1e6 * float(np.median(total)),
                        "meta_us": 1e6 * float(np.median(meta)), "launch_us": 1e6 * float(np.median(launch)),
                        "native_us": [float(np.median([p[i] for p in phases])) / 1e3 for i in range(4)] if phases
                        else None})
        out["hosttime"] = res
        return out
    if name == "mismatch":
        # Rank 1 names its third collective differently: every rank must raise MismatchError naming it.
        count = 4096
        x = device(host_values(rank, count, "float32", "sum"), "float32")

        def body() -> None:
            comm.allreduce(x, name="a")
            comm.allreduce(x, name="b")
            comm.allreduce(x, name="b" if rank == 1 else "a")
            comm.synchronize()
            comm.allreduce(x, name="a")
            comm.synchronize()

        return out | expect_failure(body)
    if name == "kill":
        # Rank 1 dies in the middle; the others must fail fast, not hang.
        victim = 1
        x = device(host_values(rank, 1 << 20, "float32", "sum"), "float32")

        def body() -> None:
            for i in range(50):
                if rank == victim and i == 10:
                    os._exit(9)
                comm.allreduce(x, name="k")
            comm.synchronize()

        return out | expect_failure(body)
    if name == "behind":
        # Rank 0's stream is behind earlier work when rank 1 launches: a one-block kernel (200 ms), then a
        # kernel with a block on every SM that needs a whole SM's shared memory.  Launched at once, rank 1's
        # tree blocks (one to an SM) could leave that kernel no SM, and rank 0's tree kernel queued behind it
        # would not start until rank 1's waits time out.  With BLINK_GPU_SM_SHARE=0.5 the ranks' tree kernels
        # leave half the block slots free.  (On an H100 under MPS the whole grid did not stall either.)
        import cupy

        hog, smem, sms = _hog()
        xs = [device(host_values(rank, 1 << 18, "float32", "sum", seed=i), "float32") for i in range(3)]

        def body() -> None:
            for i, x in enumerate(xs):
                if rank == 0:
                    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                        hog((1,), (32,), (np.uint64(200_000_000),))
                        hog((sms,), (128,), (np.uint64(50_000_000),), shared_mem=smem)
                comm.allreduce(x, name=f"behind{i}")
            comm.synchronize()

        out |= expect_failure(body)
        if out["raised"] is None:
            out["wrong"] = sum(wrong(x, expected(n, 1 << 18, "float32", "sum", seed=i), "float32")
                               for i, x in enumerate(xs))
        return out
    raise SystemExit(f"unknown scenario {name}")


_HOG = r"""
extern "C" __global__ void hog(unsigned long long ns) {
    extern __shared__ unsigned char smem[];
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    if (t == 0) smem[threadIdx.x] = 1;
}
"""


def _hog():
    """A kernel that spins for ``ns`` nanoseconds, the most shared memory a block may take, and the SMs."""
    import cupy

    rt = cupy.cuda.runtime
    dev = rt.getDevice()
    smem = rt.deviceGetAttribute(getattr(rt, "cudaDevAttrMaxSharedMemoryPerBlockOptin", 97), dev)
    k = cupy.RawKernel(_HOG, "hog")
    k.max_dynamic_shared_size_bytes = smem
    return k, smem, rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev)


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
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
        srv = Communicator(rank, n, machines.cpu(n), rdv, device="cuda", planner=hand_plans(n))
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
