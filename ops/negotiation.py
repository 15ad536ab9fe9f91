"""The per-round agreement across ranks: which named collectives are ready everywhere, and do they match.

Stock Horovod's coordinator (``horovod/common/controller.cc``) collects, every
cycle, the names of the tensors each rank has submitted; a tensor runs once
every rank has submitted it, in the coordinator's order, and mismatched
shapes or types under one name become an error on every rank ("Mismatched
allreduce tensor shapes: One rank sent ..., but another rank sent ...").
Ranks may therefore submit in different orders.  Blink moves the data
itself, so its engine runs the same agreement before any byte moves
(docs/architecture.md, "Same order on every rank"), cheaply:

1. within the server, the ranks allgather their *proposals* -- the queued
   collectives as compact :class:`Entry` tuples (name, metadata digest,
   fusion class, bytes) -- over the runtime's shared metadata slots;
2. across servers (multi-server jobs), every rank allgathers its server's
   fixed-size summary (the entries ready on all of the server's ranks) with
   its cross-server peers, a Horovod process set;
3. every rank computes the same :class:`Decision`: the collectives ready on
   every rank, in the first active rank's order, fused while they share a
   fusion class (Horovod's tensor fusion, bounded by
   ``HOROVOD_FUSION_THRESHOLD``); or a mismatch, raised on every rank and
   naming the disagreeing ranks; or "nothing ready yet" (try again); or the
   end of ``join``.

Unnamed collectives are named ``<kind>.noname.<n>`` by a per-process
counter, as Horovod does, so the k-th unnamed allreduce of every rank meets
the k-th of the others.

``join`` (Horovod's ``hvd.join``): a joined rank takes part in every round;
it contributes the identity of the reduction (zeros for sum) to allreduces
the others run, and only single collectives run while anyone is joined, so
that a joined rank can size its buffers from the entry alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["Meta", "Entry", "Proposal", "ServerView", "Decision", "decide_server", "decide_global",
           "encode_summary", "SUMMARY_LEN", "MAX_ENTRIES", "MAX_FUSED", "DTYPE_CODES", "digest"]

KINDS = ("allreduce", "broadcast", "stock", "barrier")
OP_CODES = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4, "": 5}
DTYPE_CODES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16", "bool")
MAX_ENTRIES = 64  # queued collectives one proposal carries
MAX_FUSED = 64    # collectives one round may fuse


def digest(*parts: object) -> int:
    """A 62-bit digest of ``repr(parts)`` (fits int64, never negative)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


@dataclass(frozen=True)
class Meta:
    """What every rank must agree on for one collective (besides its name)."""

    kind: str
    name: str | None
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    op: str = "sum"
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    process_set: tuple[int, ...] = ()
    stock_kind: str = ""

    def key(self) -> tuple:
        return (self.kind, self.dtypes, self.shapes, self.op, self.root, self.prescale, self.postscale,
                self.process_set, self.stock_kind)

    def fuse_class(self) -> int:
        """Collectives with equal non-zero class may run as one fused collective."""
        if self.kind == "allreduce":
            return digest("allreduce", self.op, self.postscale, self.process_set)
        if self.kind == "broadcast":
            return digest("broadcast", self.root, self.process_set)
        return 0

    def numel_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dt, shape in zip(self.dtypes, self.shapes):
            out[dt] = out.get(dt, 0) + int(np.prod(shape, dtype=np.int64))
        return out

    def nbytes(self) -> int:
        sizes = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2}
        return sum(n * sizes.get(dt, 1) for dt, n in self.numel_by_dtype().items())

    def describe(self) -> str:
        shapes = ", ".join("[" + ",".join(str(d) for d in s) + "]" for s in self.shapes)
        dts = ",".join(sorted(set(self.dtypes)))
        extra = {"broadcast": f" from root {self.root}", "stock": f" ({self.stock_kind})"}.get(
            self.kind, f" op {self.op}" if self.kind == "allreduce" else "")
        return f"{self.kind} of {dts} shape {shapes}{extra}"

    def entry(self, name: str) -> "Entry":
        return Entry(name, digest(self.key()), self.fuse_class(), self.nbytes(), self.kind, self.op, self.root,
                     tuple(self.numel_by_dtype().items()), self.prescale, self.postscale)


@dataclass(frozen=True)
class Entry:
    """A queued collective as proposals carry it: small, and enough for a joined rank to serve it."""

    name: str
    key: int
    fuse: int
    nbytes: int
    kind: str
    op: str
    root: int
    numel: tuple[tuple[str, int], ...]
    prescale: float = 1.0
    postscale: float = 1.0

    def serve_meta(self) -> Meta:
        dts = tuple(dt for dt, _ in self.numel)
        return Meta(self.kind, self.name, dts, tuple((n,) for _, n in self.numel), op=self.op, root=self.root,
                    prescale=self.prescale, postscale=self.postscale)


@dataclass(frozen=True)
class Proposal:
    """One rank's input to a round: its queued collectives, or ``joined``."""

    rank: int
    entries: tuple[Entry, ...] = ()
    joined: bool = False
    join_round: int = -1
    metas: tuple[tuple[str, Meta], ...] = ()  # full metadata, only for names a previous round found mismatched


@dataclass(frozen=True)
class ServerView:
    """What a server's ranks agreed within the server (computed identically on each)."""

    n_active: int
    n_joined: int
    ready: tuple[Entry, ...]                      # ready on every active rank, first active rank's order
    mismatch: tuple[str, str] | None = None       # (name, message)
    join_round: int = -1
    join_rank: int = -1
    joined_ranks: tuple[int, ...] = ()
    waiting: tuple[tuple[str, tuple[int, ...]], ...] = ()  # name -> ranks that have not submitted it


@dataclass
class Decision:
    """What every rank does in a round (identical on all ranks).

    ``action``: ``"run"`` (the collectives ``names``, fused), ``"mismatch"``
    (fail collective ``names[0]`` with ``message``), ``"wait"`` (nothing is
    ready on every rank yet), ``"done_join"`` (every rank has joined;
    ``last_joined`` is what ``join`` returns).
    """

    action: str
    names: list[str] = field(default_factory=list)
    message: str = ""
    any_joined: bool = False
    head: Entry | None = None
    last_joined: int = -1
    joined_ranks: tuple[int, ...] = ()
    waiting: tuple[tuple[str, tuple[int, ...]], ...] = ()


def mismatch_message(name: str, metas: dict[int, Meta]) -> str:
    """Horovod-style: 'Mismatched <field> for <name>: rank a sent ..., but rank b sent ...'."""
    items = sorted(metas.items())
    r0, m0 = items[0]
    for r1, m1 in items[1:]:
        if m1.key() == m0.key():
            continue
        if m0.kind != m1.kind or m0.stock_kind != m1.stock_kind:
            what, a, b = "collective operations", m0.describe(), m1.describe()
        elif m0.dtypes != m1.dtypes:
            what, a, b = "data types", ",".join(m0.dtypes), ",".join(m1.dtypes)
        elif m0.shapes != m1.shapes:
            what, a = f"{m0.kind} tensor shapes", str([list(s) for s in m0.shapes])
            b = str([list(s) for s in m1.shapes])
        elif m0.root != m1.root:
            what, a, b = "root ranks", str(m0.root), str(m1.root)
        elif m0.op != m1.op:
            what, a, b = "reduction operations", m0.op, m1.op
        elif m0.process_set != m1.process_set:
            what, a, b = "process sets", str(list(m0.process_set)), str(list(m1.process_set))
        else:
            what, a, b = "prescale/postscale factors", f"{m0.prescale}/{m0.postscale}", f"{m1.prescale}/{m1.postscale}"
        return f"Mismatched {what} for {name!r}: rank {r0} sent {a}, but rank {r1} sent {b}"
    return f"Mismatched collectives for {name!r}"


def decide_server(proposals: Sequence[Proposal]) -> ServerView:
    """Agree within one server from its ranks' proposals (pure; the same on every rank)."""
    active = sorted((p for p in proposals if not p.joined), key=lambda p: p.rank)
    joined = [p for p in proposals if p.joined]
    jr, jrank = max(((p.join_round, p.rank) for p in joined), default=(-1, -1))
    joined_ranks = tuple(sorted(p.rank for p in joined))
    if not active:
        return ServerView(0, len(joined), (), join_round=jr, join_rank=jrank, joined_ranks=joined_ranks)
    by_rank = [{e.name: e for e in p.entries} for p in active]
    ready, waiting = [], []
    mismatch = None
    for e in active[0].entries:
        have = [m.get(e.name) for m in by_rank]
        if any(x is None for x in have):
            waiting.append((e.name, tuple(p.rank for p, x in zip(active, have) if x is None)))
            continue
        if mismatch is None and any(x.key != e.key for x in have):
            full = {p.rank: dict(p.metas).get(e.name) for p in active}
            if all(m is not None for m in full.values()):
                mismatch = (e.name, mismatch_message(e.name, full))  # type: ignore[arg-type]
            else:
                mismatch = (e.name, "")  # the ranks send their full metadata next round
            continue
        ready.append(e)
    # Names the lowest rank has not submitted are waited for too: the stall warning and the timeout then name
    # the ranks missing them (ranks of one server that submitted under different names).
    seen = {e.name for e in active[0].entries}
    for p in active[1:]:
        for e in p.entries:
            if e.name not in seen:
                seen.add(e.name)
                waiting.append((e.name, tuple(q.rank for q, m in zip(active, by_rank) if e.name not in m)))
    return ServerView(len(active), len(joined), tuple(ready[:MAX_ENTRIES]), mismatch, jr, jrank, joined_ranks,
                      tuple(waiting))


# -- the cross-server summary: a fixed-length int64 vector ------------------------------------------------------

_HDR = 8
_PER = 7  # name digest, key, fuse, nbytes, kind|op, root, dtype|numel
SUMMARY_LEN = _HDR + _PER * MAX_ENTRIES
_ST_OK, _ST_MISMATCH, _ST_IDLE = 0, 1, 2


def encode_summary(view: ServerView) -> np.ndarray:
    """The server's view as the fixed-size int64 row the cross-server allgather carries."""
    v = np.zeros(SUMMARY_LEN, dtype=np.int64)
    v[0] = _ST_MISMATCH if view.mismatch else (_ST_IDLE if view.n_active == 0 else _ST_OK)
    v[1], v[2], v[3] = view.n_active, view.n_joined, len(view.ready)
    v[4], v[5] = view.join_round, view.join_rank
    v[6] = digest(view.mismatch[0]) if view.mismatch else 0
    for j, e in enumerate(view.ready):
        o = _HDR + _PER * j
        v[o] = digest(e.name)
        v[o + 1], v[o + 2], v[o + 3] = e.key, e.fuse, e.nbytes
        v[o + 4] = KINDS.index(e.kind) * 16 + OP_CODES.get(e.op, 5)
        v[o + 5] = e.root
        if len(e.numel) == 1 and e.numel[0][0] in DTYPE_CODES:  # single-dtype: enough for a joined server
            v[o + 6] = (DTYPE_CODES.index(e.numel[0][0]) + 1) + 16 * e.numel[0][1]
        elif not e.numel:
            v[o + 6] = 0
        else:
            v[o + 6] = -1
    return v


def _rows(v: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in v[_HDR + _PER * j: _HDR + _PER * (j + 1)]) for j in range(int(v[3]))]


def _entry_from_row(row: tuple[int, ...], name: str) -> Entry | None:
    """An entry a fully joined server can serve (single dtype), rebuilt from its row."""
    kind = KINDS[row[4] // 16]
    op = next(k for k, c in OP_CODES.items() if c == row[4] % 16)
    if row[6] < 0:
        return None
    numel = () if row[6] == 0 else ((DTYPE_CODES[row[6] % 16 - 1], row[6] // 16),)
    return Entry(name, row[1], row[2], row[3], kind, op, row[5], numel)


def _fuse(ready: Sequence[Entry], budget: int) -> list[Entry]:
    """The first ready collective and the following ones of its fusion class, within ``budget`` bytes."""
    head = ready[0]
    out, used = [head], head.nbytes
    if head.fuse == 0:
        return out
    for e in ready[1:]:
        if len(out) >= MAX_FUSED:
            break
        if e.fuse != head.fuse:
            continue
        if budget and used + e.nbytes > budget:
            continue
        if not budget:
            break
        out.append(e)
        used += e.nbytes
    return out


def decide_global(local: ServerView, summaries: np.ndarray | None, server_index: int, fusion_bytes: int) -> Decision:
    """Combine the servers' views into the round's :class:`Decision` (pure; the same on every rank).

    ``summaries`` is the ``[num_servers, SUMMARY_LEN]`` allgather result, or
    None for a single-server job.
    """
    if summaries is None:
        return _decide_single(local, fusion_bytes)
    views = [np.asarray(s) for s in summaries]
    any_joined = any(int(v[2]) > 0 for v in views)
    for s, v in enumerate(views):
        if int(v[0]) == _ST_MISMATCH:
            if s == server_index and local.mismatch is not None:
                return Decision("mismatch", [local.mismatch[0]], local.mismatch[1], any_joined)
            # Another server's ranks disagree: this server fails the same name (if it has it).
            name = next((e.name for e in local.ready if digest(e.name) == int(v[6])), "")
            return Decision("mismatch", [name] if name else [],
                            f"Mismatched collectives: the ranks of server {s} disagree on this tensor", any_joined)
    active = [(s, v) for s, v in enumerate(views) if int(v[0]) == _ST_OK]
    if not active:
        best = max(((int(v[4]), int(v[5])) for v in views), default=(-1, -1))
        return Decision("done_join", any_joined=True, last_joined=best[1], joined_ranks=local.joined_ranks)
    rows = {s: {r[0]: r for r in _rows(v)} for s, v in active}
    first_s, first_v = active[0]
    mine = {digest(e.name): e for e in local.ready}
    ready: list[Entry] = []
    for row in _rows(first_v):
        everywhere = [rows[s].get(row[0]) for s, _ in active]
        if any(x is None for x in everywhere):
            continue
        if any(x[1] != row[1] for x in everywhere):
            name = mine[row[0]].name if row[0] in mine else ""
            bad = next(s for (s, _), x in zip(active, everywhere) if x[1] != row[1])
            return Decision("mismatch", [name] if name else [],
                            f"Mismatched collectives for {name!r}: server {first_s} and server {bad} sent "
                            f"different shapes, types or operations", any_joined)
        e = mine.get(row[0])
        if e is None:  # a fully joined server: serve what the others run
            e = _entry_from_row(row, f"#{row[0]}")
            if e is None:
                return Decision("mismatch", [], "join: a server whose ranks all joined cannot serve a grouped "
                                "allreduce of several dtypes", True)
        ready.append(e)
    if not ready:
        return Decision("wait", any_joined=any_joined, waiting=local.waiting)
    chosen = ready[:1] if any_joined else _fuse(ready, fusion_bytes)
    return Decision("run", [e.name for e in chosen], any_joined=any_joined, head=chosen[0],
                    joined_ranks=local.joined_ranks)


def _decide_single(view: ServerView, fusion_bytes: int) -> Decision:
    any_joined = view.n_joined > 0
    if view.mismatch is not None:
        return Decision("mismatch", [view.mismatch[0]], view.mismatch[1], any_joined)
    if view.n_active == 0:
        return Decision("done_join", any_joined=True, last_joined=view.join_rank, joined_ranks=view.joined_ranks)
    if not view.ready:
        return Decision("wait", any_joined=any_joined, waiting=view.waiting, joined_ranks=view.joined_ranks)
    chosen = view.ready[:1] if any_joined else _fuse(list(view.ready), fusion_bytes)
    return Decision("run", [e.name for e in chosen], any_joined=any_joined, head=chosen[0],
                    joined_ranks=view.joined_ranks)
