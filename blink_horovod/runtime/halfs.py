"""Fast reductions of 16-bit floats (float16, bfloat16) on CPU, in cache-sized blocks.

numpy's float16 arithmetic widens, operates and rounds one element at a time
(about 30 ns per element here), which would make a float16 allreduce slower
than the float32 one of twice the bytes.  The same arithmetic, vectorised:

* half -> float32: a 65536-entry table lookup (``np.take``; the table is
  numpy's own conversion of every bit pattern, so it is exact by
  construction); bfloat16 -> float32 is a 16-bit shift;
* the op in float32;
* float32 -> half with round-to-nearest-even from the bits (IEEE 754-2008,
  4.3.1): normal results add ``0x0FFF`` plus the lowest kept bit and drop 13
  bits; results below the smallest normal half are rounded by the FPU itself,
  by adding 0.5 (whose ulp, 2^-24, is the half subnormal step) and taking the
  low bits; overflow gives infinity, NaN a quiet NaN.

This is exactly numpy's sequence (widen to float32, operate, round once), so
results are bit-identical to ``np.add(a, b, out=a)`` on float16 arrays (NaN
payloads aside) and to ml_dtypes' bfloat16 ufuncs.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "f16_to_f32", "f32_to_f16", "reduce16", "scale16"]

BLOCK = 1 << 15  # elements per block: the float32 temporaries stay in L2

_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_U = np.uint32
_SIGN, _ABS = _U(0x80000000), _U(0x7FFFFFFF)
_MIN_NORMAL = _U(0x38800000)  # 2^-14, the smallest normal half, as float32 bits
_OVERFLOW = _U(0x47800000)  # 2^16: here and above (and NaN/inf) the half is inf or NaN
_INF32 = _U(0x7F800000)
_REBIAS = _U((127 - 15) << 23)
_HALF_BITS = _U(0x3F000000)  # 0.5f
_ROUND = _U((0x0FFF - ((127 - 15) << 23)) % (1 << 32))


def f16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 bit patterns (uint16) -> float32 values, exactly."""
    return np.take(_TABLE, bits, out=out)


def f32_to_f16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float32 -> float16 bit patterns (uint16) into ``out``, round to nearest even."""
    x = values.view(np.uint32)
    a = x & _ABS
    # Normal halves: rebias the exponent, round off 13 mantissa bits (ties to even).
    res = (a >> _U(13)) & _U(1)
    res += a
    res += _ROUND  # + 0x0FFF - rebias, modulo 2^32
    res >>= _U(13)
    small = a < _MIN_NORMAL
    if small.any():
        # Subnormal halves and zero: let the FPU round to a multiple of 2^-24.
        v = a[small].view(np.float32) + np.float32(0.5)
        res[small] = v.view(np.uint32) - _HALF_BITS
    big = a >= _OVERFLOW
    if big.any():
        res[big] = np.where(a[big] > _INF32, _U(0x7E00), _U(0x7C00))
    x = x >> _U(16)
    x &= _U(0x8000)
    res |= x
    out[...] = res
    return out


_UFUNC = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def _widen(bits: np.ndarray, kind: str, out: np.ndarray) -> np.ndarray:
    if kind == "float16":
        return np.take(_TABLE, bits, out=out)
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def _narrow(values: np.ndarray, kind: str, out: np.ndarray) -> None:
    if kind == "float16":
        f32_to_f16(values, out)
        return
    from .dtypes import f32_to_bf16

    out[...] = f32_to_bf16(values)


def reduce16(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: str, kind: str) -> None:
    """``out = op(a, b)`` for float16 (``kind="float16"``) or bfloat16 bit arrays (uint16 views)."""
    fn = _UFUNC[op]
    n = out.size
    blk = min(BLOCK, n)
    fa = np.empty(blk, np.float32)
    fb = np.empty(blk, np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        m = hi - lo
        x = _widen(a[lo:hi], kind, fa[:m])
        y = _widen(b[lo:hi], kind, fb[:m])
        fn(x, y, out=x)
        _narrow(x, kind, out[lo:hi])


def scale16(arr: np.ndarray, divisor: int, kind: str) -> None:
    """``arr /= divisor`` in place for 16-bit float bit arrays (the average's division)."""
    n = arr.size
    fa = np.empty(min(BLOCK, n), np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        x = _widen(arr[lo:hi], kind, fa[: hi - lo])
        np.divide(x, np.float32(divisor), out=x)
        _narrow(x, kind, arr[lo:hi])
