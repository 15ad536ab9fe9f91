"""The Blink engine: one background thread that runs this rank's collectives in submission order.

Horovod runs collectives on a background thread and hands out handles
(``allreduce_async`` -> ``poll`` / ``synchronize``); Blink does the same, so
async calls really overlap the caller (backward keeps running while buckets
reduce) and Horovod's handle API keeps its meaning.  Each *round* of the
thread (:mod:`.negotiation`) agrees with every other rank on what runs next,
then runs it:

- ``allreduce`` (one or several fused collectives): the hierarchical
  allreduce of :mod:`.hierarchical` on one flat buffer per dtype, with
  Horovod's scaling (:mod:`.scaling`);
- ``broadcast``: the two-stage broadcast;
- ``stock``: an operation Blink does not carry (allgather, alltoall,
  Adasum, ...), submitted to stock Horovod at its place in the order;
- ``barrier``: the round that decides it, then a barrier stage
  (:meth:`.hierarchical.Hierarchy.barrier`), as Horovod negotiates a barrier
  and then runs its BarrierOp, so that no rank leaves before every rank has
  seen the round;
- ``join``: the rank keeps taking part in rounds, contributing the reduction's
  identity, until every rank has joined (Horovod's ``hvd.join``).

Every wait is bounded by ``BLINK_TIMEOUT_SECONDS``.  A failure in a round
fails that round's collectives on every rank with a clear error; a failure
that may have left ranks out of step (a timeout, a dead peer) also marks the
engine broken, so later collectives fail at once instead of hanging -- as
Horovod does after a failed collective until it is re-initialised.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable, Sequence

import numpy as np

from .._stats import record
from ..errors import BlinkError, BlinkInternalError, BlinkTimeoutError, MismatchError
from ..runtime.dtypes import dtype_name, reduce_into
from .errors_bridge import as_horovod_error
from .fusion import FlatBuffer
from .hierarchical import Hierarchy
from .patching import bypass
from .negotiation import DTYPE_CODES, MAX_ENTRIES, Decision, Meta, Proposal, decide_global, decide_server, \
    digest, encode_failure, encode_summary, failure_of, stuck_message
from .scaling import average_postscale, needs_scaling, scale_into

__all__ = ["DeviceStages", "Engine", "Handle", "StockWaiter", "Work", "identity_value"]

log = logging.getLogger("blink_horovod.ops")

_POLL_SLICE = 0.002


class StockWaiter:
    """What a stock Horovod submission returns to the engine: ``poll()`` and ``wait(timeout)``."""

    def poll(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, timeout: float) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class Handle:
    """An in-flight collective: Horovod's async handle for Blink's path.

    Not callable and not an int, so Horovod code that tells handles apart
    (``callable(handle)`` for sparse allreduces) keeps working.
    """

    _ids = itertools.count(1)
    __slots__ = ("__weakref__", "_after", "_error", "_event", "_finish", "_stock", "_timeout", "_value", "id", "name")

    def __init__(self, name: str | None, timeout: float) -> None:
        self.id = next(Handle._ids)
        self.name = name
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._stock: StockWaiter | None = None
        self._finish: Callable[[Any], Any] | None = None
        self._timeout = timeout
        # Run by ``wait`` in the caller's thread once done: CUDA tensors make the caller's current
        # stream wait for the collective's device work (.torch_cuda), as Horovod's NCCL path does.
        self._after: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<blink Handle {self.id} {self.name or ''} {state}>"

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._event.set()

    def poll(self) -> bool:
        """True once ``wait`` would return without blocking."""
        if not self._event.is_set():
            return False
        if self._stock is not None and self._error is None:
            return self._stock.poll()
        return True

    def wait(self) -> Any:
        """Block until done (bounded by the timeout); return the result or raise Horovod's error class."""
        if not self._event.wait(self._timeout):
            raise as_horovod_error(BlinkTimeoutError(
                f"collective {self.name or self.id} did not complete within {self._timeout:.0f} s "
                f"(BLINK_TIMEOUT_SECONDS); some rank has not submitted it"))
        if self._error is not None:
            raise self._error
        if self._stock is not None:
            value = self._stock.wait(self._timeout)
            return self._finish(value) if self._finish else value
        if self._after is not None:
            self._after()
        return self._value


@dataclass
class Work:
    """One queued collective.

    ``arrays`` are the numpy views the collective writes in place (inputs
    already prescaled); ``finish`` turns the completed arrays into the
    caller's result (e.g. the output tensor).  For ``stock`` work, ``submit``
    hands the operation to stock Horovod and returns a :class:`StockWaiter`.
    Work on a GPU (``meta.device == "cuda"``) holds flat CUDA tensors in
    ``arrays``, their ``device`` and ``ready``, an event recorded on the
    caller's stream after the inputs were written; :class:`DeviceStages` runs it.
    """

    meta: Meta
    handle: Handle
    arrays: list[np.ndarray] = field(default_factory=list)
    finish: Callable[[], Any] | None = None
    submit: Callable[[], StockWaiter] | None = None
    stock_finish: Callable[[Any], Any] | None = None
    keepalive: Any = None
    join: bool = False
    name: str = ""
    entry: Any = None
    since: float = 0.0
    device: Any = None
    ready: Any = None

    @property
    def kind(self) -> str:
        return "join" if self.join else self.meta.kind

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays))


class DeviceStages(Protocol):
    """The data stages of collectives on a GPU (a framework adapter's: :mod:`.torch_cuda`)."""

    def allreduce(self, works: Sequence[Work], op: str, postscale: float, tag: str) -> None: ...
    def broadcast(self, works: Sequence[Work], root: int, tag: str) -> None: ...
    def serve(self, numel: Sequence[tuple[str, int]], op: str, tag: str) -> None: ...
    def close(self) -> None: ...


def identity_value(op: str, dtype: np.dtype) -> Any:
    """The element a joined rank contributes so that it changes nothing: 0, 1, +max or -max."""
    if op in ("sum", "average"):
        return 0
    if op == "product":
        return 1
    if dtype.kind == "f":
        return np.inf if op == "min" else -np.inf
    info = np.iinfo(dtype)
    return info.max if op == "min" else info.min


def _base_op(op: str) -> str:
    return "sum" if op == "average" else op


def _dtype_order(dt: np.dtype) -> int:
    name = "bfloat16" if dt.name == "bfloat16" else str(dt)
    return DTYPE_CODES.index(name) if name in DTYPE_CODES else len(DTYPE_CODES)


class Engine:
    """This rank's background collective thread.

    Parameters
    ----------
    rank, size:
        This rank and the job size (Average divides by ``size``, joined ranks included).
    server_index:
        This rank's server.
    hierarchy:
        Runs the data movement (:class:`.hierarchical.Hierarchy`).
    intra_allgather:
        Allgather of a Python object over the server's ranks (the runtime's shared metadata slots).
    cross_allgather:
        ``f(row, name) -> [num_servers, len(row)]`` over this rank's cross-server
        process set (None for single-server jobs).
    timeout:
        ``BLINK_TIMEOUT_SECONDS``: a collective not ready on every rank by then fails.
    fusion_bytes:
        At most this many bytes fused into one round (``HOROVOD_FUSION_THRESHOLD``; 0: no fusion).
    stall_seconds:
        ``BLINK_STALL_CHECK_SECONDS``: warn, naming the ranks not arrived, after this long.
    eager_bytes:
        ``BLINK_EAGER_BYTES``: in a single-server job, each rank's proposal carries the inputs of its
        queued CPU allreduces, up to this many bytes in all; a round that runs only such allreduces
        then reduces them from the proposals, with no data round after the agreement (0: never).
    """

    def __init__(self, rank: int, size: int, server_index: int, hierarchy: Hierarchy,
                 intra_allgather: Callable[[Any], list],
                 cross_allgather: Callable[[np.ndarray, str], np.ndarray] | None,
                 timeout: float, fusion_bytes: int, stall_seconds: float = 60.0, eager_bytes: int = 0) -> None:
        self.rank = rank
        self.size = size
        self.server_index = server_index
        self.hierarchy = hierarchy
        self.intra_allgather = intra_allgather
        self.cross_allgather = cross_allgather
        self.timeout = timeout
        self.fusion_bytes = fusion_bytes
        self.stall_seconds = stall_seconds
        # (the eager path needs every rank's proposal in one allgather: one server only)
        self.eager_bytes = eager_bytes if cross_allgather is None else 0
        self._proposals: list[Proposal] = []  # the last round's, as every rank of the server sent them
        self.eager_rounds = 0  # rounds whose allreduces were reduced from the proposals
        self._cond = threading.Condition()
        self._queue: collections.OrderedDict[str, Work] = collections.OrderedDict()
        self._counters: dict[str, int] = {}
        self._closed = False
        self._broken: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._round = 0
        self._joined = False
        self._join_round = -1
        self._join_work: Work | None = None
        self._want_meta: set[int] = set()  # digests of the names whose full metadata the next rounds carry
        self._stuck_asked = False  # a round asked every rank for its queued names (nothing ran for the timeout)
        self._running: set[str] = set()
        self._next_warn = 0.0
        self.last_round_seconds = 0.0
        self.devices: DeviceStages | None = None  # the GPU stages (set by an adapter that has them)
        # What status() reports to other servers' ranks (.peer_status): set by the engine thread only.
        self._state, self._state_since, self._last = "idle", time.monotonic(), None

    # -- submission (caller threads) -------------------------------------------------------

    def new_handle(self, name: str | None) -> Handle:
        return Handle(name, self.timeout + 30.0)

    def submit(self, work: Work) -> Handle:
        """Queue ``work``; raise ``ValueError`` if its name is already in flight (as Horovod)."""
        with self._cond:
            if self._broken is not None:
                raise as_horovod_error(BlinkInternalError(
                    f"Blink engine stopped after an earlier failure: {self._broken}"))
            if self._closed:
                raise as_horovod_error(BlinkInternalError("Horovod has been shut down (Blink engine closed)"))
            if work.join:
                if self._join_work is not None:
                    raise ValueError("join() called again before the previous join() returned")
                self._join_work = work
            else:
                name = work.meta.name
                kind = work.meta.stock_kind or work.meta.kind
                if name is None:
                    n = self._counters.get(kind, 0)
                    self._counters[kind] = n + 1
                    name = f"{kind}.noname.{n}"
                elif name in self._queue or name in self._running:
                    raise ValueError(
                        f"Requested to {work.meta.kind} a tensor with the same name as another tensor that is "
                        f"currently being processed.  If you want to request another tensor, use a different "
                        f"tensor name. (name {name!r})")
                work.name = name
                work.entry = work.meta.entry(name)
                work.since = time.monotonic()
                self._queue[name] = work
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="blink-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return work.handle

    def _set_state(self, state: str) -> None:
        self._state, self._state_since = state, time.monotonic()

    def status(self) -> dict[str, Any]:
        """This rank's progress, as other ranks ask it over :mod:`.peer_status`: the round, the state
        ("idle": in the caller's code, nothing queued; "negotiating"; "running"; "broken"; "closed"),
        seconds in it, the last collective completed, and the first queued names.

        Read without the engine's lock, from another thread: each field is one attribute read."""
        state = "broken" if self._broken is not None else "closed" if self._closed else self._state
        last = self._last  # the last completed Work (formatted here, off the engine's path)
        out: dict[str, Any] = {"rank": self.rank, "round": self._round, "state": state,
                               "since": round(time.monotonic() - self._state_since, 3),
                               "last": f"{last.meta.stock_kind or last.meta.kind} {last.name!r}" if last else "",
                               "queued": list(itertools.islice(list(self._queue), 4))}
        if self._broken is not None:
            out["error"] = str(self._broken)[:500]
        return out

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._joined and self._join_work is None

    # -- lifecycle -------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the round in progress; queued collectives fail with "shut down"."""
        with self._cond:
            self._closed = True
            pending = list(self._queue.values())
            self._queue.clear()
            if self._join_work is not None and not self._joined:
                pending.append(self._join_work)
                self._join_work = None
            self._cond.notify_all()
        for w in pending:
            self._fail([w], BlinkInternalError("Horovod has been shut down before this collective ran"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        with bypass():  # whatever this thread calls of Horovod is stock Horovod
            self._rounds()

    def _proposal(self) -> Proposal | None:
        """Wait for work, a join or closing; return this rank's proposal (None: closed)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if not self._queue and self._join_work is not None and not self._joined:
                    self._joined, self._join_round = True, self._round
                if self._joined or self._queue:
                    break
                if self._state != "idle":
                    self._set_state("idle")
                self._cond.wait(0.5)
            if self._joined:
                return Proposal(self.rank, joined=True, join_round=self._join_round)
            works = list(itertools.islice(self._queue.values(), MAX_ENTRIES))
            metas = tuple((w.name, w.meta) for w in works if self._want_meta and digest(w.name) in self._want_meta)
            overdue = self._stuck_asked or time.monotonic() - works[0].since > self.timeout
            return Proposal(self.rank, tuple(w.entry for w in works), metas=metas, overdue=overdue,
                            payloads=self._payloads(works))

    def _payloads(self, works: Sequence[Work]) -> tuple[tuple[str, tuple[np.ndarray, ...]], ...]:
        """Copies of the inputs of the queued CPU allreduces, oldest first, while they fit ``eager_bytes``."""
        out: list[tuple[str, tuple[np.ndarray, ...]]] = []
        left = self.eager_bytes
        for w in works:
            if left <= 0:
                break
            m = w.meta
            if m.kind != "allreduce" or m.device != "cpu" or m.process_set or w.nbytes > left:
                continue
            out.append((w.name, tuple(np.array(a, copy=True) for a in w.arrays)))
            left -= w.nbytes
        return tuple(out)

    def _rounds(self) -> None:
        delay = 0.0
        while True:
            proposal = self._proposal()
            if proposal is None:
                return
            t0 = time.perf_counter()
            self._set_state("negotiating")
            try:
                decision = self._negotiate(proposal)
            except BaseException as exc:  # a timeout or a dead peer: ranks may be out of step now
                self._break(exc)
                return
            self._round += 1
            self._set_state("running")
            if decision.action == "stuck" and not decision.stuck:
                self._stuck_asked = True
                continue
            if decision.action == "forget":
                self._want_meta.discard(decision.key)
                continue
            if decision.action == "wait" or (decision.action == "mismatch" and not decision.message
                                              and decision.key in self._want_meta):
                # nothing ready, or a mismatch whose details some server's ranks have not sent yet
                delay = min(max(delay * 2, 2e-4), 0.02)
                self._idle_wait(decision, delay)
                continue
            delay = 0.0
            try:
                self._execute(decision)
            except BaseException as exc:
                self._break(exc)
                return
            self.last_round_seconds = time.perf_counter() - t0

    def _idle_wait(self, decision: Decision, delay: float) -> None:
        """Nothing ready on every rank: back off (as Horovod's cycle time), warn, fail what timed out."""
        now = time.monotonic()
        missing = dict(decision.waiting)
        with self._cond:
            oldest = next(iter(self._queue.values()), None)
            # Past the timeout the next round is a "stuck" one, agreed by every rank (_on_stuck); this
            # rank fails its own collective alone only as a last resort, should the rounds not get there.
            if oldest is not None and now - oldest.since > 2 * self.timeout + 5:
                self._queue.pop(oldest.name, None)
                ranks = missing.get(oldest.name, ())
                self._cond.release()
                try:
                    self._fail([oldest], BlinkTimeoutError(
                        f"{oldest.meta.kind} {oldest.name!r}: not submitted by every rank within "
                        f"{self.timeout:g} s (BLINK_TIMEOUT_SECONDS); missing ranks: "
                        f"{list(ranks) or 'on another server'}"))
                finally:
                    self._cond.acquire()
            elif oldest is not None and now - oldest.since > self.stall_seconds and now > self._next_warn:
                self._next_warn = now + self.stall_seconds
                log.warning("blink: rank %d has waited %.0f s for %s %r. Missing ranks: %s", self.rank,
                            now - oldest.since, oldest.meta.kind, oldest.name,
                            ", ".join(map(str, missing.get(oldest.name, ()))) or "on another server")
            self._cond.wait(delay)

    def _negotiate(self, proposal: Proposal) -> Decision:
        name = f"blink.neg.{self._round}"
        try:
            proposals = self.intra_allgather(proposal)
        except BlinkError as found:
            err = found
            if proposal.entries:  # say which collective the ranks were agreeing on
                e = proposal.entries[0]
                err = type(found)(f"{e.kind} {e.name!r} (agreeing on it with the other ranks): {found}")
            if self.cross_allgather is not None:  # a server-mate is dead or stalled: tell the other servers
                self._tell_servers(encode_failure(type(err).__name__, str(err), self.rank), name)
            raise err from None
        self._proposals = proposals
        view = decide_server(proposals)
        summaries = None
        if self.cross_allgather is not None:
            summaries = self.cross_allgather(encode_summary(view), name)
            failed = failure_of(summaries)
            if failed is not None:  # another server's rank found its server-mate dead or stalled
                kind, message, _ = failed
                cls = {c.__name__: c for c in (BlinkTimeoutError, MismatchError)}.get(kind, BlinkInternalError)
                exc = cls(message)
                self._abort_intra(exc)  # the server-mates waiting on other servers learn it from here
                self._tell_servers(None, name)
                raise exc
        return decide_global(view, summaries, self.server_index, self.fusion_bytes)

    def _abort_intra(self, exc: BaseException) -> None:
        transport = getattr(self.hierarchy.intra, "transport", None)
        if transport is not None:
            transport.abort(exc)  # a no-op once closed

    def _tell_servers(self, row: np.ndarray | None, name: str) -> None:
        """Send this round's failure to the cross-server peers (``row``; None: it came from them), then
        meet them once more, so that none of them is still receiving it when this rank raises."""
        try:
            if row is not None:
                self.cross_allgather(row, name)  # type: ignore[misc]
            self.cross_allgather(np.zeros(1, np.int64), f"{name}.failed")  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the peers may be gone too: the error to raise is known already
            log.debug("blink: telling the other servers: %s", exc)

    def _take(self, names: Sequence[str]) -> list[Work]:
        with self._cond:
            works = [self._queue.pop(n) for n in names if n in self._queue]
            for w in works:
                self._running.add(w.name)
            return works

    def _execute(self, decision: Decision) -> None:
        if decision.action == "done_join":
            with self._cond:
                work, self._joined, self._join_work = self._join_work, False, None
            if work is not None:
                self._complete([work], decision.last_joined)
            return
        if decision.action == "mismatch":
            self._on_mismatch(decision)
            return
        if decision.action == "stuck":
            self._on_stuck(decision)
            return
        # "run"
        if self._joined:
            self._serve_joined(decision.head)
            return
        works = self._take(decision.names)
        if not works:
            return
        kind = works[0].meta.kind
        if decision.any_joined and kind in ("broadcast", "stock"):
            what = works[0].meta.stock_kind or kind
            self._fail(works, BlinkInternalError(
                f"{what} is not supported while ranks {list(decision.joined_ranks) or '(on another server)'} "
                f"have called join(); only allreduce is (as in Horovod)"))
            return
        t0 = time.perf_counter()
        try:
            if kind == "allreduce":
                self._run_allreduce(works)
            elif kind == "broadcast":
                self._run_broadcast(works)
            elif kind == "stock":
                self._run_stock(works)
                return
            elif kind == "barrier":
                self.hierarchy.barrier(f"blink.{self._round}.barrier")
        except BaseException as exc:
            self._fail(works, exc)
            raise
        seconds = time.perf_counter() - t0
        if kind in ("allreduce", "broadcast"):
            for i, w in enumerate(works):
                record(kind, w.nbytes, seconds if i == 0 else 0.0)
        self._complete(works, None)

    def _on_mismatch(self, decision: Decision) -> None:
        """Every rank has the same decision: ask for full metadata next round, or fail the collective."""
        if not decision.message:
            self._want_meta.add(decision.key)
            return
        self._want_meta.discard(decision.key)
        if decision.log:
            log.error("blink: rank %d: %s", self.rank, decision.log)
        self._settle()
        if self._joined:
            return
        if not decision.names:  # this server's ranks did not name it in the round: look it up by its digest
            with self._cond:
                decision.names = [n for n in self._queue if digest(n) == decision.key][:1]
        names = decision.names
        if names:
            self._fail(self._take(names[:1]), MismatchError(decision.message))

    def _on_stuck(self, decision: Decision) -> None:
        """Nothing ran for the timeout: every rank fails what it has queued, with the same message."""
        self._stuck_asked = False
        self._want_meta.clear()  # every queued collective fails: no request for metadata outlives it
        message, names_differ = stuck_message(dict(decision.stuck), self.timeout)
        self._settle()
        with self._cond:
            works = list(self._queue.values())
            self._queue.clear()
        self._fail(works, (MismatchError if names_differ else BlinkTimeoutError)(message))

    def _settle(self) -> None:
        """Every rank of the job has reached this round before any rank raises its error.

        A rank that raises may exit at once, and its exit shuts Horovod down under the ranks
        still exchanging this round's rows on other process sets ("Horovod has been shut
        down"), which would then fail with that instead of the error every rank was about
        to raise.  The server's ranks meet, then each meets its cross-server peers (so every
        rank of the job has got here), then the server's ranks meet again (so every rank's
        cross-server exchange is over before any rank of the server goes on).
        """
        if self.cross_allgather is None:
            return
        intra = self.hierarchy.intra
        if intra is not None:
            intra.barrier()
        self.cross_allgather(np.zeros(1, np.int64), f"blink.{self._round}.settle")
        if intra is not None:
            intra.barrier()

    # -- data stages ---------------------------------------------------------------------------

    def _groups(self, arrays: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        by: dict[np.dtype, list[np.ndarray]] = {}
        for a in arrays:
            by.setdefault(a.dtype, []).append(a)
        return [by[dt] for dt in sorted(by, key=_dtype_order)]

    def _device_stages(self, what: str) -> DeviceStages:
        if self.devices is None:
            raise BlinkInternalError(f"{what} of CUDA tensors reached Blink, but this framework adapter has no "
                                     "GPU stages")
        return self.devices

    def _run_allreduce(self, works: list[Work]) -> None:
        meta = works[0].meta
        op = _base_op(meta.op)
        post = meta.postscale
        if meta.op == "average":
            post = average_postscale(post, self.size)
        if meta.device != "cpu":
            self._device_stages("allreduce").allreduce(works, op, post, f"blink.{self._round}")
            return
        inputs = self._eager_inputs(works)
        if inputs is not None:
            self.eager_rounds += 1
            for i, w in enumerate(works):
                for j, a in enumerate(w.arrays):
                    self._reduce_eager(a, [rank_inputs[i][j] for rank_inputs in inputs], op, post)
            return
        arrays = [a for w in works for a in w.arrays]
        for gi, group in enumerate(self._groups(arrays)):
            buf = FlatBuffer(group)
            self.hierarchy.allreduce(buf.flat, op, f"blink.{self._round}.{gi}")
            if needs_scaling(post):
                scale_into(buf.flat, buf.flat, post)
            buf.copy_out()

    def _eager_inputs(self, works: Sequence[Work]) -> list[list[tuple[np.ndarray, ...]]] | None:
        """Every rank's inputs of ``works`` (rank by rank) where the round's proposals carried them all, else None.

        Every rank of the server sees the same proposals and the same decision, so all take the same path.
        """
        rows: list[list[tuple[np.ndarray, ...]]] = []
        for p in self._proposals:
            if p.joined or not p.payloads:
                return None
            carried = dict(p.payloads)
            row = [carried.get(w.name) for w in works]
            if any(r is None or len(r) != len(w.arrays) for r, w in zip(row, works)):
                return None
            rows.append(row)  # type: ignore[arg-type]
        return rows or None

    @staticmethod
    def _reduce_eager(out: np.ndarray, inputs: Sequence[np.ndarray], op: str, post: float) -> None:
        """``out`` becomes ``op`` over ``inputs`` (in rank order: the same bits on every rank), then scaled."""
        dtype = dtype_name(out.dtype)
        acc = np.array(inputs[0], copy=True).reshape(-1)
        for x in inputs[1:]:
            reduce_into(acc, x.reshape(-1), op, dtype)
        if needs_scaling(post):
            scale_into(acc, acc, post)
        out[...] = acc.reshape(out.shape)

    def _run_broadcast(self, works: list[Work]) -> None:
        root = works[0].meta.root
        if works[0].meta.device != "cpu":
            self._device_stages("broadcast").broadcast(works, root, f"blink.{self._round}")
            return
        arrays = [a for w in works for a in w.arrays]
        for gi, group in enumerate(self._groups(arrays)):
            buf = FlatBuffer(group, copy_in=(self.rank == root))
            self.hierarchy.broadcast(buf.flat, root, f"blink.{self._round}.{gi}")
            buf.copy_out()

    def _run_stock(self, works: list[Work]) -> None:
        for w in works:
            try:
                waiter = w.submit()
            except BaseException as exc:  # argument errors of stock Horovod keep their class (ValueError)
                self._release(w)
                w.handle._set(error=exc)
                continue
            w.handle._stock = waiter
            w.handle._finish = w.stock_finish
            self._release(w)
            w.handle._set()

    def _serve_joined(self, head) -> None:
        """A joined rank's part in a collective the others run: the reduction's identity (or the barrier stage)."""
        if head is not None and head.kind == "barrier":
            self.hierarchy.barrier(f"blink.{self._round}.barrier")
            return
        if head is None or head.kind != "allreduce":
            return
        op = _base_op(head.op)
        if head.device != "cpu":
            self._device_stages("allreduce").serve(head.numel, op, f"blink.{self._round}")
            return
        arrays = []
        for dt, n in head.numel:
            ndt = self._numpy_dtype(dt)
            arrays.append(np.full(n, identity_value(op, ndt), dtype=ndt))
        for gi, group in enumerate(self._groups(arrays)):
            buf = FlatBuffer(group)
            self.hierarchy.allreduce(buf.flat, op, f"blink.{self._round}.{gi}")

    @staticmethod
    def _numpy_dtype(name: str) -> np.dtype:
        if name == "bfloat16":
            import ml_dtypes  # noqa: PLC0415 - only when bfloat16 is used

            return np.dtype(ml_dtypes.bfloat16)
        if name == "bool":
            return np.dtype(np.uint8)
        return np.dtype(name)

    # -- completion --------------------------------------------------------------------------------

    def _release(self, w: Work) -> None:
        with self._cond:
            self._running.discard(w.name)

    def _complete(self, works: Sequence[Work], value: Any, nbytes: int = 0) -> None:
        if works:
            self._last = works[-1]
        for w in works:
            self._release(w)
            try:
                result = w.finish() if w.finish is not None else value
            except BaseException as exc:
                w.handle._set(error=as_horovod_error(exc))
                continue
            w.handle._set(result)

    def _fail(self, works: Sequence[Work], exc: BaseException) -> None:
        err = as_horovod_error(exc)
        for w in works:
            self._release(w)
            w.handle._set(error=err)

    def _break(self, exc: BaseException) -> None:
        log.error("blink: collective engine stopped: %s", exc)
        with self._cond:
            self._broken = exc
            pending = list(self._queue.values())
            self._queue.clear()
            if self._join_work is not None:
                pending.append(self._join_work)
                self._join_work = None
        self._fail(pending, exc)
