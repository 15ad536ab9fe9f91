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

The expected result is computed in int64 and cast to the dtype (exactly), averages with
:func:`~blink_horovod.runtime.dtypes.finish_average`, the runtime's (and
Horovod's) own arithmetic on the exact sum.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .dtypes import HAVE_ML_DTYPES, f32_to_bf16, finish_average, numpy_dtype

__all__ = ["count_wrong", "exact_limit", "expected", "make_input", "to_float64"]

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


_BLOCK = 1 << 18  # elements generated at a time: the uint32 temporaries stay in cache
_K = np.uint32(2654435761)
_IK = np.arange(_BLOCK, dtype=np.uint32) * _K  # i * K mod 2^32 for i in one block (wraps: uint32)


def _pattern(a: int, m: int, salt: int, lo: int, hi: int) -> np.ndarray:
    """Integers in [lo, hi] for indices ``a .. a+m-1``, scrambled from the index (Knuth's
    multiplicative hash): ``lo + ((i * 2654435761 + salt * 40503) mod 2^32) mod (hi - lo + 1)``.

    The product is formed modulo 2^32 in uint32 arithmetic (exact for i < 2^32): one add per
    element on a precomputed ``i * K``, and a modulo.
    """
    span = np.uint32(hi - lo + 1)
    h = _IK[:m] + np.uint32((a * 2654435761 + salt * 40503) % (1 << 32))
    h %= span
    out = h.view(np.int32)  # values below 2^31: the same numbers
    out += np.int32(lo)
    return out


def _params(dtype: str, n: int) -> tuple[int, int]:
    """(bmax, s): |n*b| + s within the exact range, at most 100 and 8."""
    limit = min(_LIMIT[dtype], 1 << 20)
    s = min(8, max(1, limit // (4 * n)))
    bmax = max(1, min(100, (limit - s) // n))
    return bmax, s


def _values(dtype: str, n: int, rank: int, a: int, m: int, op: str, collective: str, root: int) -> np.ndarray:
    """Rank ``rank``'s input at indices ``a .. a+m-1`` (int32): the module docstring's recipe."""
    signed = dtype in _SIGNED
    if collective == "broadcast":
        top = min(_LIMIT[dtype], 100)
        who = root if rank == root else rank + 1000
        return _pattern(a, m, who, -top if signed else 0, top)
    if op in ("sum", "average"):
        bmax, s = _params(dtype, n)
        v = _pattern(a, m, 7, -bmax if signed else s, bmax if bmax >= s or signed else s)
        if n > 1:
            v[(rank - a) % n :: n] += s  # i = rank (mod n)
            v[(rank - 1 - a) % n :: n] -= s  # i + 1 = rank (mod n)
        return v
    if op in ("min", "max"):
        top = min(_LIMIT[dtype], 100)
        return _pattern(a, m, rank + 11, -top if signed else 0, top)
    # product: -1 where i*7 + rank*3 = 0 (mod 5), i.e. i = rank (mod 5); 2 where i = rank (mod n)
    v = np.ones(m, dtype=np.int32)
    if signed:
        v[(rank - a) % 5 :: 5] = -1
    v[(rank - a) % n :: n] = 2
    return v


def _expected_block(dtype: str, n: int, a: int, m: int, op: str, collective: str, root: int) -> np.ndarray:
    """The exact result at indices ``a .. a+m-1`` (int32: every |value| is below 2^21; averages
    before the division)."""
    if collective == "broadcast":
        return _values(dtype, n, root, a, m, op, collective, root)
    if op in ("sum", "average"):
        # The perturbations sum to zero over the ranks: the sum is n * b(i).
        bmax, s = _params(dtype, n)
        signed = dtype in _SIGNED
        return np.int32(n) * _pattern(a, m, 7, -bmax if signed else s, bmax if bmax >= s or signed else s)
    fn = {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op]
    acc = _values(dtype, n, 0, a, m, op, collective, root)
    for r in range(1, n):
        fn(acc, _values(dtype, n, r, a, m, op, collective, root), out=acc)
    return acc


def _cast_into(out: np.ndarray, values: np.ndarray, dtype: str) -> None:
    if dtype == "bfloat16" and not HAVE_ML_DTYPES:
        out[...] = f32_to_bf16(values.astype(np.float32))
    elif dtype == "bfloat16":
        out[...] = values.astype(np.float32).astype(out.dtype)
    else:
        out[...] = values


def _fill(dtype: str, count: int, block: Callable[[int, int], np.ndarray]) -> np.ndarray:
    out = np.empty(count, numpy_dtype(dtype))
    for a in range(0, count, _BLOCK):
        m = min(_BLOCK, count - a)
        _cast_into(out[a : a + m], block(a, m), dtype)
    return out


def make_input(dtype: str, n: int, rank: int, count: int, op: str = "sum", collective: str = "allreduce",
               root: int = 0) -> np.ndarray:
    """Rank ``rank``'s input of ``count`` elements (``n`` ranks in the reduction)."""
    return _fill(dtype, count, lambda a, m: _values(dtype, n, rank, a, m, op, collective, root))


def expected(dtype: str, n: int, count: int, op: str = "sum", collective: str = "allreduce",
             root: int = 0) -> np.ndarray:
    """The exact result every rank must hold, in ``dtype`` (every value is exactly representable).

    Averages go through :func:`~blink_horovod.runtime.dtypes.finish_average`,
    the runtime's (and Horovod's) own arithmetic, on the exact sum.
    """
    out = _fill(dtype, count, lambda a, m: _expected_block(dtype, n, a, m, op, collective, root))
    if collective != "broadcast" and op == "average":
        finish_average(out, n, dtype)
    return out


def to_float64(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16" and arr.dtype == np.uint16:
        from .dtypes import bf16_to_f32

        return bf16_to_f32(arr).astype(np.float64)
    return arr.astype(np.float64)


def count_wrong(result: np.ndarray, want: np.ndarray, dtype: str) -> int:
    """Elements of ``result`` that differ from ``want`` (:func:`expected`); NaN counts as wrong.

    Compared by value, block by block (bfloat16 stored as uint16 through float32, so that
    ``-0 == +0`` as for every other float type).
    """
    got, want = result.reshape(-1), want.reshape(-1)
    if got.size != want.size:
        raise ValueError(f"count_wrong: result has {got.size} elements, expected {want.size}")
    bits = dtype == "bfloat16" and got.dtype == np.uint16
    wrong = 0
    for a in range(0, got.size, _BLOCK):
        x, y = got[a : a + _BLOCK], want[a : a + _BLOCK]
        if bits:
            from .dtypes import bf16_to_f32

            x, y = bf16_to_f32(x), bf16_to_f32(y)
        wrong += int(np.count_nonzero(x != y))  # NaN != NaN: wrong
    return wrong
