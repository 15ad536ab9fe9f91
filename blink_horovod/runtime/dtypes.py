"""Element types and reduction operators of the CPU runtime (numpy, in place).

The ops are Horovod's (``hvd.Sum``, ``hvd.Average``, ``hvd.Min``, ``hvd.Max``,
``hvd.Product``); the dtypes are the ones Horovod accepts on CPU tensors.
Reductions run in place on the receiving rank's buffer, ``dst = op(dst, src)``
(``np.add(dst, src, out=dst)``), the CPU counterpart of the reduction kernels
Blink runs on the receiving GPU (Blink, section 4).

bfloat16 has no numpy type.  With ``ml_dtypes`` installed (it comes with
TensorFlow and JAX) it is a real numpy dtype whose ufuncs compute in float32
and round back to nearest-even.  Without it, bfloat16 arrays are ``uint16``
storage and :func:`reduce_into` does exactly that itself: widen to float32
(the top half of a float32 *is* a bfloat16), apply the op, round to nearest
even, keeping NaNs quiet.

``average`` reduces as ``sum`` and divides once at the end
(:func:`finish_average`): floats by true division (exact whenever the exact
quotient is representable), integers as Horovod's CPU ``ScaleBuffer`` does,
``trunc(x * (1.0 / n))`` in double precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ..errors import ConfigError

__all__ = [
    "DTYPES",
    "HAVE_ML_DTYPES",
    "NCCL_NAMES",
    "OPS",
    "bf16_to_f32",
    "canonical_dtype",
    "check_op",
    "dtype_name",
    "f32_to_bf16",
    "finish_average",
    "numpy_dtype",
    "reduce_into",
    "reduce_to",
]

try:  # a real bfloat16 numpy dtype, when available
    import ml_dtypes as _ml_dtypes

    _BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except Exception:  # pragma: no cover - depends on the environment
    _BFLOAT16 = None

HAVE_ML_DTYPES = _BFLOAT16 is not None

# Canonical names, in the order `blink perf --dtype all` runs them.
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16")
OPS = ("sum", "average", "min", "max", "product")
_OPS_EXACT = frozenset(OPS)

# nccl-tests spells types its own way (src/common.cu: test_typenames).
NCCL_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "half",
    "bfloat16": "bfloat16",
    "int32": "int32",
    "int64": "int64",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
}
_ALIASES = {v: k for k, v in NCCL_NAMES.items()} | {
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "bf16": "bfloat16",
    "int": "int32",
    "long": "int64",
}
_NUMPY = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
}


def canonical_dtype(name: str, field: str = "dtype") -> str:
    """``"half"`` -> ``"float16"``; an unknown name raises ConfigError naming ``field``."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ConfigError(f"{field}: unknown dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return key


@functools.cache  # (every CUDA collective asks for its itemsize: a dict lookup then)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that stores ``name`` (bfloat16 without ml_dtypes: uint16)."""
    name = canonical_dtype(name)
    if name == "bfloat16":
        return _BFLOAT16 if _BFLOAT16 is not None else np.dtype(np.uint16)
    return _NUMPY[name]


def dtype_name(dtype: np.dtype | type) -> str:
    """Canonical name of a numpy dtype; raises ConfigError for unsupported ones.

    ``uint16`` is *not* read as bfloat16 here (it would be silently summed as
    integers by others); bfloat16 arrives as ml_dtypes' type, or by name.
    """
    dt = np.dtype(dtype)
    if _BFLOAT16 is not None and dt == _BFLOAT16:
        return "bfloat16"
    for name, candidate in _NUMPY.items():
        if dt == candidate:
            return name
    raise ConfigError(f"dtype: {dt} is not supported (supported: {', '.join(DTYPES)})")


def check_op(op: str) -> str:
    if op in _OPS_EXACT:  # (every collective checks its op: the common spellings skip the normalising)
        return op
    key = str(op).strip().lower()
    if key == "avg":
        key = "average"
    if key == "prod":
        key = "product"
    if key not in OPS:
        raise ConfigError(f"op: unknown reduction {op!r} (expected one of {', '.join(OPS)})")
    return key


_UFUNC: dict[str, Callable] = {
    "sum": np.add,
    "average": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


_HALF_FAST = 256  # from this many elements on, 16-bit floats go through runtime.halfs
# numpy 2 widens and narrows float16 with vector instructions: its own float16 ufuncs then beat
# runtime.halfs (here, 64 MB: np.add 0.27 s; halfs 0.49 s, 0.96 s on zeros, whose subnormal path
# is slow), with the same bits (both widen to float32, operate, round to nearest even once).
_NATIVE_HALF = int(np.__version__.split(".")[0]) >= 2


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16)


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str, dtype: str) -> None:
    """``dst[...] = op(dst, src)`` in place (``op`` already canonical)."""
    reduce_to(dst, dst, src, op, dtype)


def reduce_to(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: str, dtype: str) -> None:
    """``out[...] = op(a, b)``; ``out`` may be ``a`` (in place) or a third array.

    bfloat16 without ml_dtypes, and float16 before numpy 2 (whose float16
    arithmetic is scalar), go through :mod:`blink_horovod.runtime.halfs`,
    bit-identical and faster there.
    """
    if dtype == "bfloat16" and out.dtype == np.uint16:
        from .halfs import reduce16

        reduce16(out, a, b, op, "bfloat16")
        return
    if dtype == "float16" and out.size >= _HALF_FAST and not _NATIVE_HALF:
        from .halfs import reduce16

        reduce16(_bits(out), _bits(a), _bits(b), op, "float16")
        return
    _UFUNC[op](a, b, out=out)


def finish_average(arr: np.ndarray, n: int, dtype: str) -> None:
    """Turn a sum over ``n`` ranks into their average, in place (see module docstring)."""
    if n == 1:
        return
    if dtype == "bfloat16" and arr.dtype == np.uint16:
        from .halfs import scale16

        scale16(arr, n, "bfloat16")
    elif dtype == "float16" and arr.size >= _HALF_FAST and not _NATIVE_HALF:
        from .halfs import scale16

        scale16(_bits(arr), n, "float16")
    elif arr.dtype.kind == "f" or dtype == "bfloat16":
        np.divide(arr, n, out=arr, casting="unsafe")
    else:
        # Horovod's CPU ScaleBuffer: value * (1.0 / n) in double, truncated on the way back
        # (one float64 temporary, operated on in place).
        tmp = np.multiply(arr, 1.0 / n, dtype=np.float64)
        np.trunc(tmp, out=tmp)
        np.copyto(arr, tmp, casting="unsafe")
