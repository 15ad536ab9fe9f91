"""Data whose collective result is exactly predictable, for ``blink perf -c`` (as nccl-tests' ``verifiable``).

nccl-tests (``verifiable/verifiable.h``) fills each rank's buffer with values
derived from the rank and the element index such that the reduced result can
be computed independently, and counts elements that differ (``#wrong``).
Here every value is a small integer, so it is exact in every dtype, and
differs per rank:

* sum / average: ``v(r, i) = b(i) + d(r, i)`` where ``d`` sums to zero over
  the ranks (``+s`` on rank ``i mod n``, ``-s`` on rank ``(i+1) mod n``), so the
  sum is ``n*b(i)``, divisible by n; magnitudes are bounded so that every
  partial sum of every reduction order stays exactly representable
  (bfloat16: integers up to 256, float16: 2048, int8: 127, ...);
* min / max: a per-rank pattern; the expected value is the min / max over ranks;
* product: ``2`` on one rank per element, ``-1`` or ``1`` elsewhere, so every
  partial product is one of -2, -1, 1, 2;
* broadcast: the root's pattern; other ranks start from a different one.

The expected result is computed in int64, and averages with
:func:`~blink_horovod.runtime.dtypes.finish_average`, the runtime's (and
Horovod's) own arithmetic on the exact sum.
"""

from __future__ import annotations

import numpy as np

from .dtypes import HAVE_ML_DTYPES, f32_to_bf16, finish_average, numpy_dtype

__all__ = ["exact_limit", "make_input", "expected", "count_wrong", "to_float64"]

_LIMIT = {
    "float16": 2048,
    "bfloat16": 256,
    "float32": 1 << 24,
    "float64": 1 << 53,
    "int8": 127,
    "uint8": 255,
    "int16": 32767,
    "int32": (1 << 31) - 1,
    "int64": (1 << 53),
}
_SIGNED = {"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64"}


def exact_limit(dtype: str) -> int:
    """The largest integer magnitude up to which ``dtype`` holds every integer."""
    return _LIMIT[dtype]


def _pattern(i: np.ndarray, salt: int, lo: int, hi: int) -> np.ndarray:
    """Integers in [lo, hi], scrambled from the index (Knuth's multiplicative hash)."""
    span = hi - lo + 1
    return lo + ((i * 2654435761 + salt * 40503) % (1 << 32)) % span


def _params(dtype: str, n: int) -> tuple[int, int]:
    """(bmax, s): |n*b| + s within the exact range, at most 100 and 8."""
    limit = min(_LIMIT[dtype], 1 << 20)
    s = min(8, max(1, limit // (4 * n)))
    bmax = max(1, min(100, (limit - s) // n))
    return bmax, s


def _values(dtype: str, n: int, rank: int, count: int, op: str, collective: str, root: int) -> np.ndarray:
    i = np.arange(count, dtype=np.int64)
    signed = dtype in _SIGNED
    if collective == "broadcast":
        top = min(_LIMIT[dtype], 100)
        who = root if rank == root else rank + 1000
        return _pattern(i, who, -top if signed else 0, top)
    if op in ("sum", "average"):
        bmax, s = _params(dtype, n)
        b = _pattern(i, 7, -bmax if signed else s, bmax if bmax >= s or signed else s)
        d = np.where(i % n == rank, s, 0) - np.where((i + 1) % n == rank, s, 0) if n > 1 else np.zeros_like(i)
        return b + d
    if op in ("min", "max"):
        top = min(_LIMIT[dtype], 100)
        return _pattern(i, rank + 11, -top if signed else 0, top)
    # product
    v = np.ones(count, dtype=np.int64)
    if signed:
        v[((i * 7 + rank * 3) % 5) == 0] = -1
    v[(i % n) == rank] = 2
    return v


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16" and not HAVE_ML_DTYPES:
        return f32_to_bf16(values.astype(np.float32))
    if dtype == "bfloat16":
        return values.astype(np.float32).astype(numpy_dtype(dtype))
    return values.astype(numpy_dtype(dtype))


def make_input(dtype: str, n: int, rank: int, count: int, op: str = "sum", collective: str = "allreduce",
               root: int = 0) -> np.ndarray:
    """Rank ``rank``'s input of ``count`` elements (``n`` ranks in the reduction)."""
    return _cast(_values(dtype, n, rank, count, op, collective, root), dtype)


def expected(dtype: str, n: int, count: int, op: str = "sum", collective: str = "allreduce",
             root: int = 0) -> np.ndarray:
    """The exact result every rank must hold, as float64."""
    if collective == "broadcast":
        return _values(dtype, n, root, count, op, collective, root).astype(np.float64)
    xs = [_values(dtype, n, r, count, op, collective, root) for r in range(n)]
    if op in ("sum", "average"):
        total = np.sum(xs, axis=0)
        if op == "average":
            out = _cast(total, dtype)
            finish_average(out, n, dtype)
            return to_float64(out, dtype)
        return total.astype(np.float64)
    fn = {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    return fn.reduce(xs).astype(np.float64)


def to_float64(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16" and arr.dtype == np.uint16:
        from .dtypes import bf16_to_f32

        return bf16_to_f32(arr).astype(np.float64)
    return arr.astype(np.float64)


def count_wrong(result: np.ndarray, want: np.ndarray, dtype: str) -> int:
    """Elements of ``result`` that differ from ``want`` (NaN counts as wrong)."""
    got = to_float64(result.reshape(-1), dtype)
    return int(np.count_nonzero(~(got == want)))
