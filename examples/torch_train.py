"""A plain Horovod + PyTorch training script: nothing in it knows about Blink.

Run it with stock Horovod or with Blink underneath -- the script is the same:

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/torch_train.py
    blinkrun   -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/torch_train.py

(``blinkrun`` = ``horovodrun`` with ``BLINK_ENABLE=1`` and the ``BLINK_*``
variables set on every rank.)  Each rank trains on its own synthetic shard;
``DistributedOptimizer`` averages the gradients, ``broadcast_parameters`` and
``broadcast_optimizer_state`` start every rank from rank 0's state.
``--save FILE`` writes rank 0's final weights (``.npz``) so runs can be compared.
``--device cuda`` (the default where a GPU is present) puts the model and data on
``cuda:<local rank>``, as Horovod's examples do.
"""

import argparse
import time

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

import horovod.torch as hvd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--save", default="", help="write rank 0's final weights here (.npz)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the model and data live (auto: cuda when a GPU is present)")
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different initial weights per rank: the broadcast must fix them
    torch.set_num_threads(1)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    gen = torch.Generator().manual_seed(42 + hvd.rank())  # each rank its own shard
    for step in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if hvd.rank() == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}  {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)

    if args.save and hvd.rank() == 0:
        np.savez(args.save, **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    hvd.shutdown()


if __name__ == "__main__":
    main()
