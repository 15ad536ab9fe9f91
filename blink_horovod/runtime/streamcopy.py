"""Copies with streaming (non-temporal) stores for the CPU runtime, numpy where they are not available.

The CPU runtime is bound by memory bandwidth (docs/benchmarks.md: a 64 MB
allreduce over 4 ranks moves about 19 passes of 16 MB per rank).  A plain copy
reads each destination cache line before overwriting it, so copying N bytes
moves 3N over the memory bus; glibc's memcpy switches to streaming stores only
above ``x86_non_temporal_threshold`` (288 MB on this VM), far above Blink's
chunks.  Blink's large copies -- a rank's input staged into its shared segment,
a peer's chunk copied out, results written into the caller's tensor -- are read
next by another process or by the caller, after the writer's caches have moved
on, so they are written with streaming stores: 2N.  Measured here on 256 MB in
1 MB pieces: 17 GB/s with numpy, 24 GB/s streamed.

The stores come from ``_streamcopy.c``, compiled on first use with the system's
C compiler (:mod:`blink_horovod.cbuild`; ``make install`` builds it ahead).
Without a compiler, or with ``BLINK_STREAM_COPY=0``, every copy is numpy's;
the bytes are the same either way.  Copies smaller than
:data:`STREAM_MIN_BYTES` stay numpy's: there the destination is likely read
again soon from the cache, and the ~2 us of a foreign call would cost more
than the stores save.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading

import numpy as np

from .. import cbuild

__all__ = ["STREAM_MIN_BYTES", "Copier", "status"]

log = logging.getLogger(__name__)

# Measured here on 256 MB (DRAM, not cache): streamed copies beat numpy's from 64 KB pieces when the
# addresses are known; with two array-interface lookups per call (~2 us) from about 256 KB.
STREAM_MIN_BYTES = 256 << 10

_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None  # (library, how copies run and why)


def _load() -> tuple[ctypes.CDLL | None, str]:
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                lib = cbuild.load("streamcopy")
                for fn, nargs in ((lib.blink_copy, 2), (lib.blink_copy2, 3)):
                    fn.argtypes = [ctypes.c_void_p] * nargs + [ctypes.c_size_t]
                    fn.restype = None
                lib.blink_streaming.restype = ctypes.c_int
                how = "streaming stores" if lib.blink_streaming() else "memcpy (no streaming stores on this CPU)"
                _loaded = (lib, f"{how} ({lib._name})")
            except (OSError, subprocess.SubprocessError) as exc:
                _loaded = (None, f"numpy copies: the native copy is unavailable ({exc})")
                log.info("blink: %s", _loaded[1])
    return _loaded


def status() -> str:
    """One line: how the CPU runtime copies large chunks in this process, and why."""
    return _load()[1]


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Copier:
    """``copy(dst, src)``: ``dst[...] = src`` for equal-size C-contiguous arrays, streamed when large."""

    def __init__(self, enabled: bool = True) -> None:
        lib = _load()[0] if enabled else None
        self._copy = lib.blink_copy if lib is not None else None
        self._copy2 = lib.blink_copy2 if lib is not None else None

    @property
    def streaming(self) -> bool:
        return self._copy is not None

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = dst.nbytes
        if (self._copy is None or n < STREAM_MIN_BYTES or n != src.nbytes
                or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
            dst[...] = src
            return
        self._copy(_address(dst), _address(src), n)

    def copy2(self, dst1: np.ndarray, dst2: np.ndarray, src: np.ndarray) -> None:
        """``dst1[...] = dst2[...] = src``, reading ``src`` from memory once."""
        n = src.nbytes
        if (self._copy2 is None or n < STREAM_MIN_BYTES or not (dst1.nbytes == dst2.nbytes == n)
                or not (dst1.flags.c_contiguous and dst2.flags.c_contiguous and src.flags.c_contiguous)):
            dst1[...] = src
            dst2[...] = src
            return
        self._copy2(_address(dst1), _address(dst2), _address(src), n)
