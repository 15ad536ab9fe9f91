"""CPU and wall time per Blink 64 MB allreduce, 4 ranks on the file rendezvous (no Horovod), and
one rank's execution steps (staging interleaved with the program).

    .venv/bin/python benchmarks/cpu_stage_probe.py [--dump] [--iters N] [--np 4] [--bytes 64M]

Prints per rank: median wall ms and CPU ms (process user+sys) per allreduce over blocks of 8.
STAGE_AB=1: alternate blocks with executor._INTERLEAVE on/off (same job A/B); STAGE_CHUNKS=262144,1048576:
also alternate fixed chunk sizes (bytes).
"""
import os, sys, time, tempfile, multiprocessing as mp
import numpy as np

def worker(rank, size, d, iters, nbytes, dump, ab, q):
    from blink_horovod.runtime import rendezvous as rdv, executor as exm
    from blink_horovod.runtime.communicator import Communicator
    comm = Communicator(rank, size, None, rdv.FileRendezvous(d, rank, size))
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(6): comm.allreduce(x)
    ex = comm._executor
    if dump and rank == 0:
        for key, lw in ex._lowered.items():
            print("key", key[1:], "nflags", lw.nflags)
            print("stage_in", lw.placement.stage_in, "stage_out", lw.steps.stage_out, "count", lw.program.count)
            for s in lw.steps.steps:
                print(" ", s)
    chunks = [int(c) for c in os.environ.get("STAGE_CHUNKS", "").split(",") if c] or [None]
    inter = [True, False] if ab else [getattr(exm, "_INTERLEAVE", None)]
    modes = [(i, c) for c in chunks for i in inter]
    res = {m: ([], []) for m in modes}
    for rnd in range(iters):
        for m in (modes if rnd % 2 == 0 else modes[::-1]):
            if ab: exm._INTERLEAVE = m[0]
            if m[1]: comm._chunks.fixed = m[1]
            comm.barrier() if hasattr(comm, "barrier") else None
            x[:] = 1
            t, c = time.perf_counter(), time.process_time()
            for _ in range(8): comm.allreduce(x)
            res[m][0].append((time.perf_counter() - t) / 8e-3); res[m][1].append((time.process_time() - c) / 8e-3)
            assert x[0] == size ** 8 and x[-1] == size ** 8, (x[0], x[-1])
    med = lambda v: sorted(v)[len(v) // 2]
    q.put((rank, {str(m): (med(w), med(c)) for m, (w, c) in res.items()}))
    comm.close()

if __name__ == "__main__":
    a = sys.argv
    size = int(a[a.index("--np") + 1]) if "--np" in a else 4
    iters = int(a[a.index("--iters") + 1]) if "--iters" in a else 6
    nbytes = 64 << 20
    d = tempfile.mkdtemp(prefix="blinkprobe")
    q = mp.get_context("fork").Queue()
    ps = [mp.get_context("fork").Process(target=worker, args=(r, size, d, iters, nbytes, "--dump" in a, os.environ.get("STAGE_AB") == "1", q)) for r in range(size)]
    for p in ps: p.start()
    out = sorted(q.get() for _ in ps)
    for p in ps: p.join()
    print(open("/proc/loadavg").read().strip())
    for r, v in out:
        print(r, "  ".join(f"{m}: wall {w:.1f} ms cpu {c:.1f} ms" for m, (w, c) in v.items()))
