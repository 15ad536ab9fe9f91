"""Interleaved A/B inside one Horovod job: blocks of 8 Blink 64 MB allreduces with the executor's
staging interleaved (runtime.placement.interleave) or all first, alternating order; medians of
wall and process CPU per allreduce, per rank.

    blinkrun -np 4 -H localhost:4 [--gloo] python benchmarks/cpu_stage_ab.py     (AB_ROUNDS=10, AB_BYTES)

AB_CHUNKS=262144,1048576: also alternate fixed chunk sizes in bytes (else MIAD's, as perf runs).
"""
import os, time, numpy as np
import horovod.torch as hvd
hvd.init()
from blink_horovod.runtime import rendezvous as rdv, executor as exm
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.config import load_config
cfg = load_config()
comm = Communicator(hvd.local_rank(), hvd.local_size(), None, rdv.from_horovod(hvd, cfg), cfg)
x = np.ones((int(os.environ.get("AB_BYTES", 64 << 20))) // 4, np.float32)
for _ in range(10): comm.allreduce(x)
chunks = [int(c) for c in os.environ.get("AB_CHUNKS", "").split(",") if c] or [None]
modes = [(i, c) for c in chunks for i in (True, False)]
res = {m: ([], []) for m in modes}
for rnd in range(int(os.environ.get("AB_ROUNDS", 10))):
    for m in (modes if rnd % 2 == 0 else modes[::-1]):
        exm._INTERLEAVE = m[0]
        if m[1]:
            comm._chunks.fixed = m[1]
        comm.barrier()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(8): comm.allreduce(x)
        res[m][0].append((time.perf_counter() - t) / 8e-3); res[m][1].append((time.process_time() - c) / 8e-3)
med = lambda v: sorted(v)[len(v) // 2]
line = "  ".join(f"{'interleaved' if m[0] else 'all first'}{' ' + str(m[1] >> 10) + 'K' if m[1] else ''}: wall {med(w):.1f} ms cpu {med(c):.1f} ms" for m, (w, c) in res.items())
print(f"rank {hvd.rank()} chunks {comm.chunk_sizes()}  {line}", flush=True)
comm.close()
