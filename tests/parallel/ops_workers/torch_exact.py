"""One rank of the exact-results job: horovod.torch with BLINK_ENABLE=1 on several servers.

Integer-valued data (nccl-tests' idea) so every result is checked exactly.
Prints "RANK r OK <stats json>" at the end; any failure raises (non-zero exit).
"""

import json
import os

import horovod.torch as hvd
import numpy as np
import torch
from blink_horovod.ops import torch_ops
from blink_job import start

import blink_horovod

r, n, ctx = start(2)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]


def base(dt, shape=(7, 13), k=0):
    v = (torch.arange(int(np.prod(shape))).reshape(shape) % 5) + k
    return v.to(dt)


# sums of every dtype, 1-D to 3-D, out of place and in place
for dt in DTYPES:
    for shape in [(17,), (5, 9), (3, 4, 5)]:
        x = base(dt, shape, r)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dt}.{len(shape)}")
        want = sum(base(torch.int64, shape, q) for q in range(n)).to(dt)
        assert torch.equal(y, want), (dt, shape, y, want)
        assert torch.equal(x, base(dt, shape, r)), "allreduce modified its input"
        hvd.allreduce_(x, op=hvd.Sum)
        assert torch.equal(x, want)

# Average: integers truncate toward zero as Horovod's ScaleBuffer does; floats exact here
a = torch.tensor([-7, -3, 1, 5, 6], dtype=torch.int32) + r
got = hvd.allreduce(a, op=hvd.Average)
s = sum(torch.tensor([-7, -3, 1, 5, 6], dtype=torch.int64) + q for q in range(n))
assert torch.equal(got, torch.trunc(s.double() * (1.0 / n)).to(torch.int32)), got
f = torch.full((10,), 2.0 * (r + 1))
assert torch.equal(hvd.allreduce(f), torch.full((10,), float(n + 1)))

# min / max / product
v = torch.tensor([r, -r, 3], dtype=torch.int64)
assert torch.equal(hvd.allreduce(v, op=hvd.Min), torch.tensor([0, -(n - 1), 3]))
assert torch.equal(hvd.allreduce(v, op=hvd.Max), torch.tensor([n - 1, 0, 3]))
p = torch.tensor([2.0, -1.0]) if r % 2 else torch.tensor([1.0, 1.0])
assert torch.equal(hvd.allreduce(p, op=hvd.Product), torch.tensor([2.0 ** (n // 2), (-1.0) ** (n // 2)]))

# prescale / postscale (float32 math, as Horovod)
pre = hvd.allreduce(torch.full((6,), 4.0), op=hvd.Sum, prescale_factor=0.25, postscale_factor=3.0)
assert torch.equal(pre, torch.full((6,), 3.0 * n))

# grouped, and async handles with poll
g = hvd.grouped_allreduce([base(torch.int32, (4,), r), base(torch.float64, (3, 3), r)], op=hvd.Sum)
assert torch.equal(g[0], sum(base(torch.int64, (4,), q) for q in range(n)).int())
hs = [hvd.allreduce_async(torch.full((3,), float(i + r)), op=hvd.Sum, name=f"async.{i}") for i in range(20)]
assert not all(hvd.poll(h) for h in hs) or True
for i, h in enumerate(hs):
    assert torch.equal(hvd.synchronize(h), torch.full((3,), float(n * i + n * (n - 1) // 2)))

# broadcast from every root, including ranks of the second server; bool and int8 too
for root in range(n):
    for dt in (torch.uint8, torch.int8, torch.int16, torch.float32, torch.float64, torch.bool):
        t = (torch.full((11,), float(r + 1)) if dt != torch.bool else torch.full((11,), r % 2 == 0)).to(dt)
        out = hvd.broadcast(t, root_rank=root, name=f"bc.{root}.{dt}")
        want = (torch.full((11,), float(root + 1)) if dt != torch.bool else torch.full((11,), root % 2 == 0)).to(dt)
        assert torch.equal(out, want), (root, dt, out)

# autograd through allreduce, grouped allreduce and broadcast; .sum()'s backward hands Horovod's
# backward an expanded (non-contiguous) gradient, which Blink makes contiguous
x = torch.ones(5, requires_grad=True)
hvd.allreduce(x, op=hvd.Sum).sum().backward()
assert torch.equal(x.grad, torch.full((5,), float(n)))
gx = [torch.ones(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
go = hvd.grouped_allreduce(gx, op=hvd.Sum, name="grad.grouped")
(go[0].sum() + 2 * go[1].sum()).backward()
assert torch.equal(gx[0].grad, torch.full((3,), float(n))) and torch.equal(gx[1].grad, torch.full((2, 2), 2.0 * n))
bx = torch.ones(4, requires_grad=True)
(3 * hvd.broadcast(bx, root_rank=n - 1, name="grad.bc")).sum().backward()
assert torch.equal(bx.grad, torch.full((4,), 3.0 if r == n - 1 else 0.0)), bx.grad  # Average, then root only
# a non-contiguous tensor passed directly keeps Horovod's error
try:
    hvd.allreduce(torch.ones(4, 6).t(), name="noncontig")
    raise AssertionError("non-contiguous tensor accepted")
except ValueError as exc:
    assert "contiguous" in str(exc)

# model and optimizer state broadcast from the last rank (on the second server)
torch.manual_seed(r)
model = torch.nn.Linear(8, 4)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_optimizer_state(opt, root_rank=n - 1)
digests = hvd.allgather_object(float(sum(p.double().sum() for p in model.parameters())))
assert len(set(digests)) == 1, digests

# mismatched shapes: an error on every rank, as Horovod's (RuntimeError, HorovodInternalError)
try:
    hvd.allreduce(torch.zeros(17 + (r == n - 1)), name="bad")
    raise AssertionError("mismatch not detected")
except hvd.HorovodInternalError as exc:
    assert "shape differs: " in str(exc) and f"rank {n - 1} sent [18]" in str(exc) and isinstance(exc, RuntimeError), str(exc)

# duplicate in-flight name
h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup") if r == 0 else None
if r == 0:
    try:
        hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
        raise AssertionError("duplicate name accepted")
    except ValueError:
        pass
hvd.barrier()
if r != 0:
    h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="dup")
assert torch.equal(hvd.synchronize(h), torch.full((3,), float(n)))

# join: rank 0 joins first and contributes zeros; Average divides by the job size
if r == 0:
    last = hvd.join()
else:
    out = hvd.allreduce(torch.full((4,), 6.0), op=hvd.Average, name="joined")
    assert torch.equal(out, torch.full((4,), 6.0 * (n - 1) / n)), out
    last = hvd.join()
assert last != 0 and len(set(hvd.allgather_object(last))) == 1

st = blink_horovod.stats()
# every broadcast of this script went through Blink: 6 dtypes x n roots, the autograd one, the model's
# weight and bias, Adam's step/exp_avg/exp_avg_sq of both parameters and broadcast_object's size and payload
assert st["allreduce"] > 50 and st["broadcast"] == 6 * n + 1 + 2 + 3 * 2 + 2, st
# shutdown / init cycle (Gloo only: MPI cannot re-initialise)
if os.environ.get("HOROVOD_RANK") is not None:
    hvd.shutdown()
    hvd.init()
    assert torch_ops.context() is not None
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
print(f"RANK {r} OK {json.dumps(st)}", flush=True)
hvd.shutdown()
