"""Per-thread CPU of a loop of Blink 64 MB allreduces with Horovod initialised.

    blinkrun -np 4 -H localhost:4 python benchmarks/cpu_thread_probe.py            # MPI controller here
    BLINK_MPI_YIELD=0 BLINK_BACKGROUND_IDLE=0 blinkrun ... benchmarks/cpu_thread_probe.py   # as Horovod leaves it

Prints per rank the wall and CPU time per allreduce and, per thread that used CPU, its CPU per
allreduce (``/proc/self/task``) and voluntary/involuntary context switches: Horovod's background
thread is the one started by ``hvd.init`` (listed as registered).  PROBE_MODE=yield|idle|nice set the
quieting by hand on every non-main thread (the experiments before the ops layer did it itself).
"""
import os
import threading
import time

import horovod.torch as hvd
import numpy as np

hvd.init()
from blink_horovod.ops.quiet import Quiet, QuietCommunicator

from blink_horovod.config import load_config
from blink_horovod.runtime import rendezvous as rdv
from blink_horovod.runtime.communicator import Communicator

cfg = load_config()
comm = Communicator(hvd.local_rank(), hvd.local_size(), None, rdv.from_horovod(hvd, cfg), cfg)
comm = QuietCommunicator(comm, Quiet.of(cfg))  # as the ops layer runs it
size = int(os.environ.get("PROBE_BYTES", 64 << 20))
x = np.ones(size // 4, np.float32)
def threads():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (open(f"/proc/self/task/{t}/comm").read().strip(), int(st[11]) + int(st[12]), int(st[7]) if False else 0)
        except OSError:
            pass
    return out
def ctxsw():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{t}/status").read()
            v = [int(l.split()[1]) for l in s.splitlines() if "ctxt_switches" in l]
            out[t] = v
        except OSError:
            pass
    return out
mode = os.environ.get("PROBE_MODE", "none")
import ctypes

if "yield" in mode:
    pal = ctypes.CDLL("libopen-pal.so.40")
    pal.opal_progress_set_yield_when_idle.argtypes = [ctypes.c_bool]
    print("old yield", pal.opal_progress_set_yield_when_idle(True))
if "idle" in mode:
    main = threading.get_native_id()
    for t in os.listdir("/proc/self/task"):
        if int(t) != main:
            os.sched_setscheduler(int(t), os.SCHED_IDLE, os.sched_param(0))
if "nice" in mode:
    main = threading.get_native_id()
    for t in os.listdir("/proc/self/task"):
        if int(t) != main:
            os.setpriority(os.PRIO_PROCESS, int(t), 19)
for _ in range(10):
    comm.allreduce(x)
comm.barrier()
n = int(os.environ.get("PROBE_ITERS", 50))
a, c0 = threads(), ctxsw()
t, p = time.perf_counter(), time.process_time()
for _ in range(n):
    comm.allreduce(x)
wall = (time.perf_counter() - t) / n * 1e3
cpu = (time.process_time() - p) / n * 1e3
b, c1 = threads(), ctxsw()
tick = os.sysconf("SC_CLK_TCK")
from blink_horovod.ops import background as _bg

lines = [f"registered {sorted(_bg.registered())} " + f"rank {hvd.rank()}: wall {wall:.1f} ms cpu {cpu:.1f} ms per allreduce"]
for tid in b:
    if tid in a and b[tid][1] - a[tid][1] > 0:
        d = (b[tid][1] - a[tid][1]) / tick / n * 1e3
        cs = [y - x for x, y in zip(c0.get(tid, [0, 0]), c1.get(tid, [0, 0]))]
        lines.append(f"   tid {tid} {b[tid][0]:16s} {d:.1f} ms/allreduce  vol/invol ctxsw {cs}")
print("\n".join(lines), flush=True)
comm.close()
