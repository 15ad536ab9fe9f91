"""What one GPU read of mapped host memory costs, beside a read of device memory (the small-message suspect).

The fused kernels read their argument slot (and the persistent kernel its bell word) from pinned host
memory mapped into the device (``cudaHostAllocMapped``).  Since that change, small-message latency at 2
ranks grew from 55-73 us to ~250 us (docs/gpu-runtime.md, "Persistent launch").  If one dependent read
of host memory costs tens of microseconds on this VM (PCIe behind an IOMMU), a handful of them per block
would explain it.  This probe measures, with the GPU's own nanosecond clock (``%globaltimer``):

1. ``chase``: N dependent volatile 8-byte loads (a pointer chase, so none overlaps the next) over a
   buffer in mapped host memory, and the same over device memory; time per load;
2. ``blocks``: the same chase of 3 loads run by thread 0 of every block of a grid of B blocks at once
   (what every block of the fused kernel does for its argument slot), time to the last block's end;
3. ``launch``: host time of an empty kernel launched and synchronised, for scale.

``python benchmarks/gpu_mapped_probe.py [--json FILE]``; prints a table and one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

SRC = r"""
extern "C" __device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void chase(const unsigned long long* start, int n, unsigned long long* out) {
    if (threadIdx.x != 0) return;
    const volatile unsigned long long* p = (const volatile unsigned long long*)start;
    unsigned long long t0 = now_ns();
    for (int i = 0; i < n; ++i) p = (const volatile unsigned long long*)(*p);
    unsigned long long t1 = now_ns();
    out[2 * blockIdx.x] = t1 - t0;
    out[2 * blockIdx.x + 1] = (unsigned long long)p;  // keeps the chase live
}
extern "C" __global__ void empty() {}
"""

LINE = 128  # bytes between chased words: one per cache line, as different slots would be


def build_chain(host_u64, base_dev: int, count: int) -> None:
    """host_u64[k * LINE/8] = device address of word k+1 (the last points back to the first)."""
    step = LINE // 8
    for k in range(count):
        nxt = (k + 1) % count
        host_u64[k * step] = base_dev + nxt * LINE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result object here too")
    ap.add_argument("--loads", default="1,3,10,100,1000", help="chase lengths (comma-separated)")
    ap.add_argument("--blocks", default="1,16,64,132,264", help="grid sizes for the per-block chase of 3")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    rt = cp.cuda.runtime
    mod = cp.RawModule(code=SRC)
    chase, empty = mod.get_function("chase"), mod.get_function("empty")
    words = 4096
    nbytes = words * LINE
    hptr = int(rt.hostAlloc(nbytes, rt.hostAllocPortable | rt.hostAllocMapped))
    # CuPy's runtime module has no cudaHostGetDevicePointer; the pointer attributes give the same
    # device address (under unified addressing it equals the host address).
    hdev = int(rt.pointerGetAttributes(hptr).devicePointer)
    host = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * (nbytes // 8)).from_address(hptr))
    build_chain(host, hdev, words)
    dbuf = cp.zeros(nbytes // 8, dtype=cp.uint64)
    dhost = np.zeros(nbytes // 8, dtype=np.uint64)
    build_chain(dhost, int(dbuf.data.ptr), words)
    dbuf.set(dhost)
    out = cp.zeros(2 * 1024, dtype=cp.uint64)

    def timed(start: int, n: int, grid: int) -> float:
        vals = []
        for _ in range(args.reps):
            chase((grid,), (32,), (np.uint64(start), np.int32(n), out))
            cp.cuda.runtime.deviceSynchronize()
            vals.append(int(out[0: 2 * grid: 2].max().get()))
        return float(np.median(vals))

    res: dict = {"chase_ns_per_load": {}, "blocks_3loads_ns": {}, "launch_us": None}
    print(f"{'loads':>6} {'host ns/load':>13} {'device ns/load':>15}")
    for n in (int(x) for x in args.loads.split(",")):
        h = timed(hdev, n, 1) / n
        d = timed(int(dbuf.data.ptr), n, 1) / n
        res["chase_ns_per_load"][n] = {"mapped_host": h, "device": d}
        print(f"{n:>6} {h:>13.0f} {d:>15.0f}")
    print(f"{'blocks':>6} {'host 3 loads ns':>16} {'device 3 loads ns':>18}")
    for b in (int(x) for x in args.blocks.split(",")):
        h, d = timed(hdev, 3, b), timed(int(dbuf.data.ptr), 3, b)
        res["blocks_3loads_ns"][b] = {"mapped_host": h, "device": d}
        print(f"{b:>6} {h:>16.0f} {d:>18.0f}")
    lat = []
    for _ in range(200):
        t0 = time.perf_counter()
        empty((1,), (32,), ())
        cp.cuda.runtime.deviceSynchronize()
        lat.append((time.perf_counter() - t0) * 1e6)
    res["launch_us"] = float(np.median(lat))
    print(f"empty kernel launch + synchronize: {res['launch_us']:.1f} us (median of 200)")
    rt.freeHost(hptr)
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
