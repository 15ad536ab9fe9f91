"""Fusion benchmark: 100 tensors of mixed sizes allreduced per step, stock Horovod vs Blink, in one run.

    blinkrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/fusion_benchmark.py [--steps 10]

Every step submits 100 named ``hvd.allreduce_async_`` calls (sizes from 1 KB to
4 MB, a fixed log-uniform mix as in a real model's gradients, 70.7 MB in all)
and waits for all of them: the time is the step's communication time.  Besides
the wall time (the slowest rank's), each step's CPU time is measured (the
rank's process CPU time over the step, all threads: Horovod's background thread
and Blink's engine included), summed over ranks: on a shared, loaded machine
it does not grow with other jobs' load as the wall time does.  Steps
alternate between stock Horovod (``blink_horovod.ops.bypass()``, Horovod's own
tensor fusion) and Blink (its engine fuses the collectives that are queued on
every rank, up to ``HOROVOD_FUSION_THRESHOLD``), so both see the same machine
load.  Results are checked exactly (integer-valued float32 data) and rank 0
prints both medians; ``--json FILE`` writes every step.
Without ``BLINK_ENABLE=1`` (plain ``horovodrun``) both columns are stock Horovod.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

import horovod.torch as hvd

try:
    from blink_horovod.ops.patching import bypass
except ImportError:  # blink_horovod not installed: both columns are stock Horovod
    import contextlib

    bypass = contextlib.nullcontext


def make_tensors(n: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    elems = np.exp(rng.uniform(np.log(256), np.log(1 << 20), n)).astype(int)  # 1 KB .. 4 MB of float32
    return [torch.zeros(int(e), dtype=torch.float32) for e in elems]


def one_step(tensors, rank: int, step: int, tag: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step's 100 allreduces on this rank."""
    for i, t in enumerate(tensors):
        t.fill_(float(rank + i + step))
    c0 = time.process_time()
    t0 = time.perf_counter()
    handles = [hvd.allreduce_async_(t, name=f"{tag}.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    n = hvd.size()
    for i, t in enumerate(tensors):  # exact: sum over ranks of (rank + i + step)
        want = float(n * (i + step) + n * (n - 1) // 2)
        if not bool((t == want).all()):
            raise AssertionError(f"{tag}: tensor {i} wrong on rank {rank}: {float(t[0])} != {want}")
    return dt, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    ap.add_argument("--tensors", type=int, default=100, help="tensors allreduced per step")
    ap.add_argument("--json", default="", help="rank 0 writes the per-step figures to this file")
    args = ap.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    stock_t, blink_t = make_tensors(args.tensors), make_tensors(args.tensors)
    total = sum(t.numel() * 4 for t in stock_t)
    rows = []
    for step in range(args.steps + 1):  # step 0 warms both paths up (plans, buffers)
        with bypass():
            hvd.barrier()
            s = one_step(stock_t, rank, step, f"stock{step}")
            hvd.barrier()
        b = one_step(blink_t, rank, step, f"blink{step}")
        with bypass():
            per_rank = hvd.allgather_object((s, b))  # [((wall, cpu) stock, (wall, cpu) Blink) per rank]
        if step:  # wall: the slowest rank's; CPU: all ranks together
            rows.append({"step": step,
                         "stock_s": max(st[0] for st, _ in per_rank), "blink_s": max(bl[0] for _, bl in per_rank),
                         "stock_cpu_s": sum(st[1] for st, _ in per_rank),
                         "blink_cpu_s": sum(bl[1] for _, bl in per_rank)})
    if rank == 0:
        ms = statistics.median(r["stock_s"] for r in rows) * 1e3
        mb = statistics.median(r["blink_s"] for r in rows) * 1e3
        print(f"fusion benchmark: {hvd.size()} ranks, {args.tensors} tensors/step, {total / 1e6:.1f} MB/step, "
              f"{args.steps} steps")
        cs = statistics.median(r["stock_cpu_s"] for r in rows) * 1e3
        cb = statistics.median(r["blink_cpu_s"] for r in rows) * 1e3
        print(f"{'step':>5} {'stock ms':>10} {'blink ms':>10} {'stock cpu ms':>13} {'blink cpu ms':>13}")
        for r in rows:
            print(f"{r['step']:>5} {r['stock_s'] * 1e3:>10.1f} {r['blink_s'] * 1e3:>10.1f} "
                  f"{r['stock_cpu_s'] * 1e3:>13.1f} {r['blink_cpu_s'] * 1e3:>13.1f}")
        print(f"median stock {ms:.1f} ms, Blink {mb:.1f} ms -> {ms / mb:.2f}x (stock time / Blink time)")
        print(f"median CPU (all ranks) stock {cs:.1f} ms, Blink {cb:.1f} ms -> {cs / cb:.2f}x")
        try:
            import blink_horovod

            print(f"blink_horovod.stats(): {blink_horovod.stats()}")
        except ImportError:
            pass
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"ranks": hvd.size(), "tensors": args.tensors, "bytes_per_step": total, "rows": rows,
                           "median_stock_s": ms / 1e3, "median_blink_s": mb / 1e3,
                           "median_stock_cpu_s": cs / 1e3, "median_blink_cpu_s": cb / 1e3}, fh)
    hvd.shutdown()


if __name__ == "__main__":
    main()
