"""The transport seam: the one small interface the executor drives.

In the manner of httpx's ``BaseTransport``,
the executor never knows whether its peers are threads of this process
(:class:`~blink_horovod.runtime.loopback.LoopbackTransport`, for unit tests)
or processes of the server sharing POSIX memory
(:class:`~blink_horovod.runtime.shm.ShmTransport`).  Both present the pull
model of :mod:`blink_horovod.schedule.program`: each rank owns

* a data buffer every peer can read (:meth:`Transport.data`),
* 32-bit *words* only it writes: a control block (state, pid, metadata
  sequence, "done" epoch, ...) followed by the program's flags,
* two metadata slots and an abort-reason slot (bytes).

Implementations supply the thirteen abstract methods of :class:`Transport`:
words (load one, store-and-wake an own one, block until one changes), byte
regions (write an own one, read a peer's), peers (alive, pid), buffers (a
rank's data buffer and eager slots, their capacities, growing them all
together with :meth:`Transport.reserve`) and release.  Everything else is
written once here, above all the waiting loop :meth:`Transport.wait_words`: spin briefly, then sleep in slices;
after each slice check the peers (an aborted peer -> its error, re-raised
with its class; a dead or closed peer we wait for -> ``BlinkInternalError``
naming it); warn every ``BLINK_STALL_CHECK_SECONDS`` naming the ranks not yet
arrived (Horovod's stall inspector: "Missing ranks"); raise
``BlinkTimeoutError`` naming the rank waited on at the collective's deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

from ..errors import BlinkError, BlinkInternalError, BlinkTimeoutError, MismatchError

__all__ = [
    "EAGER_BYTES",
    "META_BYTES",
    "REASON_BYTES",
    "STATE_ABORTED",
    "STATE_CLOSED",
    "STATE_OPEN",
    "W_ABORT_KIND",
    "W_DATA_PAGES",
    "W_DONE",
    "W_GEN",
    "W_MAGIC",
    "W_MAPPED",
    "W_META_SEQ",
    "W_NFLAGS",
    "W_PID",
    "W_READY_GEN",
    "W_SLEEP",
    "W_SLEEP_SEEN",
    "W_STATE",
    "Transport",
    "WaitContext",
    "pid_alive",
    "sleep_token",
]

log = logging.getLogger("blink_horovod.runtime")

# -- the control block: word indices (uint32) --------------------------------
W_MAGIC = 0
W_GEN = 1  # generation of this segment (grows when buffers grow)
W_PID = 2
W_STATE = 3
W_META_SEQ = 4  # sequence number of the collective whose metadata is posted
W_META_LEN = 5  # 5, 6: byte length of metadata slot 0, 1
W_DONE = 7  # last epoch whose program this rank finished (all its reads done)
W_READY_GEN = 8  # this rank's segment of that generation exists
W_ABORT_KIND = 9  # 0: none; else index into _ERROR_KINDS
W_ABORT_LEN = 10
W_NFLAGS = 11  # flag words this segment holds
W_DATA_PAGES = 12  # data capacity in 4 KiB pages
W_SLEEP = 13  # sleep_token(rank, word) of the word this rank sleeps on, 0 when awake (wake-ups only when needed)
W_SLEEP_SEEN = 14  # the value of that word when the sleep began (written before W_SLEEP)
W_MAPPED = 16  # W_MAPPED + r: generation of rank r's segment this rank has mapped
CONTROL_WORDS = 16  # + nranks


def sleep_token(rank: int, word: int) -> int:
    """The W_SLEEP value of a sleep on ``rank``'s ``word`` (never 0, which means awake)."""
    return (rank + 1) << 24 | word


STATE_OPEN = 1
STATE_CLOSED = 2
STATE_ABORTED = 3

META_BYTES = 65536  # per slot: collective metadata, or a small allgather_object payload
REASON_BYTES = 2048
EAGER_BYTES = 64 << 10  # per slot: small messages travel with their metadata (executor.eager_collective)

MAGIC = 0xB1E4C0DE
_ERROR_KINDS: tuple[type[BlinkError], ...] = (BlinkError, BlinkInternalError, MismatchError, BlinkTimeoutError)

# Waiting: spin this many loads first (a peer on another core is often just
# about to post), then yield the CPU up to _YIELDS times (ranks may outnumber
# cores: a runnable peer then gets to post without a sleep/wake-up round trip,
# which costs far more, in a VM above all), then sleep on the word in slices
# of _SLICE seconds, after each of which the peers are checked for death,
# abort or close.
_SPIN = 64
_YIELDS = 32
_SLICE = 0.05


@dataclass
class WaitContext:
    """What a wait belongs to, for its messages and its deadline.

    ``label`` names the collective ("allreduce 'grad.w' (collective 12)");
    ``deadline`` is a ``time.monotonic()`` instant (the collective's start plus
    ``timeout``); ``stall`` is the period of the stall warnings.
    """

    label: str
    deadline: float
    timeout: float
    stall: float

    @classmethod
    def start(cls, label: str, timeout: float, stall: float) -> WaitContext:
        return cls(label, time.monotonic() + timeout, timeout, stall)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this host) is alive; a zombie counts as dead.

    A killed rank stays a zombie until its parent reaps it, and ``kill(pid, 0)``
    still succeeds on a zombie, so on Linux ``/proc/PID/stat`` is read as well.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            return False
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        return state not in (b"Z", b"X")
    return True


class Transport(ABC):
    """One rank's view of the server's shared buffers, flags and metadata slots."""

    rank: int
    nranks: int
    # Grows whenever :meth:`reserve` maps new segments (addresses from :meth:`native_layout` then move).
    generation: int = 0
    # Added to the ranks that messages name: in a job of several servers, the server's first global
    # rank, so that errors and warnings name ranks as Horovod numbers them (set by the Horovod layer).
    rank_offset: int = 0

    def __init__(self, rank: int, nranks: int) -> None:
        self.rank = rank
        self.nranks = nranks
        self.flag_base = CONTROL_WORDS + nranks
        self._closed = False

    # -- primitives (per implementation) ------------------------------------
    @abstractmethod
    def load(self, rank: int, word: int) -> int:
        """Current value of word ``word`` of rank ``rank``."""

    @abstractmethod
    def store(self, word: int, value: int) -> None:
        """Set an own word and wake whoever sleeps on it."""

    @abstractmethod
    def block(self, rank: int, word: int, seen: int, timeout: float) -> None:
        """Sleep until rank's word may differ from ``seen`` (or ``timeout`` s pass)."""

    @abstractmethod
    def write_region(self, region: str, data: bytes) -> None:
        """Write an own byte region: ``meta0``, ``meta1`` or ``reason``."""

    @abstractmethod
    def read_region(self, rank: int, region: str, length: int) -> bytes:
        """Read ``length`` bytes of a peer's byte region."""

    @abstractmethod
    def peer_alive(self, rank: int) -> bool:
        """Whether rank's process (thread, for loopback) still runs."""

    @abstractmethod
    def peer_pid(self, rank: int) -> int:
        """Process id of rank (for messages)."""

    @abstractmethod
    def data(self, rank: int) -> np.ndarray:
        """Rank's data buffer as uint8 (own: writable; peers: read them only)."""

    @abstractmethod
    def eager(self, rank: int, slot: int) -> np.ndarray:
        """Rank's eager slot 0 or 1 (``EAGER_BYTES``, uint8): a small message's data."""

    @abstractmethod
    def data_capacity(self) -> int:
        """Bytes of every rank's data buffer (the same on all ranks)."""

    @abstractmethod
    def flag_capacity(self) -> int:
        """Program flags every rank's segment holds."""

    @abstractmethod
    def reserve(self, data_bytes: int, nflags: int, ctx: WaitContext) -> bool:
        """Collective: make every buffer hold ``data_bytes`` and ``nflags`` flags.

        Every rank calls it at the same point with the same arguments.  Returns
        True when the buffers were replaced (views of the old ones are stale).
        """

    @abstractmethod
    def _release(self) -> None:
        """Free this rank's resources (called once, by :meth:`close`)."""

    # -- what the executor uses ---------------------------------------------
    def post(self, flag: int, epoch: int) -> None:
        """``flags[flag] = epoch``: the ops this post covers are done."""
        self.store(self.flag_base + flag, epoch)

    def wait_flag(self, peer: int, flag: int, epoch: int, ctx: WaitContext) -> None:
        """Wait until ``flags_peer[flag] >= epoch``."""
        word = self.flag_base + flag
        if self.load(peer, word) >= epoch:  # the common case: no call below
            return
        self.wait_words((peer,), word, epoch, ctx, f"flag {flag}")

    def post_done(self, epoch: int) -> None:
        self.store(W_DONE, epoch)

    def wait_done(self, peers: Sequence[int], epoch: int, ctx: WaitContext) -> None:
        """Wait until every peer finished reading for ``epoch`` (buffer reuse)."""
        self.wait_words(peers, W_DONE, epoch, ctx, "done")

    def exchange_meta(self, seq: int, payload: bytes, ctx: WaitContext) -> list[bytes]:
        """Post this rank's metadata of collective ``seq``; return every rank's.

        Two slots alternate, so a rank one collective ahead never overwrites a
        slot a peer may still read (it cannot be two ahead: collective seq+1
        needs every rank's metadata of seq+1, posted after it finished seq).
        """
        self.post_meta(seq, payload, ctx)
        return self.collect_meta(seq, payload, ctx)

    def post_meta(self, seq: int, payload: bytes, ctx: WaitContext) -> None:
        """The first half of :meth:`exchange_meta`: this rank's payload of collective ``seq``, posted.

        The GPU executor's native repeat (``runtime/gpu/_replay.c``) writes the same bytes and words in
        the same order."""
        if len(payload) > META_BYTES:
            raise BlinkInternalError(f"{ctx.label}: metadata of {len(payload)} bytes exceeds {META_BYTES}")
        slot = seq & 1
        self.write_region(f"meta{slot}", payload)
        self.store(W_META_LEN + slot, len(payload))
        self.store(W_META_SEQ, seq)

    def collect_meta(self, seq: int, payload: bytes, ctx: WaitContext) -> list[bytes]:
        """The second half of :meth:`exchange_meta`: wait for every peer's metadata of collective ``seq``
        (this rank's, ``payload``, already posted) and return every rank's."""
        slot = seq & 1
        peers = [r for r in range(self.nranks) if r != self.rank]
        self.wait_words(peers, W_META_SEQ, seq, ctx, "metadata")
        out = []
        for r in range(self.nranks):
            if r == self.rank:
                out.append(payload)
            else:
                out.append(self.read_region(r, f"meta{slot}", self.load(r, W_META_LEN + slot)))
        return out

    def native_layout(self) -> tuple[list[int], list[int]] | None:
        """Where native code finds every rank's control words and metadata slot 0, as mapped in this
        process: ``(words, meta)`` (addresses; slot 1 follows slot 0 at ``META_BYTES``), or None where the
        transport has no such memory (threads over the loopback).  The addresses hold until
        :attr:`generation` changes (:meth:`reserve` may map new segments)."""
        return None

    def abort(self, exc: BaseException) -> None:
        """Tell every peer this rank failed, with ``exc``'s message and class."""
        if self._closed or self.load(self.rank, W_STATE) == STATE_ABORTED:
            return
        kind = 0
        for i, cls in enumerate(_ERROR_KINDS):
            if isinstance(exc, cls):
                kind = i
        reason = str(exc).encode("utf-8", "replace")[:REASON_BYTES]
        try:
            self.write_region("reason", reason)
            self.store(W_ABORT_LEN, len(reason))
            self.store(W_ABORT_KIND, kind)
            self.store(W_STATE, STATE_ABORTED)
        except Exception:  # pragma: no cover - buffers already gone
            pass

    def close(self) -> None:
        """Say goodbye to the peers and free this rank's resources (idempotent)."""
        if self._closed:
            return
        try:
            if self.load(self.rank, W_STATE) == STATE_OPEN:
                self.store(W_STATE, STATE_CLOSED)
        except Exception:  # pragma: no cover
            pass
        self._closed = True
        self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the waiting loop ----------------------------------------------------
    def wait_words(self, peers: Sequence[int], word: int, value: int, ctx: WaitContext, what: str) -> None:
        """Wait until ``word`` of every rank in ``peers`` is >= ``value``.

        Raises BlinkTimeoutError at ``ctx.deadline`` naming the rank waited on,
        BlinkInternalError naming a dead or closed peer we wait for, and a
        failed peer's own error class with its message.
        """
        pending = [p for p in peers if self.load(p, word) < value]
        for _ in range(_SPIN):
            if not pending:
                return
            pending = [p for p in pending if self.load(p, word) < value]
        for _ in range(_YIELDS):
            if not pending:
                return
            os.sched_yield()
            pending = [p for p in pending if self.load(p, word) < value]
        if not pending:
            return
        started = time.monotonic()
        next_check = started + _SLICE
        next_warn = started + ctx.stall
        while pending:
            peer = pending[0]
            seen = self.load(peer, word)
            if seen >= value:
                pending.pop(0)
                continue
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(pending, ctx, what)
                next_check = now + _SLICE
            if now >= ctx.deadline:
                g = self.rank_offset
                raise BlinkTimeoutError(
                    f"{ctx.label}: rank {self.rank + g} timed out after {ctx.timeout:g} s waiting for rank {peer + g} "
                    f"({what}); ranks not arrived: {sorted(p + g for p in pending)}{self._wait_chain(peer)} "
                    f"(BLINK_TIMEOUT_SECONDS={ctx.timeout:g})"
                )
            if now >= next_warn:
                # Name the ranks at the ends of the wait chains, not the peers we
                # wait on directly: a peer that itself waits is not the one missing.
                g = self.rank_offset
                chains = [self._chain(p) for p in sorted(pending)]
                missing = sorted({c[-1] + g for c in chains})
                hops = "".join(self._describe_chain(c) for c in chains)
                log.warning(
                    "%s: rank %d has waited %.0f s for ranks %s (%s)%s. Missing ranks: %s",
                    ctx.label, self.rank + g, now - started, sorted(p + g for p in pending), what, hops,
                    ", ".join(map(str, missing)),
                )
                next_warn = now + ctx.stall
            self.block(peer, word, seen, max(1e-4, min(_SLICE, ctx.deadline - now, next_warn - now)))

    def _wait_chain(self, peer: int) -> str:
        """Describe the chain of waits that starts at ``peer`` (empty if ``peer`` waits on no one).

        A rank that times out often waits for a rank that itself waits for the
        one that stalled; whichever survivor times out first speaks for all, so
        its message names the rank at the end of the chain.
        """
        return self._describe_chain(self._chain(peer))

    def _chain(self, peer: int) -> list[int]:
        """Follow the peers' W_SLEEP words (who sleeps on whom) from ``peer`` to the rank that waits on no one.

        Sampled a few times per hop: a waiter is awake between its sleeps.
        """
        chain = [peer]
        for _ in range(self.nranks):
            nxt = -1
            for _sample in range(5):
                nxt = self._sleeps_on(chain[-1])
                if nxt >= 0:
                    break
                time.sleep(0.002)
            if nxt < 0 or nxt in chain or nxt == self.rank:
                break
            chain.append(nxt)
        return chain

    def _sleeps_on(self, rank: int) -> int:
        """The rank that ``rank`` sleeps waiting for, or -1.

        A token whose word has moved past the value the sleeper saw is stale:
        a frozen process (SIGSTOP) keeps the token of the sleep it was frozen
        in, but what it waited for has arrived, so it is the one stalled.
        """
        token = self.load(rank, W_SLEEP)
        if not token:
            return -1
        seen = self.load(rank, W_SLEEP_SEEN)
        target, word = (token >> 24) - 1, token & 0xFFFFFF  # sleep_token, inverted
        if self.load(rank, W_SLEEP) != token or not 0 <= target < self.nranks:
            return -1
        return target if self.load(target, word) == seen else -1

    def _describe_chain(self, chain: Sequence[int]) -> str:
        if len(chain) == 1:
            return ""
        g = self.rank_offset
        hops = "; ".join(f"rank {a + g} itself waits for rank {b + g}" for a, b in itertools.pairwise(chain))
        return f"; {hops}: rank {chain[-1] + g} is the one stalled"

    def check_peers(self, ctx: WaitContext, waiting_for: Sequence[int] = (), what: str = "") -> None:
        """Raise now if a peer has failed (called between collectives too), or if one of the ranks
        ``waiting_for`` (whose progress this rank waits for, ``what``) died or closed."""
        self._check_peers(waiting_for, ctx, what)

    def _check_peers(self, pending: Sequence[int], ctx: WaitContext, what: str) -> None:
        for r in range(self.nranks):
            if r != self.rank and self.load(r, W_STATE) == STATE_ABORTED:
                kind = self.load(r, W_ABORT_KIND)
                reason = self.read_region(r, "reason", self.load(r, W_ABORT_LEN)).decode("utf-8", "replace")
                cls = _ERROR_KINDS[kind] if 0 <= kind < len(_ERROR_KINDS) else BlinkInternalError
                if cls is BlinkError:
                    cls = BlinkInternalError
                if cls in (MismatchError, BlinkTimeoutError):
                    # The same failure everywhere: re-raise it under its own class.
                    raise cls(reason)
                raise BlinkInternalError(f"{ctx.label}: rank {r + self.rank_offset} failed: {reason}")
        for r in pending:
            state = self.load(r, W_STATE)
            if state == STATE_CLOSED:
                raise BlinkInternalError(
                    f"{ctx.label}: rank {r + self.rank_offset} closed its communicator while rank "
                    f"{self.rank + self.rank_offset} waits for it ({what}); "
                    "ranks must issue the same collectives in the same order"
                )
            if not self.peer_alive(r):
                raise BlinkInternalError(
                    f"{ctx.label}: rank {r + self.rank_offset} (pid {self.peer_pid(r)}) died; rank "
                    f"{self.rank + self.rank_offset} was waiting for it ({what})"
                )
