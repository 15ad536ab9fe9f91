"""The fluid engine's event loop compiled from C (``_fluid.c``), loaded through ctypes.

The C loop is the Python loop of :func:`blink_horovod.sim.engine.run`
transcribed: the same events in the same order, the same floating-point
operations (no fused multiply-add), so both give bit-identical results
(tests/unit/test_sim_native.py checks it on random graphs and on compiled
programs).  It is built once per machine with the system C compiler
(:mod:`blink_horovod.cbuild`); where no compiler is found or the build fails,
:func:`library` returns None and the engine runs the Python loop (one note in
the log says why).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess

from .. import cbuild

__all__ = ["library"]

_log = logging.getLogger("blink_horovod.sim")
_lib: ctypes.CDLL | None = None
_tried = False

_P = ctypes.c_void_p
_ARGTYPES = [
    ctypes.c_int32, _P, _P, _P,  # n, lat, nbytes, tail
    _P, _P,  # res_off, res_idx
    _P, _P,  # succ_off, succ_idx
    ctypes.c_int32, _P, _P, _P,  # nsig, wait_off, wait_idx, raises
    _P, ctypes.c_int32, _P, ctypes.c_double, ctypes.c_double,  # npred, ncap, cap, t0, eps_t
    _P, _P, _P,  # finish, finished, events_out
]


def library() -> ctypes.CDLL | None:
    """The compiled loop (built on first use, :mod:`blink_horovod.cbuild`), or None where it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        lib = cbuild.load("fluid")
        fn = lib.blink_fluid_run
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int64
        _lib = lib
    except (OSError, subprocess.SubprocessError) as exc:
        _log.info("simulator: C event loop unavailable (%s); using the Python loop", exc)
        _lib = None
    return _lib
