"""The barrier margin of Horovod's test_global_barrier_op, measured many times (README.md, item 1).

    [BLINK_ENABLE=1 [OLD=1]] TRIALS=25 SLEEP=1 horovodrun -np 4 -H localhost:4 --gloo python barrier_margin_probe.py

Prints "PROBE trial=t rank=r bt=<seconds from the allreduce's end to the barrier's>"; the margin is bt - SLEEP.
"""

import os
import time

import horovod.torch as hvd
import torch

hvd.init()
if os.environ.get("OLD") == "1":   # the barrier as it was before 44ec42c: the round only, no barrier stage
    from blink_horovod.ops import torch_ops
    torch_ops.context().engine.hierarchy.barrier = lambda tag: None
for trial in range(int(os.environ.get("TRIALS", "3"))):
    i = 0
    while hvd.allreduce_(torch.IntTensor([int(hvd.is_initialized())]), None, f'is_init{trial}.{i}', hvd.Sum) != hvd.size():
        i += 1
    t_ret = time.time()
    if hvd.rank() == 0:
        time.sleep(float(os.environ.get("SLEEP", "1")))
    hvd.barrier()
    t_exit = time.time()
    print(f"PROBE trial={trial} rank={hvd.rank()} bt={t_exit-t_ret:.4f}", flush=True)
hvd.barrier()
hvd.shutdown()
