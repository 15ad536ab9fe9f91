"""Host cost of one GPU collective without a GPU: the executor's Python on the CPU emulation of CUDA.

``python benchmarks/gpu_host_cost.py`` runs 1 rank (no peers to wait for) on
tests/unit/gpu_emulator.py and prints the median wall time of the metadata part
and of the launch part of ``GpuExecutor.collective``, plus the Python calls per
collective at 1, 16 and 256 chunks per tree.  Emulated CUDA calls cost well
under a microsecond each; the real ones (eventQuery, graphLaunch, eventRecord)
add a few microseconds on the GPU machine, measured there by
tests/parallel/test_gpu_collectives.py and benchmarks/gpu_perf.py.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests", "unit"), os.path.join(HERE, "..", "tests", "parallel")]

import numpy as np
from gpu_emulator import EmuCuda, Heap
from gpu_rank import hand_plans

from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.executor import Piece
from blink_horovod.runtime.gpu.harness import GpuServer
from blink_horovod.runtime.loopback import LoopbackWorld
from blink_horovod.schedule import compile_program


def main() -> None:
    heap = Heap(16 << 20)
    cuda = EmuCuda(heap, inline=True)  # the device's work runs at synchronize, outside the timed calls
    srv = GpuServer(0, 1, "cost", [os.getpid()], planner=hand_plans(1), transport=LoopbackWorld(1).transport(0),
                    cuda=cuda)
    ex = srv.ex
    p = cuda.malloc(1 << 20)
    checked = {"collective": "allreduce", "name": "g", "dtype": "float32", "shape": [4096], "op": "sum", "root": None}
    # A 1-rank program has no ops; the host path is the same whatever the program (see the call counts).
    prog = compile_program(Plan("allreduce", "custom", (0,), None, (Tree(0, 1.0, ()),), 1.0, 1.0), 4096, 1024)
    pieces = [Piece(prog, direct=0)]
    for _ in range(5):
        ex.collective("g", checked, {}, p, "float32", "sum", lambda e: pieces)
    meta, launch, whole = [], [], []
    for _ in range(3000):
        cuda.synchronize()  # idle device: no wait for an argument slot inside the call
        t0 = time.perf_counter()
        ex.collective("g", checked, {}, p, "float32", "sum", lambda e: pieces)
        whole.append(time.perf_counter() - t0)
        meta.append(ex.last_meta_seconds)
        launch.append(ex.last_launch_seconds)
    print(f"1 rank, emulated CUDA: whole call {1e6 * np.median(whole):.1f} us = metadata {1e6 * np.median(meta):.1f} us"
          f" + launch {1e6 * np.median(launch):.1f} us (+ timing overhead)")
    prof = cProfile.Profile()
    for _ in range(100):
        cuda.synchronize()
        prof.enable()
        ex.collective("g", checked, {}, p, "float32", "sum", lambda e: pieces)
        prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values()) / 100
    print(f"Python calls per collective: {calls:.0f} (tests/unit/test_gpu_executor_emulated.py shows the count does "
          "not grow from 1 to 256 chunks per tree on 2 ranks)")
    srv.close()
    cuda.shutdown()


if __name__ == "__main__":
    main()
