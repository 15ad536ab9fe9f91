"""Load: 1000 back-to-back allreduces of mixed sizes, dtypes and ops on 4 ranks, memory flat.

Reliability requirement (Load): "1000 back-to-back allreduces of mixed sizes and dtypes on 4
ranks without error, memory flat (RSS growth < 5%)".  Every result is checked
exactly (integer-valued data whose reductions are exactly representable in
every dtype, as nccl-tests' ``-c``), so "without error" also means "without a
wrong element".  RSS (``/proc/self/statm``) is taken once the job reached its
steady state (buffers grown to the largest size, chunk sizes and program
cache settled: after the warm-up iterations) and every 100 iterations to the
end, after ``gc.collect()`` and glibc's ``malloc_trim(0)``, so that it counts
memory in use rather than freed heap memory malloc keeps cached (which makes
raw RSS swing by a few percent with the last message sizes, and back).
"""

from __future__ import annotations

import pytest

from conftest import error_of

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("blink_horovod.runtime.communicator", reason="the CPU runtime is not in this checkout yet")

N = 4
ITERATIONS = 1000
WARMUP = 200
MAX_GROWTH = 0.05

LOAD = """
import numpy as np

def body():
    from blink_horovod.runtime.dtypes import numpy_dtype
    try:
        import ml_dtypes  # noqa: F401  bfloat16 as a numpy dtype
        dtypes = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
    except ImportError:
        dtypes = ["float16", "float32", "float64", "int32", "int64"]
    sizes = [1, 7, 255, 4097, 65536, 100003, 1 << 19]
    comm = make_communicator()
    rng = np.random.default_rng(PARAMS["seed"])  # the same sequence on every rank
    pattern = {}
    rss, raw = {}, {}
    import ctypes, gc
    try:
        _trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        _trim = None
    checked = 0
    t0 = time.perf_counter()
    for i in range(PARAMS["iterations"]):
        dt = dtypes[int(rng.integers(len(dtypes)))]
        count = sizes[int(rng.integers(len(sizes)))]
        floating = dt.startswith(("float", "bfloat"))
        op = ["sum", "min", "max", "average"][int(rng.integers(4 if floating else 3))]
        npdt = numpy_dtype(dt)
        if count not in pattern:
            pattern[count] = np.arange(count, dtype=np.int64) % 5
        base = pattern[count]
        arr = (base + (RANK + 1)).astype(npdt)
        comm.allreduce(arr, op=op, name="load.%d" % i)
        if op == "sum":
            want = SIZE * base + SIZE * (SIZE + 1) // 2
        elif op == "min":
            want = base + 1
        elif op == "max":
            want = base + SIZE
        else:
            want = base + (SIZE + 1) / 2.0
        got = arr.astype(np.float64)
        wrong = int(np.count_nonzero(got != want))
        if wrong:
            raise AssertionError("iteration %d: %s %s of %d: %d wrong elements" % (i, op, dt, count, wrong))
        checked += count
        if (i + 1) % PARAMS["sample_every"] == 0:
            # This iteration's own arrays (up to 4 MiB each) are not the runtime's memory;
            # nor is heap memory already freed that malloc keeps cached (glibc raises its
            # mmap threshold after large frees, so freed numpy temporaries stay in the heap):
            # measure after returning it, so that what grows is memory still in use.
            del arr, got, want
            raw[i + 1] = rss_bytes()
            gc.collect()
            if _trim is not None:
                _trim(0)
            rss[i + 1] = rss_bytes()
        STATE["iterations"] = i + 1
    emit("load", rss=rss, raw=raw, seconds=time.perf_counter() - t0, elements=checked, dtypes=dtypes,
         chunks={str(k): v for k, v in comm.chunk_sizes().items()})

main(body)
"""


def test_1000_mixed_allreduces_on_4_ranks_exact_and_memory_flat(ranks, record) -> None:
    group = ranks.start(N, LOAD, params={"seed": 20240601, "iterations": ITERATIONS, "sample_every": 100},
                        timeout_seconds=60, limit=200)
    results = group.wait()
    loads = []
    for r in results:
        if r.returncode != 0:
            error_of(r)  # fails naming the error
            pytest.fail(f"rank {r.rank} exited {r.returncode}: {r.tail()}")
        loads.append(r.event("load"))
    growth, peak, raw_peak = [], [], []
    for ev in loads:
        rss = {int(k): v for k, v in ev["rss"].items()}
        raw = {int(k): v for k, v in ev["raw"].items()}
        growth.append((rss[ITERATIONS] - rss[WARMUP]) / rss[WARMUP])
        peak.append((max(v for k, v in rss.items() if k >= WARMUP) - rss[WARMUP]) / rss[WARMUP])
        raw_peak.append((max(v for k, v in raw.items() if k >= WARMUP) - raw[WARMUP]) / raw[WARMUP])
    seconds = max(ev["seconds"] for ev in loads)
    mib = [round({int(k): v for k, v in ev["rss"].items()}[WARMUP] / 2**20, 1) for ev in loads]
    record(
        case=f"{ITERATIONS} back-to-back allreduces on {N} ranks",
        fault="load",
        injected=f"mixed sizes (1 to 512 Ki elements), dtypes {', '.join(loads[0]['dtypes'])}, ops sum/min/max/average, "
                 "every result checked exactly",
        behaviour=(
            f"no error, 0 wrong elements ({loads[0]['elements']:,} checked per rank) in {seconds:.1f} s "
            f"({seconds / ITERATIONS * 1000:.1f} ms per allreduce); RSS after {WARMUP} warm-up iterations "
            f"{min(mib)}-{max(mib)} MiB, growth to the end {min(growth) * 100:+.2f}% .. {max(growth) * 100:+.2f}% "
            f"(bound {MAX_GROWTH * 100:g}%), largest of the samples every 100 iterations {max(peak) * 100:+.2f}% "
            f"(RSS after gc and malloc_trim; without the trim, freed heap memory malloc keeps makes RSS swing "
            f"up to {max(raw_peak) * 100:+.1f}% and back)"
        ),
        seconds=None,
        rss_growth=max(growth),
    )
    assert max(growth) < MAX_GROWTH and max(peak) < MAX_GROWTH, (growth, peak)
    assert max(raw_peak) < 4 * MAX_GROWTH, raw_peak  # malloc's caching stays bounded too
