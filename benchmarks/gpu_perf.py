"""nccl-tests-style benchmark of the GPU executor: ranks are processes (mpirun + mpi4py), possibly on one GPU.

``mpirun -np N python benchmarks/gpu_perf.py -b 4 -e 1G -f 4 -c 1 --dtype all
--collective allreduce --plan-dir benchmarks/gpu_plans --topology dgx1v
--json out.json`` prints nccl-tests' columns (``size count type redop root
time algbw busbw #wrong``, busbw factors 2(n-1)/n for allreduce and 1 for
broadcast) plus ``host_us`` (wall time of the call: the metadata check, which
waits for the other ranks' hosts, + the graph launch + any wait for a free
argument slot when the device is the bottleneck), ``cpu_us`` (CPU time of the
calling thread during the call: host *work*, blocked time excluded), ``launch_us`` (host work of
the launch part, slot waits excluded) and ``copy_GBps`` (the device's own
device-to-device copy rate at that size, measured in the same run by rank 0,
read + write counted as nccl-tests' bandwidths are not: algbw counts bytes
once).  ``--json`` follows docs/formats.md's ``blink perf`` rows
with extra fields.  Exit status 1 if any ``#wrong`` > 0.

Until ``blink perf --device cuda`` is wired to the GPU executor this script is
the GPU benchmark; plans come from ``--plan-dir`` (computed on a machine with
the planner, since the GPU machine has no cvxpy), chosen by topology name and
rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np

from blink_horovod.planner.plan import Plan
from blink_horovod.units import format_size, parse_size

GPU_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
NCCL = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16", "int32": "int32",
        "int64": "int64"}


def load_plans(plan_dir: str, topology: str, n: int) -> dict[tuple[str, int | None], Plan]:
    plans = {}
    for collective, root in [("allreduce", None)] + [("broadcast", r) for r in range(n)]:
        name = f"{topology}-n{n}-{collective}" + ("" if root is None else f"-r{root}") + ".json"
        path = os.path.join(plan_dir, name)
        if os.path.exists(path):
            with open(path) as fh:
                plans[(collective, root)] = Plan.from_json(fh.read())
    return plans


def fill(x, rank: int, dtype: str, seed: int, block: int = 1 << 24) -> None:
    """Integer-valued data that differs per rank and element, exact in every dtype: ((i*7 + r*13 + s) % 17) - 8
    (in blocks: 8 ranks of 1 GB share one GPU)."""
    import cupy

    for lo in range(0, x.size, block):
        i = cupy.arange(lo, min(x.size, lo + block), dtype=cupy.int64)
        v = ((i * 7 + rank * 13 + seed) % 17 - 8).astype(cupy.float32)
        if dtype == "bfloat16":
            x[lo : lo + block] = (v.view(cupy.uint32) >> 16).astype(cupy.uint16)
        else:
            x[lo : lo + block] = v.astype(x.dtype)


def count_wrong(x, dtype: str, ranks: list[int], seed: int = 0, block: int = 1 << 24) -> int:
    """Elements of ``x`` that differ from the sum over ``ranks`` of :func:`fill`'s data (in blocks: 8 ranks
    of 1 GB share one GPU)."""
    import cupy

    bad = 0
    for lo in range(0, x.size, block):
        i = cupy.arange(lo, min(x.size, lo + block), dtype=cupy.int64)
        want = sum(((i * 7 + r * 13 + seed) % 17 - 8) for r in ranks).astype(cupy.float64)
        bad += int(cupy.count_nonzero(values_f64(x[lo : lo + block], dtype) != want))
    return bad


def values_f64(x, dtype: str):
    import cupy

    if dtype == "bfloat16":
        return (x.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def storage(dtype: str):
    import cupy

    return cupy.uint16 if dtype == "bfloat16" else cupy.dtype(dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--minbytes", default="4")
    ap.add_argument("-e", "--maxbytes", default="64M")
    ap.add_argument("-f", "--stepfactor", type=int, default=2)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup_iters", type=int, default=5)
    ap.add_argument("-c", "--check", type=int, default=1)
    ap.add_argument("--collective", default="allreduce", choices=["allreduce", "broadcast"])
    ap.add_argument("--dtype", default="float32", help="a dtype, a comma list, or all")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--topology", default="dgx1v", help="plan family in --plan-dir")
    ap.add_argument("--plan-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_plans"))
    ap.add_argument("--chunk-bytes", default=None, help="fixed chunk size; default: size/(trees*8) in [64K, 4M]")
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-limit", type=float, default=0, help="stop starting new sizes after this many seconds")
    ap.add_argument("--threads", type=int, default=0,
                    help="run N virtual ranks as threads of this one process (no mpirun): one CUDA context, so "
                         "ranks sharing a GPU are not time-sliced against each other as processes are")
    ap.add_argument("--flag-ops", default=None, choices=["auto", "kernel", "memop", "fused"],
                    help="how ranks signal on the device (BLINK_GPU_FLAGS; default auto: memop for processes "
                         "sharing a GPU without MPS, fused otherwise)")
    ap.add_argument("--fused-launch", default=None, choices=["graph", "kernel", "persistent"],
                    help="fused programs: launched as a one-node CUDA graph, by cuLaunchKernel, or once as a "
                         "persistent kernel rung by the host (default: BLINK_GPU_LAUNCH, else graph)")
    ap.add_argument("--spin-s", type=float, default=None,
                    help="diagnosis: how long the executor's waits for the device spin before sleeping "
                         "(default: its own rule, 50 ms while every rank has a core)")
    ap.add_argument("--chunk-counts", default=None,
                    help="comma list of chunk counts (e.g. 1,4,16,64,256): time the one size -e at each, the chunk "
                         "size set to size/count (host time must not grow with chunks); rows say chunks")
    ap.add_argument("--profile", default=None,
                    help="comma list of sizes at which rank 0's timed calls run under cProfile (top functions by "
                         "own time printed to stderr)")
    args = ap.parse_args()
    if args.threads:
        return run_threads(args)

    from mpi4py import MPI

    from blink_horovod.runtime.gpu.harness import GpuServer
    from blink_horovod.runtime.rendezvous import from_mpi

    mpi = MPI.COMM_WORLD
    rank, n = mpi.Get_rank(), mpi.Get_size()
    rdv = from_mpi(mpi)
    pids = rdv.allgather(os.getpid())
    plans = load_plans(args.plan_dir, args.topology, n)
    if ("allreduce", None) not in plans:
        if rank == 0:
            print(f"no plan {args.topology}-n{n}-allreduce.json in {args.plan_dir}", file=sys.stderr)
        return 2
    if args.flag_ops:
        os.environ["BLINK_GPU_FLAGS"] = args.flag_ops
    srv = GpuServer(rdv.local_rank, rdv.local_size, rdv.job_id, pids, timeout=120.0,
                    planner=lambda c, r: plans[(c, r)], fused_launch=args.fused_launch)
    if args.spin_s is not None:
        srv.ex._spin_s = args.spin_s
    ops = {"max": MPI.MAX, "sum": MPI.SUM}
    comm = _Comm(lambda obj: mpi.bcast(obj, root=0), mpi.Barrier, lambda x, op: mpi.allreduce(x, op=ops[op]))
    try:
        return bench(args, rank, n, srv, plans, comm, "processes (mpirun)")
    finally:
        rdv.close()


class _Comm:
    """What the benchmark needs between ranks: bcast from rank 0, a barrier, allreduce of a number."""

    def __init__(self, bcast, barrier, allreduce) -> None:
        self.bcast, self.barrier, self.allreduce = bcast, barrier, allreduce


def run_threads(args) -> int:
    """``args.threads`` ranks as threads sharing this process's CUDA context on device 0.

    Real device memory, streams, graphs, stream memory operations and kernels; what differs from
    processes is only that peers' buffers are mapped by address (one address space) instead of by
    CUDA IPC handles, and the control plane is the in-process loopback transport."""
    import threading

    from blink_horovod.runtime.gpu.device import SameProcessCuda
    from blink_horovod.runtime.gpu.harness import GpuServer
    from blink_horovod.runtime.loopback import LoopbackWorld

    n = args.threads
    plans = load_plans(args.plan_dir, args.topology, n)
    if ("allreduce", None) not in plans:
        print(f"no plan {args.topology}-n{n}-allreduce.json in {args.plan_dir}", file=sys.stderr)
        return 2
    world = LoopbackWorld(n, data_bytes=4096, nflags=16)
    # One context: memop waits would block the hardware queue they sit on (peers' streams share the
    # queues), spinning kernels do not.
    mode_flags = args.flag_ops if args.flag_ops not in (None, "auto") else "kernel"
    bar = threading.Barrier(n, timeout=300)
    box: list = [None] * n
    lock = threading.Lock()

    def bcast(obj, r):
        if r == 0:
            box[0] = obj
        bar.wait()
        out = box[0]
        bar.wait()
        return out

    def allreduce(x, op, r):
        box[r] = x
        bar.wait()
        vals = list(box)
        bar.wait()
        return max(vals) if op == "max" else sum(vals)

    results: list = [None] * n
    errors: list = []
    servers: list = [None] * n

    def main_of(r: int) -> None:
        srv = None
        try:
            srv = servers[r] = GpuServer(r, n, "threads", [os.getpid()] * n, timeout=120.0, planner=lambda c, q: plans[(c, q)],
                            transport=world.transport(r),
                            cuda=SameProcessCuda(0, flag_ops=mode_flags), fused_launch=args.fused_launch)
            # Load every CUDA module before any rank launches: loading a module may wait for the whole
            # context, i.e. for peer threads' graphs that wait for this rank's first launch.
            for dt in (GPU_DTYPES if args.dtype == "all" else tuple(args.dtype.split(","))):
                srv.ex.preload(dt)
            srv.ex.cuda.synchronize()
            bar.wait()
            comm = _Comm(lambda obj: bcast(obj, r), bar.wait, lambda x, op: allreduce(x, op, r))
            results[r] = bench(args, r, n, srv, plans, comm, "threads of one process")
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append((r, exc))
            bar.abort()
            if srv is not None:
                srv.ex.fail(exc)
                srv.close()

    threads = [threading.Thread(target=main_of, args=(r,), name=f"rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for srv in servers:
        if srv is not None:
            srv.ex.cuda.release_deferred()  # every rank closed: nothing runs any more
    if errors:
        import traceback

        for r, exc in errors:
            print(f"rank {r}: {type(exc).__name__}: {exc}", file=sys.stderr)
            traceback.print_exception(exc)
        return 2
    return max(results)


def _wait(obj) -> None:
    """Poll a CuPy stream or event until done: a thread blocked inside a CUDA synchronize may hold the
    GIL that a peer thread (threads mode) needs to launch the work being waited for."""
    while not obj.done:
        time.sleep(2e-5)


def bench(args, rank: int, n: int, srv, plans, comm: _Comm, mode: str) -> int:
    """One rank's nccl-tests loop; rank 0 prints."""
    import cupy

    started = time.monotonic()
    dtypes = GPU_DTYPES if args.dtype == "all" else tuple(args.dtype.split(","))
    sizes = []
    s = parse_size(args.minbytes)
    while s <= parse_size(args.maxbytes):
        sizes.append(s)
        s *= args.stepfactor
    plan = plans[("allreduce", None)] if args.collective == "allreduce" else plans[("broadcast", args.root)]
    ntrees = len(plan.trees)
    factor = 2 * (n - 1) / n if args.collective == "allreduce" else 1.0
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    # Persistent launches are ordered by the host, not the stream: done means synchronize(), and the
    # time is the host's wall clock up to it (events on `stream` see none of that work).
    host_ordered = srv.ex.host_ordered

    def finish() -> None:
        _wait(stream)
        if host_ordered:
            srv.synchronize()

    name = cupy.cuda.runtime.getDeviceProperties(srv.ex.device)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    if rank == 0:
        print(f"# blink gpu_perf: {n} ranks as {mode}, device {srv.ex.device} ({name}), "
              f"plan {args.topology} ({ntrees} trees), collective {args.collective}")
        print(f"# {'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>4} {'time':>9} {'algbw':>7} {'busbw':>7} "
              f"{'#wrong':>6} {'host_us':>8} {'cpu_us':>7} {'launch_us':>9} {'copy_GBps':>9}")
        print(f"# {'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>4} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}")
    stopped = False
    for dt in dtypes:
        itemsize = np.dtype(storage(dt)).itemsize
        cases = ([(parse_size(args.maxbytes), int(k)) for k in args.chunk_counts.split(",")] if args.chunk_counts
                 else [(sz, 0) for sz in sizes])
        for size, chunks in cases:
            late = bool(args.time_limit and time.monotonic() - started > args.time_limit)
            if comm.bcast(late):  # every rank stops at the same size
                stopped = True
                break
            count = max(1, size // itemsize)
            nbytes = count * itemsize
            if chunks:
                srv.chunk_bytes = max(256, (-(-nbytes // chunks) + 255) // 256 * 256)
            elif args.chunk_bytes:
                srv.chunk_bytes = parse_size(args.chunk_bytes)
            else:
                srv.chunk_bytes = int(min(4 << 20, max(64 << 10, nbytes // (ntrees * 8))))
            x = cupy.empty(count, storage(dt))
            fill(x, rank, dt, 0)
            _wait(cupy.cuda.get_current_stream())  # fill ran on CuPy's stream; the collectives use `stream`

            def once(name: str, x=x, count=count, dt=dt) -> None:
                if args.collective == "allreduce":
                    srv.allreduce(x, count, dt, "sum", stream=stream, name=name)
                else:
                    srv.broadcast(x, count, dt, args.root, stream=stream, name=name)

            wrong = 0
            if args.check:
                once("check")
                finish()
                wrong = count_wrong(x, dt, list(range(n)) if args.collective == "allreduce" else [args.root])
            iters = args.iters if nbytes < (64 << 20) else max(2, args.iters // 4)
            for _ in range(max(args.warmup_iters, 3)):  # >= 3: every epoch residue's launch exists
                once("perf")
            finish()
            comm.barrier()
            host = []
            cpu = []
            launch = []
            prof = None
            if rank == 0 and args.profile and nbytes in {parse_size(v) for v in args.profile.split(",")}:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            ops0 = srv.ex.chunk_ops
            w0 = time.perf_counter()
            e0.record(stream)
            for _ in range(iters):
                h0, c0 = time.perf_counter(), time.thread_time()
                once("perf")
                host.append(time.perf_counter() - h0)
                cpu.append(time.thread_time() - c0)
                launch.append(srv.ex.last_launch_seconds)
            e1.record(stream)
            ops_per_call = (srv.ex.chunk_ops - ops0) // max(1, iters)
            if prof is not None:
                prof.disable()
                import io
                import pstats

                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
                print(f"# profile of rank 0, {iters} calls of {nbytes} B {dt} ({mode}):\n{buf.getvalue()}",
                      file=sys.stderr, flush=True)
            _wait(e1)
            if host_ordered:
                srv.synchronize()
                t = (time.perf_counter() - w0) / iters
            else:
                t = cupy.cuda.get_elapsed_time(e0, e1) * 1e-3 / iters
            if args.check:  # once more, now through the repeat path (replay) the timed calls took
                fill(x, rank, dt, 0)
                _wait(cupy.cuda.get_current_stream())
                once("perf")
                finish()
                wrong += count_wrong(x, dt, list(range(n)) if args.collective == "allreduce" else [args.root])
            t = comm.allreduce(t, "max")
            wrong = comm.allreduce(wrong, "sum")
            copy_gbps = None
            if rank == 0:
                y = cupy.empty_like(x)
                e0.record(stream)
                for _ in range(5):
                    cupy.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                                  stream.ptr)
                e1.record(stream)
                e1.synchronize()
                copy_gbps = 2 * nbytes * 5 / (cupy.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9
                del y
            host_us = comm.allreduce(1e6 * float(np.median(host)), "max")
            launch_us = comm.allreduce(1e6 * float(np.median(launch)), "max")
            cpu_us = comm.allreduce(1e6 * float(np.median(cpu)), "max")
            algbw = nbytes / t / 1e9
            row = {"impl": "blink", "collective": args.collective, "size": nbytes, "count": count, "type": dt,
                   "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * factor, "wrong": wrong, "ranks": n,
                   "host_us": host_us, "launch_us": launch_us, "cpu_us": cpu_us, "mode": mode, "copy_GBps": copy_gbps,
                   "chunk_bytes": srv.chunk_bytes, "chunk_ops": ops_per_call, "replays": srv.ex.replays,
                   "root": args.root if args.collective == "broadcast" else -1}
            rows.append(row)
            if rank == 0:
                print(f"  {nbytes:>12} {count:>12} {NCCL[dt]:>8} {'sum' if args.collective == 'allreduce' else 'none':>6} "
                      f"{row['root']:>4} {t * 1e6:>9.1f} {algbw:>7.2f} {algbw * factor:>7.2f} {wrong:>6} "
                      f"{host_us:>8.1f} {cpu_us:>7.1f} {launch_us:>9.1f} {copy_gbps:>9.1f}  ({format_size(nbytes)}"
                      f"{f', {-(-nbytes // srv.chunk_bytes)} chunks, {ops_per_call} ops' if chunks else ''})", flush=True)
            del x
            cupy.get_default_memory_pool().free_all_blocks()  # 8 ranks of 1 GB share one GPU
        if stopped:
            break
    srv.close()
    if rank == 0:
        total_wrong = sum(r["wrong"] for r in rows)
        print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
        if stopped:
            print(f"# stopped after --time-limit {args.time_limit} s")
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as fh:
                json.dump({"rows": rows, "ranks": n, "topology": args.topology, "stopped_early": stopped}, fh, indent=1)
            os.replace(tmp, args.json)
    bad = comm.bcast(sum(r["wrong"] for r in rows) if rank == 0 else None)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
