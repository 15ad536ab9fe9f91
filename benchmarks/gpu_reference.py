"""The yardsticks of the GPU executor on one GPU, in one process: the device's copy rate and a plain
PyTorch two-shot allreduce of n buffers (slice r of every buffer summed into buffer r with ``add_``, then
the reduced slices copied out with ``copy_``), busbw as nccl-tests counts it.

    python benchmarks/gpu_reference.py --ranks 2,4,8 --sizes 256M,1G --json ref.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blink_horovod.cli.perf_cmd import busbw_factor, hbm_bound_busbw


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(t[:-1]) * mult[t[-1]] if t[-1] in mult else int(t)


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_seconds(size: int, reps: int) -> float:
    """One device-to-device copy of ``size`` bytes."""
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), reps)


def two_shot_seconds(n: int, count: int, dt: torch.dtype, reps: int) -> float:
    """The plain two-shot allreduce of n buffers of ``count`` elements, in one process."""
    bufs = [torch.ones(count, dtype=dt, device="cuda") for _ in range(n)]
    bounds = [(r * count // n, (r + 1) * count // n) for r in range(n)]

    def two_shot() -> None:
        for r, (lo, hi) in enumerate(bounds):
            acc = bufs[r][lo:hi]
            for q in range(n):
                if q != r:
                    acc.add_(bufs[q][lo:hi])
        for r, (lo, hi) in enumerate(bounds):
            for q in range(n):
                if q != r:
                    bufs[q][lo:hi].copy_(bufs[r][lo:hi])

    return timed(two_shot, reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--sizes", default="256M,1G")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dt = getattr(torch, a.dtype)
    rows = []
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        copy_rate = 2 * size / copy_seconds(size, a.reps)
        for n in [int(x) for x in a.ranks.split(",")]:
            busbw = size / two_shot_seconds(n, size // dt.itemsize, dt, a.reps) / 1e9 * busbw_factor("allreduce", n)
            bound = hbm_bound_busbw(copy_rate, size, "allreduce", n)
            rows.append({"ranks": n, "size": size, "dtype": a.dtype, "copy_rate_gbs": copy_rate / 1e9,
                         "two_shot_busbw": busbw, "hbm_bound_busbw": bound})
            print(f"n={n} size={size} {a.dtype}: copy rate {copy_rate / 1e9:.0f} GB/s, HBM bound busbw {bound:.1f}, "
                  f"torch two-shot busbw {busbw:.1f} GB/s ({100 * busbw / bound:.0f}% of the bound)", flush=True)
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
