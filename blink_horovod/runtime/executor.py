"""The CPU executor: replays compiled programs over a transport, with numpy.

A :class:`~blink_horovod.schedule.program.Program` is the per-rank list of
``post``/``copy``/``reduce`` operations the schedule compiler derived from
Blink's trees (Blink, section 4: chunks pipelined over the spanning trees,
reductions on the receiving GPU).  This executor runs one rank's list in
order, which the program's step rule makes deadlock-free, on the buffers the
transport shares: ``copy`` is a numpy slice assignment, ``reduce`` an in-place
ufunc (``np.add(dst, src, out=dst)``).

One *collective* here is

1. a metadata exchange among the server's ranks
   (:mod:`blink_horovod.runtime.metadata`): disagreement raises
   ``MismatchError`` on every rank before any byte moves.  A rank posts its
   metadata only after finishing its previous collective, so once every
   peer's is in, nobody reads any buffer of the previous one any more: the
   buffer-reuse rule of ``Program.readers()`` holds with no extra wait;
2. buffer growth if needed (:meth:`Transport.reserve`);
3. one or more *pieces* (a message larger than the buffers is cut into
   pieces): stage the input into the own buffer once, run the piece's program
   under a fresh epoch, post "done", copy the result out once.  Before staging
   piece k+1 a rank waits for the "done" of piece k from every rank that reads
   its buffer (``Program.readers()``).  An allreduce piece stages its input
   region by region *inside* the program instead, each just before a peer
   reads it and under a flag of its own (:func:`placement.interleave`), so
   the peer reads it from the cache rather than from memory; still after that
   wait, so the reuse rule is unchanged.

Any failure aborts the transport (peers raise the same error class, naming
this rank) and leaves the executor unusable, as an aborted NCCL communicator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BlinkInternalError
from ..schedule.program import Program
from . import metadata
from .dtypes import finish_average, numpy_dtype, reduce_to
from .faults import FaultInjector
from .placement import COPY, POST, STAGE, Placement, interleave, place, plain
from .steps import BLOCK_BYTES, STEP_COPY, STEP_POST, STEP_STAGE, Steps, fuse
from .streamcopy import Copier
from .transport import STATE_ABORTED, W_STATE, Transport, WaitContext

__all__ = ["Executor", "Piece", "Run"]

Run = tuple[int, int, int]  # (offset in the user's array, offset in the buffer, elements)

_PLACE = True  # direct placement; False only to measure what it saves
_FUSE = True  # fused steps (runtime.steps); False only to measure what they save
_INTERLEAVE = True  # allreduce inputs staged chunk by chunk (placement.interleave); False only to measure it


@dataclass
class Piece:
    """One program execution: which parts of the user's array go in and come out.

    Either ``direct`` is the offset in the user's array of a piece that maps
    the whole buffer contiguously (allreduce, broadcast): the executor then
    places values itself (:mod:`blink_horovod.runtime.placement`), told by
    ``has_input``/``wants_output`` whether this rank contributes an input and
    receives the result; or ``stage_in``/``stage_out`` list runs copied in
    before and out after the program (the hierarchical stages).  ``average``
    (direct allreduce pieces): the executor turns the sum into the average
    over that many ranks, where each region's sum is final (runtime.steps),
    or over the whole piece afterwards.
    """

    program: Program
    stage_in: Sequence[Run] = ()
    stage_out: Sequence[Run] = ()
    direct: int | None = None
    has_input: bool = True
    wants_output: bool = True
    average: int = 0  # > 0: the op is average over this many ranks: divide each final sum once


@dataclass
class _Lowered:
    program: Program
    placement: Placement
    steps: Steps
    readers: list[int]
    nflags: int


class Executor:
    """Executes collectives for rank ``transport.rank`` (one thread at a time).

    Parameters
    ----------
    transport : Transport
        The server's shared buffers and flags.
    timeout, stall : float
        ``BLINK_TIMEOUT_SECONDS`` and ``BLINK_STALL_CHECK_SECONDS``.
    fault : str, optional
        ``BLINK_FAULT`` (tests only).
    stream_copy : bool
        ``BLINK_STREAM_COPY``: large chunk copies use streaming stores
        (:mod:`blink_horovod.runtime.streamcopy`).
    """

    def __init__(self, transport: Transport, timeout: float, stall: float, fault: str | None = None,
                 stream_copy: bool = True) -> None:
        self.t = transport
        self.copier = Copier(stream_copy)
        self.rank = transport.rank
        self.nranks = transport.nranks
        self.timeout = timeout
        self.stall = stall
        self.seq = 0  # collectives started (metadata sequence)
        self.epoch = 0  # programs executed (flag values)
        self.failed: BaseException | None = None
        self._lowered: dict[int, _Lowered] = {}
        self._views: dict[str, list[np.ndarray]] = {}
        self.faults = FaultInjector.from_config(fault, self.rank, self._peer_failed)
        self.chunk_ops = 0
        # Timing of the last collective's data movement, for the chunk tuner: from
        # after buffer growth to the end; setup_free is False when it compiled a new
        # program or grew buffers (one-time costs that must not steer the tuner).
        self.last_run_seconds = 0.0
        self.last_setup_free = False

    # -- the collective --------------------------------------------------------
    def collective(self, label: str, checked: Mapping[str, Any], extras: Mapping[str, Any], arr: np.ndarray,
                   dtype: str, op: str, build: Callable[[list[dict[str, Any]]], Sequence[Piece]]) -> list[dict[str, Any]]:
        """Run one collective on the flat array ``arr`` (in place).

        ``build(extras_of_every_rank)`` returns the pieces once the ranks
        agree (so choices that depend on all ranks' measurements, such as the
        chunk size, are the same everywhere).  Returns every rank's extras.
        """
        with self._guarded(label) as ctx:
            self.seq += 1
            payloads = self.t.exchange_meta(self.seq, metadata.encode(checked, extras), ctx)
            all_extras = metadata.check_agreement(payloads, self.seq)
            known = len(self._lowered)
            pieces = list(build(all_extras))
            lowered = [self._lower(p) for p in pieces]
            fresh = len(self._lowered) != known
            itemsize = numpy_dtype(dtype).itemsize
            need_bytes = max((p.program.count for p in pieces), default=0) * itemsize
            need_flags = max((lw.nflags for lw in lowered), default=0)
            grew = self.t.reserve(need_bytes, need_flags, ctx)
            if grew:
                self._views.clear()
            started = time.perf_counter()
            copy = self.copier.copy
            views = self._typed_views(dtype)
            own = views[self.rank]
            prev: _Lowered | None = None
            for piece, lw in zip(pieces, lowered):
                self.epoch += 1
                if prev is not None and prev.readers:
                    self.t.wait_done(prev.readers, self.epoch - 1, ctx)
                pl = lw.placement
                if piece.direct is not None:
                    user = arr[piece.direct : piece.direct + lw.program.count]
                    for a, b in pl.stage_in:
                        copy(own[a:b], user[a:b])
                    stage_out, averaged = self._run(lw, views, user, dtype, op, ctx, piece.average)
                    self.t.post_done(self.epoch)
                    for a, b in stage_out:
                        copy(user[a:b], own[a:b])
                    if piece.average and not averaged:
                        finish_average(user, piece.average, dtype)
                else:
                    for a, b, n in piece.stage_in:
                        copy(own[b : b + n], arr[a : a + n])
                    self._run(lw, views, own, dtype, op, ctx)
                    self.t.post_done(self.epoch)
                    if piece.average:
                        raise BlinkInternalError("average is divided by the caller of the hierarchical stages")
                    for a, b, n in piece.stage_out:
                        copy(arr[a : a + n], own[b : b + n])
                prev = lw
            self.last_run_seconds = time.perf_counter() - started
            self.last_setup_free = not (grew or fresh)
            return all_extras

    def eager_collective(self, label: str, checked: Mapping[str, Any], extras: Mapping[str, Any], arr: np.ndarray,
                         dtype: str, op: str, kind: str, root: int = 0,
                         segments: Sequence[tuple[int, int]] = ()) -> list[dict[str, Any]]:
        """A small collective in one round: the data travel with the metadata.

        Each rank stages its input into its eager slot ``seq % 2`` *before*
        posting its metadata; once every rank's metadata is in (and agrees),
        every rank reads what it needs from every slot directly: one-hop
        trees, the paper's choice for small messages on fully connected
        machines (Blink, section 5: DGX-2).  Reductions run in rank order, so
        every rank computes bitwise the same result.  Two slots alternate, for
        the same reason as the metadata slots: a rank one collective ahead
        never writes the slot a slower peer still reads.

        ``kind``: ``allreduce``, ``broadcast`` (from ``root``),
        ``reduce_to_roots`` or ``broadcast_from_roots`` (``segments[r]``: rank
        r's element range).
        """
        with self._guarded(label) as ctx:
            self.seq += 1
            slot = self.seq & 1
            dt = numpy_dtype(dtype)
            n = arr.size

            def view(r: int) -> np.ndarray:
                return self.t.eager(r, slot)[: n * dt.itemsize].view(dt)

            me = self.rank
            own = view(me)
            if kind in ("allreduce", "reduce_to_roots") or (kind == "broadcast" and me == root):
                own[...] = arr
            elif kind == "broadcast_from_roots":
                lo, hi = segments[me]
                own[lo:hi] = arr[lo:hi]
            payloads = self.t.exchange_meta(self.seq, metadata.encode(checked, extras), ctx)
            all_extras = metadata.check_agreement(payloads, self.seq)
            if kind == "allreduce":
                arr[...] = view(0)
                for r in range(1, self.nranks):
                    reduce_to(arr, arr, view(r), op, dtype)
            elif kind == "broadcast":
                if me != root:
                    arr[...] = view(root)
            elif kind == "reduce_to_roots":
                lo, hi = segments[me]
                seg = arr[lo:hi]
                seg[...] = view(0)[lo:hi]
                for r in range(1, self.nranks):
                    reduce_to(seg, seg, view(r)[lo:hi], op, dtype)
            else:
                for r, (lo, hi) in enumerate(segments):
                    if r != me:
                        arr[lo:hi] = view(r)[lo:hi]
            self.last_setup_free = False
            return all_extras

    @contextmanager
    def _guarded(self, label: str) -> Iterator[WaitContext]:
        """One collective's waits (the yielded context); any failure in it aborts the transport
        and leaves this executor unusable."""
        if self.failed is not None:
            raise BlinkInternalError(f"{label}: this communicator is unusable after an earlier failure: {self.failed}")
        try:
            yield WaitContext.start(label, self.timeout, self.stall)
        except BaseException as exc:
            self.failed = exc
            self.t.abort(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        """Mark this rank failed and tell the peers (an error outside a collective's run)."""
        if self.failed is None:
            self.failed = exc
            self.t.abort(exc)

    def _typed_views(self, dtype: str) -> list[np.ndarray]:
        views = self._views.get(dtype)
        if views is None:
            dt = numpy_dtype(dtype)
            views = []
            for r in range(self.nranks):
                raw = self.t.data(r)
                views.append(raw[: raw.size - raw.size % dt.itemsize].view(dt))
            self._views[dtype] = views
        return views

    def _lower(self, piece: Piece) -> _Lowered:
        """This rank's ops with value placements, cached per program (host work O(ops))."""
        program = piece.program
        direct = piece.direct is not None and _PLACE
        mixed = direct and _INTERLEAVE and program.kind == "allreduce" and piece.has_input and piece.wants_output
        key = (id(program), direct, piece.has_input, piece.wants_output, mixed)
        cached = self._lowered.get(key)
        if cached is not None and cached.program is program:
            return cached
        if program.nranks != self.nranks:
            raise BlinkInternalError(f"program for {program.nranks} ranks run on {self.nranks} ranks")
        for o in program.ranks[self.rank]:
            if o.kind in ("copy", "reduce"):
                if not 0 <= o.peer < self.nranks or o.peer == self.rank:
                    raise BlinkInternalError(f"program op reads rank {o.peer} on rank {self.rank}")
            elif o.kind != "post":
                raise BlinkInternalError(f"program op kind {o.kind!r} unknown")
        nflags = max(program.nflags) if program.nflags else 0
        if direct:
            placement = place(program, self.rank, piece.has_input, piece.wants_output)
            if mixed:
                # Every rank of an allreduce decides alike (same program, same placements).
                every = [placement if r == self.rank else place(program, r, True, True) for r in range(self.nranks)]
                mixed_pl = interleave(program, self.rank, every)
                if mixed_pl is not None:
                    placement, nflags = mixed_pl
        else:
            placement = plain(program, self.rank, True, True)
        lw = _Lowered(program, placement, fuse(placement), sorted(program.readers()[self.rank]), nflags)
        if len(self._lowered) > 4096:
            self._lowered.clear()
        self._lowered[key] = lw
        return lw

    def _run(self, lw: _Lowered, views: list[np.ndarray], user: np.ndarray, dtype: str, op: str,
             ctx: WaitContext, average: int = 0) -> tuple[tuple[tuple[int, int], ...], bool]:
        """Execute the rank's ops; returns (regions to copy out of the shared buffer afterwards,
        whether the average was divided where each sum became final).

        Values live in the own shared buffer or in ``user`` as placed.  The
        fused steps (:mod:`blink_horovod.runtime.steps`) run unless a fault
        injector counts chunk operations one by one (BLINK_FAULT, tests).
        """
        if self.faults is not None or not _FUSE or (average and not lw.placement.direct):
            self._run_ops(lw.placement, views, user, dtype, op, ctx)
            return lw.placement.stage_out, False
        t, epoch = self.t, self.epoch
        copy, copy2 = self.copier.copy, self.copier.copy2
        where = (views[self.rank], user)  # indexed by SHARED (0) / USER (1)
        base = t.flag_base
        load = t.load
        block = max(1, BLOCK_BYTES // views[self.rank].itemsize)
        for s in lw.steps.steps:
            if s.kind == STEP_POST:
                t.store(base + s.flags[0], epoch)
                continue
            if s.kind == STEP_STAGE:
                copy(views[self.rank][s.start : s.stop], user[s.start : s.stop])
                continue
            for peer, flag in zip(s.peers, s.flags):
                if load(peer, base + flag) < epoch:
                    t.wait_words((peer,), base + flag, epoch, ctx, f"flag {flag}")
            start, stop = s.start, s.stop
            dst = where[s.dst_loc]
            if s.kind == STEP_COPY:
                src = views[s.peers[0]]
                if not s.dual:
                    copy(dst[start:stop], src[start:stop])
                else:
                    copy2(dst[start:stop], user[start:stop], src[start:stop])
            elif len(s.peers) == 1 and not s.dual:
                d = dst[start:stop]
                reduce_to(d, where[s.src_loc][start:stop], views[s.peers[0]][start:stop], op, dtype)
                if average and s.final:
                    finish_average(d, average, dtype)
            else:
                src = where[s.src_loc]
                first, rest = views[s.peers[0]], [views[p] for p in s.peers[1:]]
                for a in range(start, stop, block):
                    b = min(stop, a + block)
                    d = dst[a:b]
                    reduce_to(d, src[a:b], first[a:b], op, dtype)
                    for peer_view in rest:
                        reduce_to(d, d, peer_view[a:b], op, dtype)
                    if average and s.final:
                        finish_average(d, average, dtype)
                    if s.dual:
                        user[a:b] = d
            self.chunk_ops += s.ops
        return lw.steps.stage_out, True

    def _run_ops(self, pl: Placement, views: list[np.ndarray], user: np.ndarray, dtype: str, op: str,
                 ctx: WaitContext) -> None:
        """Execute the placed ops one by one (the unfused path)."""
        t, epoch, faults = self.t, self.epoch, self.faults
        copy = self.copier.copy
        where = (views[self.rank], user)  # indexed by SHARED (0) / USER (1)
        base = t.flag_base
        load = t.load
        for kind, peer, flag, start, stop, src_loc, dst_loc in pl.ops:
            if kind == POST:
                t.store(base + flag, epoch)
                continue
            if kind == STAGE:
                copy(views[self.rank][start:stop], user[start:stop])
                continue
            if load(peer, base + flag) < epoch:
                t.wait_words((peer,), base + flag, epoch, ctx, f"flag {flag}")
            if faults is not None:
                faults.before_op()
            dst = where[dst_loc][start:stop]
            if kind == COPY:
                copy(dst, views[peer][start:stop])
            else:
                reduce_to(dst, where[src_loc][start:stop], views[peer][start:stop], op, dtype)
            if faults is not None:
                faults.after_op(dst)
            self.chunk_ops += 1

    def _peer_failed(self) -> bool:
        try:
            return any(
                self.t.load(r, W_STATE) == STATE_ABORTED or not self.t.peer_alive(r)
                for r in range(self.nranks)
                if r != self.rank
            )
        except Exception:  # pragma: no cover
            return True

    def close(self) -> None:
        self.t.close()
        self._views.clear()
        self._lowered.clear()
