"""Name the ranks that have exited when an uncaught C++ exception aborts this process.

Under ``horovodrun --gloo`` a dead rank takes every other rank with it: Gloo's
connections to it close, and Horovod's background thread, which does not catch
what its controller throws, aborts its process ("terminate called after
throwing an instance of 'gloo::IoException'") before any Python code runs.
Blink cannot turn that into an exception, but it can make each rank's last line
say who died: ``_last_words.cc`` is a ``std::terminate`` handler that asks
every rank's status port (:mod:`blink_horovod.ops.peer_status`) whether it is
still there and prints, on stderr, the ranks whose port refuses connections,
before libstdc++'s own handler prints the exception and aborts.  Where another
terminate handler runs instead (a library that set its own after this one, or a
second copy of libstdc++ in the process), the process still ends in ``abort()``,
and a SIGABRT handler says the same line there.
"""

from __future__ import annotations

import ctypes
import logging
import socket
from collections.abc import Mapping, Sequence

from .. import cbuild

__all__ = ["install", "ipv4_of", "uninstall"]

log = logging.getLogger("blink_horovod.runtime")

PROBE_MS = 300   # how long the handler waits for the peers' ports to answer
LINGER_MS = 500  # how long it stays alive after speaking, so that ranks aborting later find it there


def ipv4_of(hosts: Sequence[str], cache: dict[str, str] | None = None) -> str:
    """The first IPv4 address that one of ``hosts`` resolves to ("" if none does)."""
    cache = {} if cache is None else cache
    for host in hosts:
        if host not in cache:
            try:
                cache[host] = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            except (OSError, IndexError):
                cache[host] = ""
        if cache[host]:
            return cache[host]
    return ""


def _library() -> ctypes.CDLL:
    lib = cbuild.load("last_words")
    lib.blink_last_words_install.restype = ctypes.c_int
    lib.blink_last_words_install.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
    lib.blink_last_words_uninstall.restype = ctypes.c_int
    lib.blink_last_words_uninstall.argtypes = []
    lib.blink_last_words_selftest.restype = None
    lib.blink_last_words_selftest.argtypes = [ctypes.c_char_p]
    lib.blink_last_words_selftest_replace.restype = None
    lib.blink_last_words_selftest_replace.argtypes = [ctypes.c_int]
    return lib


def install(rank: int, peers: Mapping[int, tuple[Sequence[str], int, int]], context: str = "") -> int:
    """Install the handler: ``peers`` maps each rank to ``(hosts, status port, pid)``.

    Returns how many peers it will ask (those with an IPv4 address); 0 where the handler could not
    be built (no C++ compiler), after one warning."""
    try:
        lib = _library()
    except (OSError, AttributeError) as exc:
        log.warning("blink: the handler that names dead ranks when Horovod aborts is not available: %s", exc)
        return 0
    cache: dict[str, str] = {}
    items = sorted(peers.items())
    n = len(items)
    ranks = (ctypes.c_int * n)(*[r for r, _ in items])
    pids = (ctypes.c_int * n)(*[int(pid) for _, (_, _, pid) in items])
    ports = (ctypes.c_int * n)(*[int(port) for _, (_, port, _) in items])
    addrs = (ctypes.c_char_p * n)(*[ipv4_of(hosts, cache).encode() for _, (hosts, _, _) in items])
    return int(lib.blink_last_words_install(rank, n, ranks, pids, addrs, ports, PROBE_MS, LINGER_MS,
                                            context.encode()))


def uninstall() -> bool:
    """Put back the terminate handler that was there before :func:`install` (at ``hvd.shutdown``: the
    ranks it would ask about are gone by design).  True if ours was installed."""
    try:
        lib = _library()
    except (OSError, AttributeError):
        return False
    return bool(lib.blink_last_words_uninstall())
