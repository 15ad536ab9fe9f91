"""Probe the GPU executor's cross-process primitives on one device, before anything else runs.

Two processes (spawned) on the same CUDA device: each allocates a flag word
and a 64 MB buffer, exports them with CUDA IPC, maps the other's, then

1. ping-pong with stream memory operations: A writes its flag = i
   (``cuStreamWriteValue32``), B waits for it (``cuStreamWaitValue32`` AND,
   on A's IPC-mapped word) and answers; round trips per second tell the cost
   of one cross-process signal on a shared GPU (time-sliced contexts);
2. the same ping-pong captured as a CUDA graph of K round trips per launch;
3. a peer read: B copies A's buffer through the mapping and checks it, and
   times device-to-device copies of local and of peer memory.

``python benchmarks/gpu_pingpong.py [--json FILE]``; prints one JSON object.
It exists because none of this had been run when the executor was written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROUNDS = 2000
GRAPH_K = 64
MB = 64


def worker(role: int, q_out, q_in, result, flag_ops: str = "memop") -> None:

    from blink_horovod.runtime.gpu.device import Cuda
    from blink_horovod.runtime.gpu.lowering import epoch_value  # noqa: F401 - import check on the device machine

    out: dict = {"role": role, "flag_ops": flag_ops}
    try:
        c = Cuda(0, flag_ops=flag_ops)
        base = c.malloc(4096 + MB * (1 << 20))
        c.memset(base, 0, 4096)
        import cupy

        buf = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(base + 4096, MB << 20, None), 0)
        arr = cupy.ndarray((MB << 20) // 4, cupy.float32, buf)
        arr[...] = cupy.arange(arr.size, dtype=cupy.float32) * (role + 1)
        c.synchronize()
        q_out.put(c.ipc_handle(base))
        peer = c.ipc_open(q_in.get(timeout=60))
        s = c.stream()
        mine, theirs = base, peer
        # 1. eager ping-pong
        t0 = time.perf_counter()
        for i in range(1, ROUNDS + 1):
            if role == 0:
                c.write_value(s.ptr, mine, i & 0xFFFFFFFF)
                c.drv.cuStreamWaitValue32(c.drv.CUstream(s.ptr), c.drv.CUdeviceptr(theirs), c.drv.cuuint32_t(i),
                                          c.drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            else:
                c.drv.cuStreamWaitValue32(c.drv.CUstream(s.ptr), c.drv.CUdeviceptr(theirs), c.drv.cuuint32_t(i),
                                          c.drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
                c.write_value(s.ptr, mine, i & 0xFFFFFFFF)
        s.synchronize()
        dt = time.perf_counter() - t0
        out["eager_round_trip_us"] = 1e6 * dt / ROUNDS
        # 2. captured: one-hot AND waits as the executor uses them, K round trips per graph
        c.memset(base, 0, 4096)
        c.synchronize()
        q_out.put("reset")
        q_in.get(timeout=60)
        graphs = []
        for v in range(3):
            c.begin_capture(s.ptr)
            for k in range(GRAPH_K):
                word = 4 * (1 + k)
                val = 1 << ((v + k) % 3)
                if role == 0:
                    c.write_value(s.ptr, mine + word, val)
                    c.wait_value_and(s.ptr, theirs + word, val)
                else:
                    c.wait_value_and(s.ptr, theirs + word, val)
                    c.write_value(s.ptr, mine + word, val)
            g = c.end_capture(s.ptr)
            graphs.append(c.instantiate(g))
            c.destroy_graph(g)
        launches = 30
        host = 0.0
        t0 = time.perf_counter()
        for j in range(launches):
            h0 = time.perf_counter()
            c.launch(graphs[j % 3], s.ptr)
            host += time.perf_counter() - h0
        s.synchronize()
        dt = time.perf_counter() - t0
        out["graph_round_trip_us"] = 1e6 * dt / (launches * GRAPH_K)
        out["graph_launch_host_us"] = 1e6 * host / launches
        # 3. peer read, checked, and copy rates
        peer_arr = cupy.ndarray(arr.size, cupy.float32,
                                cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(peer + 4096, MB << 20, None), 0))
        want = cupy.arange(arr.size, dtype=cupy.float32) * (2 - role)
        out["peer_read_wrong"] = int(cupy.count_nonzero(peer_arr != want))
        dst = cupy.empty_like(arr)
        e0, e1 = c.timing_event(), c.timing_event()
        for name, src in (("local", base + 4096), ("peer", peer + 4096)):
            c.record(e0, s.ptr)
            for _ in range(10):
                c.copy_async(dst.data.ptr, src, MB << 20, s.ptr)
            c.record(e1, s.ptr)
            s.synchronize()
            out[f"copy_{name}_GBps"] = 2 * 10 * (MB << 20) / (c.elapsed_ms(e0, e1) * 1e-3) / 1e9
        q_out.put("done")
        q_in.get(timeout=60)
        c.ipc_close(peer)
        c.free(base)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-1500:]
    result.put(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--flag-ops", default="memop", choices=["memop", "kernel"],
                    help="flag waits/writes as stream memory operations or as one-thread kernels")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a2b, b2a, res = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(0, a2b, b2a, res, args.flag_ops)), ctx.Process(target=worker, args=(1, b2a, a2b, res, args.flag_ops))]
    for p in procs:
        p.start()
    outs = []
    try:
        for _ in procs:
            outs.append(res.get(timeout=120))
    except Exception as exc:  # noqa: BLE001
        outs.append({"error": f"no result in 120 s: {exc} (a cross-process wait never returned?)"})
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    result = {"probe": "gpu_pingpong", "rounds": ROUNDS, "graph_k": GRAPH_K, "results": sorted(outs, key=lambda o: o.get("role", 9))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 0 if all("error" not in o for o in outs) else 1


if __name__ == "__main__":
    sys.exit(main())
