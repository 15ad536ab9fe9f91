"""An in-process loopback transport: every rank is a thread of this process.

The unit tests drive the real executor through it (httpx's ``MockTransport``
idea): the buffers are numpy arrays, the words
are a numpy ``uint32`` array per rank, and sleeping is a
``threading.Condition`` shared by the ranks.  Semantics are exactly those of
the shared-memory transport, including growth, metadata slots and aborts.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..errors import BlinkInternalError
from .transport import (
    CONTROL_WORDS,
    EAGER_BYTES,
    MAGIC,
    META_BYTES,
    REASON_BYTES,
    STATE_OPEN,
    W_DATA_PAGES,
    W_GEN,
    W_MAGIC,
    W_NFLAGS,
    W_PID,
    W_READY_GEN,
    W_STATE,
    Transport,
    WaitContext,
)

__all__ = ["LoopbackTransport", "LoopbackWorld"]

_PAGE = 4096


class LoopbackWorld:
    """The shared state of ``nranks`` loopback ranks (create one per test)."""

    def __init__(self, nranks: int, data_bytes: int = 1 << 16, nflags: int = 64) -> None:
        self.nranks = nranks
        self.cond = threading.Condition()
        self.initial = (data_bytes, nflags)
        # (rank, gen) -> (words, data, regions)
        self.segments: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, dict[str, bytearray]]] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.lock = threading.Lock()

    def transport(self, rank: int) -> LoopbackTransport:
        """Rank ``rank``'s transport; call it from that rank's thread."""
        return LoopbackTransport(self, rank)


def _segment(nranks: int, data_bytes: int, nflags: int, gen: int) -> tuple[np.ndarray, np.ndarray, dict[str, bytearray]]:
    words = np.zeros(CONTROL_WORDS + nranks + nflags, dtype=np.uint32)
    words[W_MAGIC] = MAGIC
    words[W_GEN] = gen
    words[W_NFLAGS] = nflags
    words[W_DATA_PAGES] = data_bytes // _PAGE
    data = np.zeros(data_bytes, dtype=np.uint8)
    regions = {"meta0": bytearray(META_BYTES), "meta1": bytearray(META_BYTES), "reason": bytearray(REASON_BYTES),
               "eager0": np.zeros(EAGER_BYTES, np.uint8), "eager1": np.zeros(EAGER_BYTES, np.uint8)}
    return words, data, regions


class LoopbackTransport(Transport):
    """One thread-rank of a :class:`LoopbackWorld`."""

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        super().__init__(rank, world.nranks)
        self.world = world
        data_bytes, nflags = world.initial
        data_bytes = -(-data_bytes // _PAGE) * _PAGE
        seg = _segment(world.nranks, data_bytes, nflags, 0)
        seg[0][W_PID] = threading.get_ident() & 0xFFFFFFFF
        seg[0][W_STATE] = STATE_OPEN
        with world.cond:
            world.segments[(rank, 0)] = seg
            world.threads[rank] = threading.current_thread()
            world.cond.notify_all()
        self._gen = 0
        self._views: list | None = None
        self._await_gen(0, WaitContext.start("loopback setup", 30.0, 30.0))

    def _await_gen(self, gen: int, ctx: WaitContext) -> None:
        """Wait until every rank's segment of ``gen`` exists, then use them."""
        with self.world.cond:
            ok = self.world.cond.wait_for(
                lambda: all((r, gen) in self.world.segments for r in range(self.nranks)),
                timeout=max(0.0, ctx.deadline - time.monotonic()),
            )
            if not ok:
                missing = [r for r in range(self.nranks) if (r, gen) not in self.world.segments]
                raise BlinkInternalError(f"{ctx.label}: loopback ranks {missing} never created generation {gen}")
            self._segs = [self.world.segments[(r, gen)] for r in range(self.nranks)]
        self._gen = gen

    # -- primitives ------------------------------------------------------------
    def load(self, rank: int, word: int) -> int:
        return int(self._segs[rank][0][word])

    def store(self, word: int, value: int) -> None:
        with self.world.cond:
            self._segs[self.rank][0][word] = value
            self.world.cond.notify_all()

    def block(self, rank: int, word: int, seen: int, timeout: float) -> None:
        words = self._segs[rank][0]
        with self.world.cond:
            if int(words[word]) == seen:
                self.world.cond.wait(timeout)

    def write_region(self, region: str, data: bytes) -> None:
        self._segs[self.rank][2][region][: len(data)] = data

    def read_region(self, rank: int, region: str, length: int) -> bytes:
        return bytes(self._segs[rank][2][region][:length])

    def peer_alive(self, rank: int) -> bool:
        thread = self.world.threads.get(rank)
        return thread is not None and thread.is_alive()

    def peer_pid(self, rank: int) -> int:
        return int(self._segs[rank][0][W_PID])

    def data(self, rank: int) -> np.ndarray:
        return self._segs[rank][1]

    def eager(self, rank: int, slot: int) -> np.ndarray:
        return self._segs[rank][2][f"eager{slot}"]

    def data_capacity(self) -> int:
        return int(self._segs[self.rank][1].size)

    def flag_capacity(self) -> int:
        return int(self._segs[self.rank][0][W_NFLAGS])

    def reserve(self, data_bytes: int, nflags: int, ctx: WaitContext) -> bool:
        cap, fcap = self.data_capacity(), self.flag_capacity()
        if data_bytes <= cap and nflags <= fcap:
            return False
        new_cap = max(-(-data_bytes // _PAGE) * _PAGE, cap)
        new_fcap = max(nflags, fcap)
        gen = self._gen + 1
        old_words = self._segs[self.rank][0]
        words, data, regions = _segment(self.nranks, new_cap, new_fcap, gen)
        # Carry the control block over: epochs never go back.
        words[: self.flag_base] = old_words[: self.flag_base]
        words[W_GEN] = gen
        words[W_NFLAGS] = new_fcap
        words[W_DATA_PAGES] = new_cap // _PAGE
        words[self.flag_base : self.flag_base + fcap] = old_words[self.flag_base : self.flag_base + fcap]
        with self.world.cond:
            self.world.segments[(self.rank, gen)] = (words, data, regions)
            old_words[W_READY_GEN] = gen
            self.world.cond.notify_all()
        self._await_gen(gen, ctx)
        return True

    def _release(self) -> None:
        pass
