"""Horovod's exact scaling arithmetic for ``prescale_factor``, ``postscale_factor`` and Average.

Stock Horovod on CPU (``horovod/common/ops/gloo_operations.cc``,
``collective_operations.h: ScaleBufferCPUImpl``) computes an allreduce as::

    out = post * SUM_r(pre * x_r)        with post /= size for op == Average

where each scaling is ``output[i] = scale * input[i]`` with ``scale`` a
``float`` for float16/float32 buffers (float16 is widened to float32, scaled,
rounded back), a ``double`` for float64 and for every integer type (the
product is a double, truncated toward zero when stored).  Blink reproduces
that bit for bit, so that ``BLINK_ENABLE=1`` changes no result that Horovod's
own tests check exactly (they compare integers and small-rank floats with
tolerance 0).  Horovod has no int16 scaling; Blink scales int16 the same way
as the other integer types.
"""

from __future__ import annotations

import numpy as np

__all__ = ["average_postscale", "needs_scaling", "scale_into"]

_FLOAT32_SCALED = (np.dtype(np.float16), np.dtype(np.float32))


def needs_scaling(factor: float) -> bool:
    """True unless ``factor`` is exactly 1 (Horovod skips the pass then)."""
    return float(factor) != 1.0


def average_postscale(postscale_factor: float, size: int) -> float:
    """The postscale factor Horovod uses for ``op == Average`` over ``size`` ranks."""
    return float(postscale_factor) / float(size)


def scale_into(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``dst[...] = factor * src`` with Horovod's precision and rounding rules.

    ``dst`` and ``src`` may be the same array.  Integer results are truncated
    toward zero (C++ double-to-integer conversion); out-of-range values wrap
    as numpy's casts do.
    """
    dt = src.dtype
    if dt in _FLOAT32_SCALED:
        f = np.float32(factor)
        if dt == np.float16:
            np.copyto(dst, (src.astype(np.float32) * f).astype(np.float16))
        else:
            np.multiply(src, f, out=dst)
    elif dt == np.float64:
        np.multiply(src, np.float64(factor), out=dst)
    elif dt.kind in "iu":
        prod = src.astype(np.float64) * np.float64(factor)
        np.trunc(prod, out=prod)
        np.copyto(dst, prod.astype(dt), casting="unsafe")
    else:  # bfloat16 (ml_dtypes) and anything else float-like: float32 math
        np.copyto(dst, (src.astype(np.float32) * np.float32(factor)).astype(dt), casting="unsafe")
