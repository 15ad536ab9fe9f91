"""A repeated GPU collective's host path in one native call (``_replay.c``): post, meet, compare, launch.

:meth:`TreeExecutor.replay <.tree_executor.TreeExecutor.replay>` prepares one :class:`Call` per repeated
collective (its payload, what it expects of every peer, the kernel and its parameter block); each repeat
is then one ctypes call, which releases the GIL, checks that the tensor's allocation is the prepared one,
posts this rank's metadata exactly as
:meth:`Transport.post_meta <blink_horovod.runtime.transport.Transport.post_meta>` does, spins briefly
until every peer has posted, compares their bytes with the expected ones and launches the kernel.  What
it cannot finish (a late peer, other bytes) it hands back with the payload posted, and the executor goes
on in Python exactly as it would have (:meth:`Transport.collect_meta`: the waits that name dead, aborted
and late peers; the field-by-field check that raises a mismatch or follows a peer's moved tensor).

Only where the transport is shared memory (:meth:`Transport.native_layout`) and the device gives the
driver's entry points (``Cuda.launch_address``, ``Cuda.attribute_address``); elsewhere the executor stays
in Python.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..transport import META_BYTES, Transport
from .work import MAX_RANKS

__all__ = ["DIFFERENT", "LAUNCHED", "LAUNCH_FAILED", "MOVED", "NOT_MET", "Call", "NativeReplay", "PreparedCall", "load"]

log = logging.getLogger("blink_horovod.runtime")

LAUNCHED, NOT_MET, DIFFERENT, LAUNCH_FAILED, MOVED = 0, 1, 2, 3, 4

# How long the native call spins for the peers' posts before Python's wait (which sleeps) takes over:
# ranks in step post within microseconds of each other; a rank far behind is not worth a core.
SPIN_NS = 200_000
SPIN_NS_CROWDED = 20_000  # ranks may outnumber cores: a short spin that yields the CPU
YIELD_EVERY_CROWDED = 16


class Peers(ctypes.Structure):
    """``blink_peers``: every rank's control words and metadata slot 0 as mapped in this process."""

    _fields_ = [("rank", ctypes.c_int32), ("nranks", ctypes.c_int32), ("meta_bytes", ctypes.c_uint64),
                ("words", ctypes.c_void_p * MAX_RANKS), ("meta", ctypes.c_void_p * MAX_RANKS)]


class Call(ctypes.Structure):
    """``blink_replay_call``: a prepared repeat."""

    _fields_ = [("peers", ctypes.c_void_p), ("payload", ctypes.c_void_p), ("expected", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("lens", ctypes.c_void_p), ("launch", ctypes.c_void_p),
                ("attribute", ctypes.c_void_p), ("ptr", ctypes.c_uint64), ("bid", ctypes.c_uint64),
                ("function", ctypes.c_void_p), ("params", ctypes.c_void_p), ("epoch_slot", ctypes.c_void_p),
                ("spin_ns", ctypes.c_uint64), ("len", ctypes.c_uint32), ("yield_every", ctypes.c_uint32),
                ("grid", ctypes.c_uint32), ("block", ctypes.c_uint32), ("cuda_error", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("ns_check", ctypes.c_uint64), ("ns_post", ctypes.c_uint64),
                ("ns_met", ctypes.c_uint64), ("ns_launch", ctypes.c_uint64)]

    def phases_ns(self) -> tuple[int, int, int, int]:
        """The last call's phases in ns: the allocation check, the post, the wait for the peers and the
        comparison, the launch."""
        return self.ns_check, self.ns_post, self.ns_met, self.ns_launch


_LIB: Any = None
_FAILED = False


def load() -> Any:
    """The native library (built on first use by :mod:`blink_horovod.cbuild`), or None where it cannot be
    built or loaded (said once at debug level: the executor then stays in Python)."""
    global _LIB, _FAILED
    if _LIB is None and not _FAILED:
        try:
            from ... import cbuild

            lib = cbuild.load("replay")
        except Exception as exc:  # noqa: BLE001 - no compiler, read-only cache: the Python path
            _FAILED = True
            log.debug("native replay unavailable (%s): repeats stay in Python", exc)
            return None
        lib.blink_replay.restype = ctypes.c_int
        lib.blink_replay.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
        _LIB = lib
    return _LIB


class NativeReplay:
    """One rank's native repeats over ``transport`` (see the module docstring); ``launch`` is the address
    of ``cuLaunchKernel`` and ``attribute`` that of ``cuPointerGetAttribute`` (or of functions with their
    signatures)."""

    def __init__(self, lib: Any, transport: Transport, launch: int, attribute: int) -> None:
        self.lib, self.t, self.launch, self.attribute = lib, transport, launch, attribute
        self.generation = -1
        self.peers = Peers()
        crowded = (os.cpu_count() or 1) <= transport.nranks
        self.spin_ns = SPIN_NS_CROWDED if crowded else SPIN_NS
        self.yield_every = YIELD_EVERY_CROWDED if crowded else 0
        self._refresh()

    @classmethod
    def create(cls, transport: Transport, cuda: Any) -> NativeReplay | None:
        """A NativeReplay where the transport and the device allow one, else None."""
        if transport.native_layout() is None or transport.nranks > MAX_RANKS:
            return None
        launch, attribute = getattr(cuda, "launch_address", None), getattr(cuda, "attribute_address", None)
        if launch is None or attribute is None:
            return None
        lib = load()
        if lib is None:
            return None
        return cls(lib, transport, int(launch()), int(attribute()))

    def _refresh(self) -> None:
        """Point at the transport's current segments (every prepared call reads them through ``peers``)."""
        layout = self.t.native_layout()
        assert layout is not None
        words, meta = layout
        p = self.peers
        p.rank, p.nranks, p.meta_bytes = self.t.rank, self.t.nranks, META_BYTES
        for r in range(self.t.nranks):
            p.words[r], p.meta[r] = words[r], meta[r]
        self.generation = self.t.generation

    def prepare(self, payload: bytes, payloads: Sequence[bytes], function: int, grid: int, block: int,
                params: int, epoch_slot: int, ptr: int, bid: int) -> PreparedCall:
        """A repeat of a collective whose payload is ``payload`` and whose peers sent ``payloads``, on the
        tensor at ``ptr`` in the allocation whose buffer id is ``bid``."""
        return PreparedCall(self, payload, payloads, function, grid, block, params, epoch_slot, ptr, bid)

    def run(self, call: PreparedCall, seq: int, stream: int, epoch: int) -> int:
        """One repeat: LAUNCHED, MOVED (nothing posted), NOT_MET, DIFFERENT or LAUNCH_FAILED
        (``call.cuda_error``)."""
        if self.t.generation != self.generation:
            self._refresh()
        return int(self.lib.blink_replay(call.ref, seq, stream, epoch))


class PreparedCall:
    """A :class:`Call` and the buffers it points into (kept alive here)."""

    __slots__ = ("_expected", "_lens", "_offsets", "_payload", "call", "ref")

    def __init__(self, native: NativeReplay, payload: bytes, payloads: Sequence[bytes], function: int, grid: int,
                 block: int, params: int, epoch_slot: int, ptr: int, bid: int) -> None:
        n = len(payloads)
        self._payload = ctypes.create_string_buffer(payload, max(1, len(payload)))
        blob = b"".join(payloads)
        self._expected = ctypes.create_string_buffer(blob, max(1, len(blob)))
        offsets, pos = [], 0
        for b in payloads:
            offsets.append(pos)
            pos += len(b)
        self._offsets = (ctypes.c_uint32 * n)(*offsets)
        self._lens = (ctypes.c_uint32 * n)(*[len(b) for b in payloads])
        c = self.call = Call()
        c.peers = ctypes.addressof(native.peers)
        c.payload = ctypes.addressof(self._payload)
        c.expected = ctypes.addressof(self._expected)
        c.offsets, c.lens = ctypes.addressof(self._offsets), ctypes.addressof(self._lens)
        c.launch, c.function, c.params, c.epoch_slot = native.launch, function, params, epoch_slot
        c.attribute, c.ptr, c.bid = native.attribute, ptr, bid
        c.spin_ns, c.yield_every = native.spin_ns, native.yield_every
        c.len, c.grid, c.block = len(payload), grid, block
        self.ref = ctypes.addressof(c)

    @property
    def cuda_error(self) -> int:
        return int(self.call.cuda_error)
