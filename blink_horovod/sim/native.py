"""The fluid engine's event loop compiled from C (``_fluid.c``), loaded through ctypes.

The C loop is the Python loop of :func:`blink_horovod.sim.engine.run`
transcribed: the same events in the same order, the same floating-point
operations (no fused multiply-add), so both give bit-identical results
(tests/unit/test_sim_native.py checks it on random graphs and on compiled
programs).  It is built once per machine with the system C compiler into the
user's cache directory (``$XDG_CACHE_HOME/blink_horovod``, else
``~/.cache/blink_horovod``), keyed by the source's hash; where no compiler is
found or the build fails, :func:`library` returns None and the engine runs
the Python loop (one note in the log says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["library"]

_log = logging.getLogger("blink_horovod.sim")
_SOURCE = Path(__file__).with_name("_fluid.c")
_FLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_BUILD_TIMEOUT_S = 120
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


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blink_horovod"


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never load a partial file.
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], check=False, capture_output=True, text=True,
                              timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise OSError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The compiled loop (built on first use), or None where it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
        target = _cache_dir() / f"fluid-{digest}.so"
        if not target.exists():
            try:
                _build(target)
            except PermissionError:  # a read-only home: the temp directory instead
                target = Path(tempfile.gettempdir()) / f"blink_horovod-{os.getuid()}" / target.name
                if not target.exists():
                    _build(target)
        lib = ctypes.CDLL(str(target))
        fn = lib.blink_fluid_run
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int64
        _lib = lib
    except (OSError, subprocess.SubprocessError) as exc:
        _log.info("simulator: C event loop unavailable (%s); using the Python loop", exc)
        _lib = None
    return _lib
