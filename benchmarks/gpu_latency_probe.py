"""Where the time of a small GPU allreduce goes: per call, host time of the metadata exchange and of the
launch; per op in a back-to-back loop; the device's own time of one collective (events around it,
host synchronised before); and the native call's phases (allocation check, post, wait, launch).  Both host paths of a repeat side by side: the native call
(``runtime/gpu/_replay.c``) and Python's.  Run under mpirun with BLINK_TOPOLOGY set:

    BLINK_TOPOLOGY=hgx-h200:0,1 mpirun -np 2 python benchmarks/gpu_latency_probe.py
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.rendezvous import FileRendezvous


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    path = world.bcast(f"/tmp/blink-probe-{os.getpid()}" if rank == 0 else None)
    rdv = FileRendezvous(path, rank, size)
    comm = Communicator(rank, size, None, rdv, device="cuda")
    ex = comm._executor
    out = {}
    # Both host paths of a repeat, side by side: one native call (runtime/gpu/_replay.c), and Python's.
    modes = ("native", "python") if ex.native_available else ("python",)
    for mode in modes:
        ex.use_native(mode == "native")
        for nbytes in (8, 1 << 20):
            x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
            for _ in range(20):
                comm.allreduce(x)
            comm.synchronize()
            host, meta, launch, phases = [], [], [], []
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(200):
                a = time.perf_counter()
                comm.allreduce(x)
                host.append(time.perf_counter() - a)
                meta.append(ex.last_meta_seconds)
                launch.append(ex.last_launch_seconds)
                c = ex.last_native  # the native call's own phases (ns); None after a Python repeat
                phases.append(c.phases_ns() if c is not None else (0, 0, 0, 0))
            comm.synchronize()
            loop = (time.perf_counter() - t0) / 200
            dev = []
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(50):
                comm.synchronize()
                comm.barrier()
                s.record()
                comm.allreduce(x)
                e.record()
                e.synchronize()
                dev.append(s.elapsed_time(e) / 1e3)
            med = lambda v: statistics.median(v) * 1e6
            out[mode, nbytes] = (loop * 1e6, med(host), med(meta), med(launch), med(dev),
                                 np.percentile(host, 90) * 1e6,
                                 *(statistics.median(p[i] for p in phases) / 1e3 for i in range(4)))
    rows = world.gather(out)
    if rank == 0:
        for mode in modes:
            for nbytes in (8, 1 << 20):
                print(f"{size} ranks, {nbytes} B, {mode}: per op in a loop / host per call / metadata / launch / "
                      f"device (events) / host p90 / native call's allocation check / post / wait for the peers "
                      f"and compare / launch, us, per rank (native: metadata is the whole native call):")
                for r, o in enumerate(rows):
                    print(f"  rank {r}:" + "".join(f" {v:7.1f}" for v in o[mode, nbytes]))
    comm.close()
    rdv.close()


if __name__ == "__main__":
    main()
