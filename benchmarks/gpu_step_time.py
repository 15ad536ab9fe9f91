"""Step time of a ~100 M parameter PyTorch model under Horovod, with the communication split out.

A Horovod worker (run it under ``horovodrun``, with ``BLINK_ENABLE=1`` for Blink, without for
stock Horovod): an MLP of ``--layers`` square ``Linear`` layers of width ``--width`` (8 x 3584:
103 M parameters) on ``cuda:<local rank>``, gradients in ``--dtype`` (the model's dtype),
``hvd.DistributedOptimizer`` averaging them.  Rank 0 prints one JSON line::

    STEP {"blink": true, "dtype": "float32", "params": 102789120, "step_ms": ..., "compute_ms": ...,
          "comm_ms": ..., "allreduce_ms": ...}

- ``step_ms``: one training step (forward, backward with the gradients' allreduces overlapping it,
  ``optimizer.step``), median of ``--steps`` after ``--warmup``;
- ``compute_ms``: the same step with a plain optimizer (no communication);
- ``comm_ms``: ``step_ms - compute_ms``, what communication adds to a step;
- ``allreduce_ms``: the gradients alone, one grouped allreduce of every gradient (median).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time

import horovod.torch as hvd
import torch
from torch import nn


def timed(fn, n: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dump-after", type=float, default=0.0, metavar="S",
                    help="print every thread's stack once if the training steps have not ended after S seconds "
                         "(what each rank is doing in a stall; 0: never)")
    args = ap.parse_args()

    hvd.init()
    failed = False
    try:
        run(args)
    except Exception as exc:  # noqa: BLE001 - stock Horovod refuses bfloat16 CUDA tensors: said in the table
        failed = True
        if hvd.rank() == 0:
            print("STEP " + json.dumps({"ranks": hvd.size(), "dtype": args.dtype,
                                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}),
                  flush=True)
    hvd.shutdown()
    if failed:  # the job's exit status says so too (the table row says what)
        sys.exit(1)


def run(args: argparse.Namespace) -> None:
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dev, dt)
    params = sum(p.numel() for p in model.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(args.batch, args.width, device=dev, dtype=dt)

    plain = torch.optim.SGD(model.parameters(), lr=1e-6)

    def compute() -> None:
        plain.zero_grad()
        model(x).float().pow(2).mean().backward()
        plain.step()

    compute_ms = timed(compute, args.steps, args.warmup)  # before DistributedOptimizer hooks the gradients
    dist = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                    named_parameters=model.named_parameters())

    def step() -> None:
        dist.zero_grad()
        model(x).float().pow(2).mean().backward()
        dist.step()

    grads = [torch.ones_like(p) for p in model.parameters()]

    def allreduce() -> None:
        hvd.grouped_allreduce_(grads, op=hvd.Average, name="grads")

    if args.dump_after > 0:
        faulthandler.dump_traceback_later(args.dump_after, repeat=False)
    step_ms = timed(step, args.steps, args.warmup)
    faulthandler.cancel_dump_traceback_later()
    allreduce_ms = timed(allreduce, args.steps, args.warmup)
    if hvd.rank() == 0:
        from blink_horovod.ops import torch_ops

        print("STEP " + json.dumps({
            "blink": torch_ops.context() is not None, "ranks": hvd.size(), "dtype": args.dtype, "params": params,
            "step_ms": round(step_ms, 2), "compute_ms": round(compute_ms, 2),
            "comm_ms": round(step_ms - compute_ms, 2), "allreduce_ms": round(allreduce_ms, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
