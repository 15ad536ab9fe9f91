"""One rank of the CUDA exact-results job: horovod.torch with BLINK_ENABLE=1, every tensor on the GPU.

Integer-valued data, so every result is checked exactly (floats too: the sums are small integers).
Each check counts its wrong elements instead of stopping at the first; the rank prints
``RANK r CUDA {"wrong": {...}, "stats": {...}}`` and exits non-zero when anything was wrong.
Every CUDA tensor of the script must be carried by Blink: ``stats()["fallback"]`` stays 0.
"""

import json
import sys

import horovod.torch as hvd
import torch
from blink_job import start

import blink_horovod

r, n, ctx = start(2)
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
DEV = torch.device("cuda", torch.cuda.current_device())
wrong: dict[str, int] = {}


def check(what: str, got, want) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        wrong[what] = -1
        return
    bad = int((got.double() != want.double()).sum()) if got.dtype != torch.bool else int((got != want).sum())
    if bad:
        wrong[what] = bad


def base(dt, count, k=0):
    return ((torch.arange(count, device=DEV) % 5) + k).to(dt)


DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
SIZES = [1, 17, 1031, 65537, 1 << 20]  # one element .. 1 Mi elements (several items per tree)

# sums of every dtype, out of place (input unchanged) and in place
for dt in DTYPES:
    for count in SIZES:
        x = base(dt, count, r)
        want = sum(base(torch.int64, count, q) for q in range(n)).to(dt)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dt}.{count}")
        check(f"sum {dt} {count}", y, want)
        check(f"input kept {dt} {count}", x, base(dt, count, r))
        hvd.allreduce_(x, op=hvd.Sum, name=f"sum_.{dt}.{count}")
        check(f"sum_ {dt} {count}", x, want)

# Average (floats: exact here; integers truncate toward zero as Horovod's ScaleBuffer)
for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    f = torch.full((4099,), 2.0 * (r + 1), device=DEV, dtype=dt)
    check(f"average {dt}", hvd.allreduce(f, name=f"avg.{dt}"), torch.full((4099,), float(n + 1), device=DEV))
a = torch.tensor([-7, -3, 1, 5, 6], dtype=torch.int32, device=DEV) + r
s = sum(torch.tensor([-7, -3, 1, 5, 6], dtype=torch.int64) + q for q in range(n))
check("average int32", hvd.allreduce(a, op=hvd.Average, name="avg.int32"), torch.trunc(s.double() / n).to(torch.int32))

# min / max / product
v = torch.tensor([r, -r, 3], dtype=torch.int64, device=DEV)
check("min", hvd.allreduce(v, op=hvd.Min, name="min"), torch.tensor([0, -(n - 1), 3]))
check("max", hvd.allreduce(v, op=hvd.Max, name="max"), torch.tensor([n - 1, 0, 3]))
p = torch.tensor([2.0, -1.0], device=DEV) if r % 2 else torch.tensor([1.0, 1.0], device=DEV)
check("product", hvd.allreduce(p, op=hvd.Product, name="prod"), torch.tensor([2.0 ** (n // 2), (-1.0) ** (n // 2)]))

# prescale / postscale
pre = hvd.allreduce(torch.full((4096,), 4.0, device=DEV), op=hvd.Sum, prescale_factor=0.25, postscale_factor=3.0,
                    name="scaled")
check("pre/postscale", pre, torch.full((4096,), 3.0 * n))

# grouped (two dtypes, fused per dtype) and async handles on a side stream
g = hvd.grouped_allreduce([base(torch.int32, 4, r), base(torch.float64, 9, r), base(torch.int32, 70000, r)],
                          op=hvd.Sum, name="grouped")
check("grouped 0", g[0], sum(base(torch.int64, 4, q) for q in range(n)))
check("grouped 1", g[1], sum(base(torch.int64, 9, q) for q in range(n)))
check("grouped 2", g[2], sum(base(torch.int64, 70000, q) for q in range(n)))
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    srcs = [torch.full((3000,), float(i + r), device=DEV) for i in range(20)]
    hs = [hvd.allreduce_async(t, op=hvd.Sum, name=f"async.{i}") for i, t in enumerate(srcs)]
    outs = [hvd.synchronize(h) for h in hs]
    for i, o in enumerate(outs):
        check(f"async {i}", o * 1, torch.full((3000,), float(n * i + n * (n - 1) // 2)))

# broadcast from every root (ranks of the second server included), every dtype and bool
for root in range(n):
    for dt in DTYPES + [torch.bool]:
        t = (torch.full((1031,), r % 2 == 0, device=DEV) if dt == torch.bool
             else torch.full((1031,), float(r + 1), device=DEV).to(dt))
        want = (torch.full((1031,), root % 2 == 0) if dt == torch.bool else torch.full((1031,), float(root + 1)).to(dt))
        check(f"broadcast root {root} {dt}", hvd.broadcast(t, root_rank=root, name=f"bc.{root}.{dt}"), want)

# model and optimizer state broadcast from the last rank, DistributedOptimizer steps
torch.manual_seed(r)
model = torch.nn.Linear(64, 32).to(DEV)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
for step in range(3):
    opt.zero_grad()
    model(torch.full((8, 64), float(r + step), device=DEV)).sum().backward()
    opt.step()
digest = torch.stack([q.double().sum() for q in model.parameters()]).sum().reshape(1)
lo, hi = hvd.allreduce(digest, op=hvd.Min, name="digest.min"), hvd.allreduce(digest, op=hvd.Max, name="digest.max")
check("model weights equal on every rank", lo, hi)

# a mismatch on the GPU path: every rank raises the same error naming the field, the values and the ranks
try:
    hvd.allreduce(torch.zeros(17 + (r == n - 1), device=DEV), name="bad")
    wrong["mismatch not detected"] = 1
except hvd.HorovodInternalError as exc:
    if "shape differs: " not in str(exc) or f"rank {n - 1} sent [18]" not in str(exc):
        wrong[f"mismatch message: {exc}"] = 1

# join: rank 0 joins first and contributes the identity on its GPU; Average divides by the job size
if r == 0:
    hvd.join()
else:
    out = hvd.allreduce(torch.full((4,), 6.0, device=DEV), op=hvd.Average, name="joined")
    check("allreduce beside a joined rank", out, torch.full((4,), 6.0 * (n - 1) / n))
    hvd.join()

st = blink_horovod.stats()
if st["fallback"] != 0:
    wrong["fallback"] = st["fallback"]
print(f"RANK {r} CUDA {json.dumps({'wrong': wrong, 'stats': st})}", flush=True)
hvd.shutdown()
sys.exit(1 if wrong else 0)
