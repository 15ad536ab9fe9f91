"""Blocking waits on 32-bit words of a shared mapping: Linux futexes through ctypes.

Ranks of one server may outnumber its cores (CI runs 4 ranks on 2 cores), so a
rank waiting for a peer's flag must sleep in the kernel rather than spin.  A
futex (Franke, Russell, Kirkwood, "Fuss, Futexes and Furwocks", OLS 2002)
gives exactly that on a word of shared memory: ``FUTEX_WAIT(addr, seen,
timeout)`` sleeps only while ``*addr == seen`` (checked atomically by the
kernel, so no wake-up can be lost between our check and the sleep), and
``FUTEX_WAKE(addr)`` wakes the sleepers.  The futexes are *shared* (no
``FUTEX_PRIVATE_FLAG``): the kernel keys them on the backing file and offset,
so the same word mapped by different processes is one futex.

Where futexes are not available (not Linux, unknown architecture), waits
fall back to short sleeps, which is correct but slower.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import time

__all__ = ["HAVE_FUTEX", "futex_wait", "futex_wake", "word_address"]

# syscall numbers of futex(2); the generic table (aarch64, riscv64) uses 98.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "i686": 240, "i386": 240}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if not sys.platform.startswith("linux"):
        return None, None
    number = _SYS_FUTEX.get(platform.machine().lower())
    if number is None:
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None, None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return fn, number


_syscall, _NR = _load_syscall()
HAVE_FUTEX = _syscall is not None


def word_address(buffer, offset: int) -> int:
    """Address of the byte at ``offset`` of a writable buffer (an mmap).

    The ctypes view that yields it is dropped at once, so the buffer can still
    be closed later (a live export would make ``mmap.close`` fail).
    """
    view = ctypes.c_char.from_buffer(buffer, offset)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def futex_wait(address: int, seen: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``seen``, at most ``timeout`` s.

    Returns on a wake-up, a timeout, a signal or a changed word alike; the
    caller re-reads the word and decides (waits are always in a loop).
    """
    if timeout <= 0:
        return
    if not HAVE_FUTEX:
        time.sleep(min(timeout, 0.0005))
        return
    ts = _Timespec(int(timeout), int((timeout - int(timeout)) * 1e9))
    rc = _syscall(_NR, address, _FUTEX_WAIT, seen & 0xFFFFFFFF, ctypes.byref(ts), None, 0)
    if rc != 0:
        err = ctypes.get_errno()
        # EAGAIN: the word already changed; ETIMEDOUT, EINTR: the caller loops.
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):  # pragma: no cover
            raise OSError(err, f"futex wait failed: {os.strerror(err)}")


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    if HAVE_FUTEX:
        _syscall(_NR, address, _FUTEX_WAKE, _INT_MAX, None, None, 0)
