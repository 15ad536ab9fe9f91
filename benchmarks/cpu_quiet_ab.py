"""Interleaved A/B inside one job: blocks of 8 Blink 64 MB allreduces with BLINK_MPI_YIELD and
BLINK_BACKGROUND_IDLE switched on/off between blocks (the ops layer's Quiet), alternating order,
so that every mode sees the same machine; medians per mode on rank 0.

    blinkrun -np 4 -H localhost:4 [--gloo] python benchmarks/cpu_quiet_ab.py     (AB_ROUNDS=10, AB_BYTES)
"""
import os
import time

import horovod.torch as hvd
import numpy as np

hvd.init()
from blink_horovod.ops.quiet import Quiet, QuietCommunicator

from blink_horovod.config import load_config
from blink_horovod.runtime import rendezvous as rdv
from blink_horovod.runtime.communicator import Communicator

cfg = load_config()
comm = QuietCommunicator(Communicator(hvd.local_rank(), hvd.local_size(), None, rdv.from_horovod(hvd, cfg), cfg),
                         Quiet.of(cfg))
x = np.ones((int(os.environ.get("AB_BYTES", 64 << 20))) // 4, np.float32)
for _ in range(10): comm.allreduce(x)
modes = {"none": (False, False), "yield": (True, False), "yield+idle": (True, True), "idle": (False, True)}
res = {m: [] for m in modes}
for rnd in range(int(os.environ.get("AB_ROUNDS", 6))):
    for m, (y, i) in (modes.items() if rnd % 2 == 0 else reversed(list(modes.items()))):
        comm.quiet = Quiet(y, i)
        comm.barrier()
        t = time.perf_counter()
        for _ in range(8): comm.allreduce(x)
        res[m].append((time.perf_counter() - t) / 8 * 1e3)
if hvd.rank() == 0:
    for m, v in res.items():
        v = sorted(v)
        print(f"{m:11s} median {v[len(v)//2]:.1f} ms  min {v[0]:.1f}  all {' '.join(f'{a:.1f}' for a in res[m])}", flush=True)
comm.close()
