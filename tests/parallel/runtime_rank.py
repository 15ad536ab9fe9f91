"""One rank of a shared-memory runtime test, started as a subprocess by the tests of tests/parallel.

``python runtime_rank.py DIR RANK NRANKS SCENARIO [ARGS...]`` joins the
server through a :class:`FileRendezvous` in DIR, builds a real
:class:`Communicator` over ``/dev/shm`` (hand-made chain plans unless
``BLINK_TEST_PLANNER=real``), runs SCENARIO and prints one JSON line with its
result; an error prints ``{"error": class, "message": ...}`` and exits 3.
The tests start it with ``tests/`` on ``PYTHONPATH`` (for ``support``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from blink_horovod.config import load_config
from blink_horovod.runtime.communicator import Communicator
from blink_horovod.runtime.dtypes import DTYPES, numpy_dtype
from blink_horovod.runtime.rendezvous import FileRendezvous


def data(rank: int, count: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    vals = rng.integers(1 if dtype == "uint8" else -8, 9, count)
    if dtype == "bfloat16" and numpy_dtype(dtype) == np.uint16:
        from blink_horovod.runtime.dtypes import f32_to_bf16

        return f32_to_bf16(vals.astype(np.float32))
    return vals.astype(numpy_dtype(dtype))


def scenario(name: str, rank: int, n: int, comm: Communicator, args: list[str]) -> dict:
    out: dict = {"rank": rank}
    if name == "allreduce":
        count = int(args[0])
        dtypes = args[1].split(",") if len(args) > 1 else ["float32"]
        for dt in dtypes:
            x = data(rank, count, dt)
            comm.allreduce(x, "sum", name=f"t.{dt}")
            want = sum(data(r, count, dt).astype(np.float64) for r in range(n))
            out[dt] = int(np.count_nonzero(x.astype(np.float64) != want))
        return out
    if name == "loop":
        # Back-to-back collectives of mixed sizes and dtypes (buffer reuse, growth).
        iters = int(args[0])
        wrong = 0
        rng = np.random.default_rng(7)
        for i in range(iters):
            count = int(rng.integers(1, 200_000))
            dt = DTYPES[int(rng.integers(0, 4))]
            x = data(rank, count, dt, seed=i)
            if i % 3 == 2:
                root = i % n
                comm.broadcast(x, root)
                want = data(root, count, dt, seed=i).astype(np.float64)
            else:
                comm.allreduce(x)
                want = sum(data(r, count, dt, seed=i).astype(np.float64) for r in range(n))
            wrong += int(np.count_nonzero(x.astype(np.float64) != want))
        out["wrong"] = wrong
        return out
    if name == "mismatch":
        count = 4096 + (1 if rank == 1 else 0)
        comm.allreduce(np.ones(count, np.float32), name="grad.w")
        return out
    if name == "hang_after":
        # Allreduce K times, then (rank 0 only) sleep forever without closing.
        k = int(args[0])
        for _ in range(k):
            comm.allreduce(np.ones(1000, np.float32))
        if rank == int(args[1]):
            time.sleep(3600)
        comm.allreduce(np.ones(1000, np.float32))
        return out
    if name == "die_in_setup":
        return out
    if name == "big":
        count = int(args[0])
        x = np.full(count, rank + 1, np.float32)
        t0 = time.perf_counter()
        comm.allreduce(x)
        out["seconds"] = time.perf_counter() - t0
        out["wrong"] = int(np.count_nonzero(x != n * (n + 1) / 2))
        return out
    if name == "bench":
        count, iters = int(args[0]), int(args[1])
        x = np.full(count, rank + 1, np.float32)
        times, cpu = [], []
        for _ in range(iters):
            x[...] = rank + 1
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            comm.allreduce(x)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out["times"] = [round(t * 1e6) for t in times]
        out["cpu"] = [round(t * 1e6) for t in cpu]
        out["wrong"] = int(np.count_nonzero(x != n * (n + 1) / 2))
        return out
    raise SystemExit(f"unknown scenario {name}")


def main() -> int:
    directory, rank, n, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    args = sys.argv[5:]
    cfg = load_config()
    rdv = FileRendezvous(directory, rank, n, timeout=cfg.timeout_seconds)
    planner = None
    if os.environ.get("BLINK_TEST_PLANNER") != "real":
        from support.loopback import hand_planner

        planner = hand_planner(os.environ.get("BLINK_TEST_SHAPE", "chain"))
    comm = None
    if name == "die_in_setup" and rank == int(args[0]):
        # Crash inside the shared-memory setup, after creating the segment and
        # before the peers confirmed their mappings (its name is still linked).
        import signal

        from blink_horovod.runtime import shm

        def die(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)

        shm.ShmTransport._confirm_mapped = die
    try:
        print(json.dumps({"job": rdv.job_id, "rank": rank, "pid": os.getpid()}), flush=True)
        comm = Communicator(rank, n, None, rdv, cfg, planner=planner)
        if os.environ.get("BLINK_TEST_EAGER") == "0":
            comm.eager_bytes = 0
        result = scenario(name, rank, n, comm, args)
        print(json.dumps(result), flush=True)
        return 0
    except Exception as exc:
        print(json.dumps({"rank": rank, "error": type(exc).__name__, "message": str(exc),
                          "traceback": traceback.format_exc()}), flush=True)
        return 3
    finally:
        if comm is not None:
            comm.close()
        rdv.close()


if __name__ == "__main__":
    sys.exit(main())
