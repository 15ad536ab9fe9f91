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
   fusion class, bytes) -- over the runtime's shared metadata slots; in a
   single-server job a proposal also carries the inputs of small CPU
   allreduces (``BLINK_EAGER_BYTES``), which a round of only such
   allreduces reduces on every rank without a data round of its own;
2. across servers (multi-server jobs), every rank allgathers its server's
   fixed-size summary (the entries ready on all of the server's ranks) with
   its cross-server peers, a Horovod process set;
3. every rank computes the same :class:`Decision`: the collectives ready on
   every rank, in the first active rank's order, fused while they share a
   fusion class (Horovod's tensor fusion, bounded by
   ``HOROVOD_FUSION_THRESHOLD``); or a mismatch, raised on every rank and
   naming the disagreeing ranks; or "nothing ready yet" (try again); or the
   end of ``join``; or a stuck round (below).

Faults, so that every rank of every server raises the same line, with global ranks:

- a *mismatch* (the ranks of one server disagree on a name's metadata, or
  servers that each agree within disagree with each other) takes two rounds:
  the first asks every rank for its full :class:`Meta` of that name; in the
  second each server sends its ranks' metadata, grouped, in its summary
  row in place of its ready entries, and every rank computes
  :func:`mismatch_message` ("allreduce 'g': shape differs: rank 1 sent
  [4097], ranks 0, 2, 3 sent [4096]") from the same rows;
- *stuck*: when a rank's oldest queued collective has waited
  ``BLINK_TIMEOUT_SECONDS`` (ranks that submitted different names), the
  round asks every server for its ranks' queued names, and the next fails
  what every rank has queued with :func:`stuck_message`, naming what each
  rank submitted instead;
- a *failed* row (:func:`encode_failure`) replaces the summary of a rank
  whose server-mate is dead or stalled, so the other servers raise its
  error instead of waiting for a round that will never come.

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
import json
import zlib
from dataclasses import dataclass, field
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "MAX_ENTRIES",
    "MAX_FUSED",
    "SUMMARY_LEN",
    "Decision",
    "Entry",
    "Meta",
    "Proposal",
    "ServerView",
    "decide_global",
    "decide_server",
    "digest",
    "encode_failure",
    "encode_summary",
    "failure_of",
    "format_ranks",
    "mismatch_message",
    "stuck_message",
]

KINDS = ("allreduce", "broadcast", "stock", "barrier")
DEVICES = ("cpu", "cuda")
OP_CODES = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4, "": 5}
DTYPE_CODES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16", "bool")
MAX_ENTRIES = 64  # queued collectives one proposal carries
MAX_FUSED = 64    # collectives one round may fuse
PENDING_NAMES = 4  # queued names per rank a stuck round reports


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
    device: str = "cpu"  # "cpu" or "cuda": where the tensors live (every rank's must agree, as in Horovod)

    def key(self) -> tuple:
        return (self.kind, self.dtypes, self.shapes, self.op, self.root, self.prescale, self.postscale,
                self.process_set, self.stock_kind, self.device)

    def fuse_class(self) -> int:
        """Collectives with equal non-zero class may run as one fused collective."""
        if self.kind == "allreduce":
            return digest("allreduce", self.op, self.postscale, self.process_set, self.device)
        if self.kind == "broadcast":
            return digest("broadcast", self.root, self.process_set, self.device)
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

    def entry(self, name: str) -> Entry:
        return Entry(name, digest(self.key()), self.fuse_class(), self.nbytes(), self.kind, self.op, self.root,
                     tuple(self.numel_by_dtype().items()), self.prescale, self.postscale, self.device)


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
    device: str = "cpu"

    def serve_meta(self) -> Meta:
        dts = tuple(dt for dt, _ in self.numel)
        return Meta(self.kind, self.name, dts, tuple((n,) for _, n in self.numel), op=self.op, root=self.root,
                    prescale=self.prescale, postscale=self.postscale, device=self.device)


@dataclass(frozen=True)
class Proposal:
    """One rank's input to a round: its queued collectives, or ``joined``."""

    rank: int
    entries: tuple[Entry, ...] = ()
    joined: bool = False
    join_round: int = -1
    metas: tuple[tuple[str, Meta], ...] = ()  # full metadata, only for names a previous round found mismatched
    overdue: bool = False  # nothing this rank queued has run for BLINK_TIMEOUT_SECONDS (or a round asked)
    # small CPU allreduces' inputs, carried in the round itself (BLINK_EAGER_BYTES): name -> its arrays
    # (left out of == and hash: numpy arrays have neither as a proposal needs them)
    payloads: tuple[tuple[str, tuple[np.ndarray, ...]], ...] = field(default=(), compare=False)


Groups = tuple  # ((Meta, (rank, ...)), ...): one collective's metadata as the ranks sent it, grouped by value


@dataclass(frozen=True)
class ServerView:
    """What a server's ranks agreed within the server (computed identically on each)."""

    n_active: int
    n_joined: int
    ready: tuple[Entry, ...]                      # ready on every active rank, first active rank's order
    mismatch: str | None = None                   # the first name the server's ranks disagree on
    join_round: int = -1
    join_rank: int = -1
    joined_ranks: tuple[int, ...] = ()
    waiting: tuple[tuple[str, tuple[int, ...]], ...] = ()  # name -> ranks that have not submitted it
    # name -> every active rank's full metadata of it, grouped (the names whose metadata a previous round asked for)
    details: tuple[tuple[str, Groups], ...] = ()
    first_rank: int = 0                           # the server's lowest global rank
    # when a rank is overdue: every active rank's queued (name, kind), oldest first (the first few)
    pending: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] | None = None


@dataclass
class Decision:
    """What every rank does in a round (identical on all ranks).

    ``action``: ``"run"`` (the collectives ``names``, fused), ``"mismatch"``
    (fail collective ``names[0]`` -- the one whose name digest is ``key`` --
    with ``message``; an empty message asks every rank for its full metadata
    of ``key`` next round), ``"wait"`` (nothing is ready on every rank yet),
    ``"done_join"`` (every rank has joined; ``last_joined`` is what ``join``
    returns), ``"stuck"`` (nothing ran for ``BLINK_TIMEOUT_SECONDS``: every
    rank fails what it has queued with ``message``, naming what each rank
    submitted, from ``stuck``; an empty ``stuck`` asks every rank to send its
    queued names next round), ``"forget"`` (stop sending the full metadata of
    ``key``: every rank sent the same).
    """

    action: str
    names: list[str] = field(default_factory=list)
    message: str = ""
    any_joined: bool = False
    head: Entry | None = None
    last_joined: int = -1
    joined_ranks: tuple[int, ...] = ()
    waiting: tuple[tuple[str, tuple[int, ...]], ...] = ()
    key: int = 0
    log: str = ""  # what this server's ranks log besides the message (details too large to cross servers)
    stuck: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()  # "stuck": each rank's queued (name, kind)


# The fields a mismatch names, in the order they are checked (the first that differs is reported).
MISMATCH_FIELDS = ("collective", "device", "dtype", "shape", "op", "root", "prescale", "postscale", "process set")


def _field_value(m: Meta, field: str) -> str:
    if field == "collective":
        return m.stock_kind or m.kind
    if field == "device":
        return m.device
    if field == "dtype":
        return ",".join(m.dtypes) if m.dtypes else "-"
    if field == "shape":
        shapes = ["[" + ", ".join(str(d) for d in s) + "]" for s in m.shapes]
        return shapes[0] if len(shapes) == 1 else "[" + ", ".join(shapes) + "]"
    if field == "op":
        return m.op
    if field == "root":
        return str(m.root)
    if field == "prescale":
        return repr(float(m.prescale))
    if field == "postscale":
        return repr(float(m.postscale))
    return "[" + ", ".join(str(r) for r in m.process_set) + "]"


def format_ranks(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 2, 3``; runs of four or more consecutive ranks as ``0-63``."""
    rs = sorted({int(r) for r in ranks})
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 3:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def mismatch_message(name: str, metas: Mapping[int, Meta]) -> str:
    """The one line every rank raises: the collective, the field, each value and the global ranks that sent it.

    ``allreduce 'g': shape differs: rank 1 sent [4097], ranks 0, 2, 3 sent [4096]`` -- the values in the
    order of how few ranks sent them (the odd one out first), ties by lowest rank.
    """
    items = sorted(metas.items())
    for fld in MISMATCH_FIELDS:
        groups: dict[str, list[int]] = {}
        for r, m in items:
            groups.setdefault(_field_value(m, fld), []).append(r)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        # Named after what most ranks submitted (the odd ones out are the ones that differ).
        majority = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
        kind = _field_value(dict(items)[majority[0]], "collective")
        return f"{kind} {name!r}: {fld} differs: " + ", ".join(
            f"{format_ranks(rs)} sent {value}" for value, rs in ordered)
    kind = _field_value(items[0][1], "collective")
    return f"{kind} {name!r}: mismatched collectives ({format_ranks([r for r, _ in items])})"


def _meta_row(m: Meta) -> list:
    return [m.kind, m.stock_kind, list(m.dtypes), [list(s) for s in m.shapes], m.op, m.root, m.prescale,
            m.postscale, list(m.process_set), m.device]


def _meta_from_row(row: Sequence, name: str) -> Meta:
    kind, stock_kind, dtypes, shapes, op, root, pre, post, pset, device = row
    return Meta(kind, name, tuple(dtypes), tuple(tuple(int(d) for d in s) for s in shapes), op=op, root=int(root),
                prescale=float(pre), postscale=float(post), process_set=tuple(int(r) for r in pset),
                stock_kind=stock_kind, device=str(device))


def _group(metas: Mapping[int, Meta]) -> Groups:
    out: dict[tuple, tuple[Meta, list[int]]] = {}
    for r, m in sorted(metas.items()):
        k = (m.key(), m.stock_kind)
        out.setdefault(k, (m, []))[1].append(r)
    return tuple((m, tuple(rs)) for m, rs in out.values())


def _ungroup(groups: Groups) -> dict[int, Meta]:
    return {r: m for m, rs in groups for r in rs}


def decide_server(proposals: Sequence[Proposal]) -> ServerView:
    """Agree within one server from its ranks' proposals (pure; the same on every rank)."""
    active = sorted((p for p in proposals if not p.joined), key=lambda p: p.rank)
    joined = [p for p in proposals if p.joined]
    jr, jrank = max(((p.join_round, p.rank) for p in joined), default=(-1, -1))
    joined_ranks = tuple(sorted(p.rank for p in joined))
    first_rank = min((p.rank for p in proposals), default=0)
    if not active:
        return ServerView(0, len(joined), (), join_round=jr, join_rank=jrank, joined_ranks=joined_ranks,
                          first_rank=first_rank)
    by_rank = [{e.name: e for e in p.entries} for p in active]
    full = [dict(p.metas) for p in active]
    ready, waiting, details = [], [], []
    mismatch = None
    for e in active[0].entries:
        have = [m.get(e.name) for m in by_rank]
        if any(x is None for x in have):
            waiting.append((e.name, tuple(p.rank for p, x in zip(active, have) if x is None)))
            continue
        metas = [f.get(e.name) for f in full]
        if all(m is not None for m in metas):  # asked for: every rank's full metadata, for every server to see
            details.append((e.name, _group({p.rank: m for p, m in zip(active, metas)})))  # type: ignore[misc]
        if any(x.key != e.key for x in have):
            if mismatch is None:
                mismatch = e.name  # the ranks send their full metadata next round (unless they just did)
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
    pending = None
    if any(p.overdue for p in active):
        pending = tuple((p.rank, tuple((e.name, e.kind) for e in p.entries[:PENDING_NAMES])) for p in active)
    return ServerView(len(active), len(joined), tuple(ready[:MAX_ENTRIES]), mismatch, jr, jrank, joined_ranks,
                      tuple(waiting), tuple(details), first_rank, pending)


# -- the cross-server summary: a fixed-length int64 vector ------------------------------------------------------

_HDR = 10  # status, active, joined, ready, join round, join rank, flagged name digest, blob bytes, first rank, -
_PER = 7  # name digest, key, fuse, nbytes, kind|op, root, dtype|numel
SUMMARY_LEN = _HDR + _PER * MAX_ENTRIES
_ST_OK, _ST_MISMATCH, _ST_IDLE, _ST_DETAILS, _ST_STUCK, _ST_FAILED = 0, 1, 2, 3, 4, 5
_BLOB_BYTES = 8 * _PER * MAX_ENTRIES  # a flagged server's row carries metadata in place of its entries


def _pack_details(details: Sequence[tuple[str, Groups]], first: str) -> bytes:
    """The details as compressed JSON, within the row; what does not fit is dropped, and if even the
    flagged name's details do not fit, they are marked as kept in this server's log (``null``)."""
    rows = [[name, [[_meta_row(m), list(rs)] for m, rs in groups]] for name, groups in details]
    flagged = [r for r in rows if r[0] == first]
    for attempt in (flagged + [r for r in rows if r[0] != first], flagged, [[first, None]]):
        blob = zlib.compress(json.dumps(attempt, separators=(",", ":")).encode("utf-8"))
        if len(blob) <= _BLOB_BYTES:
            return blob
    return zlib.compress(json.dumps([[first[:200] + "...", None]]).encode("utf-8"))  # pragma: no cover


def _unpack_details(v: np.ndarray) -> dict[int, tuple[str, Groups | None]]:
    """name digest -> (name, groups or None where they stayed in the server's log) of a flagged row."""
    n = int(v[7])
    if n <= 0:
        return {}
    raw = np.ascontiguousarray(v[_HDR:]).view(np.uint8)[:n].tobytes()
    out: dict[int, tuple[str, Groups | None]] = {}
    for name, groups in json.loads(zlib.decompress(raw).decode("utf-8")):
        out[digest(name)] = (name, None if groups is None else
                             tuple((_meta_from_row(m, name), tuple(int(r) for r in rs)) for m, rs in groups))
    return out


def _pack_pending(pending: Sequence[tuple[int, Sequence[tuple[str, str]]]]) -> bytes:
    rows = [[r, [[n, k] for n, k in names]] for r, names in pending]
    limit = 200
    while True:
        blob = zlib.compress(json.dumps(rows, separators=(",", ":")).encode("utf-8"))
        if len(blob) <= _BLOB_BYTES or limit < 8:
            return blob[:_BLOB_BYTES] if len(blob) > _BLOB_BYTES else blob
        rows = [[r, [[n[:limit], k] for n, k in names[:1]]] for r, names in rows]  # shorter, fewer names
        limit //= 2


def _unpack_pending(v: np.ndarray) -> dict[int, list[tuple[str, str]]] | None:
    n = int(v[7])
    try:
        raw = np.ascontiguousarray(v[_HDR:]).view(np.uint8)[:n].tobytes()
        return {int(r): [(str(a), str(b)) for a, b in names] for r, names in json.loads(zlib.decompress(raw))}
    except (ValueError, zlib.error):  # cut short (a job of very many ranks): the names stay unknown
        return None


def stuck_message(pending: Mapping[int, Sequence[tuple[str, str]]], timeout: float) -> tuple[str, bool]:
    """What every rank raises when nothing ran for ``timeout`` s: ``(message, names_differ)``.

    The name most ranks submitted is the one the others lack; each of those is named with what
    it submitted instead: "allreduce 'grad.w': name differs: rank 1 sent 'grad.b', ranks 0, 2, 3
    sent 'grad.w' (no collective was submitted by every rank within 10 s, BLINK_TIMEOUT_SECONDS)".
    """
    why = f"(no collective was submitted by every rank within {timeout:g} s, BLINK_TIMEOUT_SECONDS)"
    count: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    for r, names in sorted(pending.items()):
        for n, k in names:
            count.setdefault(n, []).append(r)
            kinds.setdefault(n, k)
    if not count:
        return f"nothing ran {why}", False
    want = max(count, key=lambda n: (len(count[n]), -count[n][0]))
    lacking = [r for r in sorted(pending) if r not in count[want]]
    if not lacking:
        return f"{kinds[want]} {want!r}: submitted by {format_ranks(count[want])} but not run {why}", False
    groups: dict[str, list[int]] = {}
    for r in lacking:
        head = pending[r][0][0] if pending[r] else "nothing"
        groups.setdefault(repr(head) if pending[r] else head, []).append(r)
    groups[repr(want)] = count[want]
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    return (f"{kinds[want]} {want!r}: name differs: "
            + ", ".join(f"{format_ranks(rs)} sent {v}" for v, rs in ordered) + f" {why}"), True


def encode_failure(kind: str, message: str, rank: int) -> np.ndarray:
    """The row a rank sends in place of its server's summary when the round failed within its server
    (a server-mate timed out or died): the error's class name and message, for every server to raise."""
    v = np.zeros(SUMMARY_LEN, dtype=np.int64)
    v[0] = _ST_FAILED
    v[8] = rank
    raw = json.dumps([kind, message]).encode("utf-8")
    blob = zlib.compress(raw)
    if len(blob) > _BLOB_BYTES:  # pragma: no cover - messages are short
        blob = zlib.compress(json.dumps([kind, message[:2000] + "..."]).encode("utf-8"))
    v[7] = len(blob)
    v[_HDR:].view(np.uint8)[:len(blob)] = np.frombuffer(blob, np.uint8)
    return v


def failure_of(summaries: np.ndarray) -> tuple[str, str, int] | None:
    """``(class name, message, sending rank)`` of the first failed row of a round, or None."""
    for v in summaries:
        if int(v[0]) == _ST_FAILED:
            raw = np.ascontiguousarray(v[_HDR:]).view(np.uint8)[:int(v[7])].tobytes()
            kind, message = json.loads(zlib.decompress(raw))
            return str(kind), str(message), int(v[8])
    return None


def encode_summary(view: ServerView) -> np.ndarray:
    """The server's view as the fixed-size int64 row the cross-server allgather carries.

    A server whose ranks disagree on a name (``mismatch``), or that was asked for its ranks' full
    metadata of a name (``details``), sends that metadata instead of its ready entries: that round is
    a mismatch round on every server, and the metadata lets every rank name the field, the values and
    the ranks that sent each.
    """
    v = np.zeros(SUMMARY_LEN, dtype=np.int64)
    v[1], v[2] = view.n_active, view.n_joined
    v[4], v[5] = view.join_round, view.join_rank
    v[8] = view.first_rank
    # A rank past the timeout comes first: a mismatch whose details some server cannot send (its ranks
    # never submitted that name) would otherwise be asked about for ever.
    if view.pending is not None:
        v[0] = _ST_STUCK
        blob = _pack_pending(view.pending)
        v[7] = len(blob)
        v[_HDR:].view(np.uint8)[:len(blob)] = np.frombuffer(blob, np.uint8)
        return v
    if view.mismatch is not None or view.details:
        first = view.mismatch if view.mismatch is not None else view.details[0][0]
        v[0] = _ST_MISMATCH if view.mismatch is not None else _ST_DETAILS
        v[6] = digest(first)
        have = [(n, g) for n, g in view.details]
        blob = _pack_details(have, first) if any(n == first for n, _ in have) else b""
        v[7] = len(blob)
        if blob:
            v[_HDR:].view(np.uint8)[:len(blob)] = np.frombuffer(blob, np.uint8)
        return v
    v[0] = _ST_IDLE if view.n_active == 0 else _ST_OK
    v[3] = len(view.ready)
    for j, e in enumerate(view.ready):
        o = _HDR + _PER * j
        v[o] = digest(e.name)
        v[o + 1], v[o + 2], v[o + 3] = e.key, e.fuse, e.nbytes
        v[o + 4] = DEVICES.index(e.device) * 256 + KINDS.index(e.kind) * 16 + OP_CODES.get(e.op, 5)
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
    kind = KINDS[row[4] % 256 // 16]
    op = next(k for k, c in OP_CODES.items() if c == row[4] % 16)
    if row[6] < 0:
        return None
    numel = () if row[6] == 0 else ((DTYPE_CODES[row[6] % 16 - 1], row[6] // 16),)
    return Entry(name, row[1], row[2], row[3], kind, op, row[5], numel, device=DEVICES[row[4] // 256])


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


def _local_name(local: ServerView, key: int) -> str:
    """The name with digest ``key`` among what this server's ranks submitted ("" if none)."""
    names = [n for n, _ in local.details] + [e.name for e in local.ready] + [n for n, _ in local.waiting]
    if local.mismatch is not None:
        names.insert(0, local.mismatch)
    return next((n for n in names if digest(n) == key), "")


def _decide_mismatch(local: ServerView, views: Sequence[np.ndarray], server_index: int,
                     any_joined: bool) -> Decision:
    """A round in which some server flagged a name: one message for every rank, or a request for details."""
    flagged = [v for v in views if int(v[0]) == _ST_MISMATCH] or [v for v in views if int(v[0]) == _ST_DETAILS]
    key = int(flagged[0][6])
    mine = _local_name(local, key)
    ask = Decision("mismatch", [mine] if mine else [], "", any_joined, key=key)
    metas: dict[int, Meta] = {}
    kept: list[int] = []  # servers whose details were too large to send
    name = ""
    for s, v in enumerate(views):
        if int(v[0]) == _ST_IDLE:
            continue  # every rank of that server has joined: it submits nothing
        det = _unpack_details(v).get(key) if int(v[0]) in (_ST_MISMATCH, _ST_DETAILS) else None
        if det is None:
            return ask  # that server's ranks have not sent this name's metadata (yet)
        name, groups = det
        if groups is None:
            kept.append(s)
        else:
            metas.update(_ungroup(groups))
    if not kept:
        if len({(m.key(), m.stock_kind) for m in metas.values()}) == 1:
            # Every rank sent the same metadata (a request outlived its mismatch): nothing to fail.
            return Decision("forget", [], "", any_joined, key=key)
        return Decision("mismatch", [mine] if mine else [], mismatch_message(name, metas), any_joined, key=key)
    where = ", ".join(
        f"server {s} ({format_ranks(range(int(views[s][8]), int(views[s][8] + views[s][1] + views[s][2])))})"
        for s in kept)
    message = (f"{name!r}: the ranks disagree on this collective; the metadata found on {where} is too large to "
               f"send across servers: the field, values and ranks are in the log of that server's ranks")
    log = ""
    if server_index in kept and local.mismatch is not None:
        det = dict(local.details).get(local.mismatch)
        if det is not None:
            log = mismatch_message(local.mismatch, _ungroup(det))
    return Decision("mismatch", [mine] if mine else [], message, any_joined, key=key, log=log)


def decide_global(local: ServerView, summaries: np.ndarray | None, server_index: int, fusion_bytes: int) -> Decision:
    """Combine the servers' views into the round's :class:`Decision` (pure; the same on every rank).

    ``summaries`` is the ``[num_servers, SUMMARY_LEN]`` allgather result, or
    None for a single-server job.

    A mismatch takes two rounds: the round that finds it (within a server, or between servers
    whose ranks agree among themselves) asks every rank for its full metadata of that name; in
    the next, every server sends its ranks' metadata in its row, so every rank of every server
    computes the same message from the same metadata, naming the global ranks that sent each value.
    """
    if summaries is None:
        return _decide_single(local, fusion_bytes)
    views = [np.asarray(s) for s in summaries]
    any_joined = any(int(v[2]) > 0 for v in views)
    if any(int(v[0]) == _ST_STUCK for v in views):
        pending: dict[int, list[tuple[str, str]]] = {}
        for v in views:
            st = int(v[0])
            if st == _ST_IDLE:
                continue
            got = _unpack_pending(v) if st == _ST_STUCK else None
            if st != _ST_STUCK:
                return Decision("stuck", any_joined=any_joined)  # that server's names next round
            pending.update(got or {})
        return Decision("stuck", any_joined=any_joined, stuck=tuple(
            (r, tuple(n)) for r, n in sorted(pending.items())))
    if any(int(v[0]) in (_ST_MISMATCH, _ST_DETAILS) for v in views):
        return _decide_mismatch(local, views, server_index, any_joined)
    active = [(s, v) for s, v in enumerate(views) if int(v[0]) == _ST_OK]
    if not active:
        best = max(((int(v[4]), int(v[5])) for v in views), default=(-1, -1))
        return Decision("done_join", any_joined=True, last_joined=best[1], joined_ranks=local.joined_ranks)
    rows = {s: {r[0]: r for r in _rows(v)} for s, v in active}
    _, first_v = active[0]
    mine = {digest(e.name): e for e in local.ready}
    ready: list[Entry] = []
    for row in _rows(first_v):
        everywhere = [rows[s].get(row[0]) for s, _ in active]
        if any(x is None for x in everywhere):
            continue
        if any(x[1] != row[1] for x in everywhere):
            # The servers disagree, each agreeing within: every rank sends its full metadata next round.
            name = mine[row[0]].name if row[0] in mine else ""
            return Decision("mismatch", [name] if name else [], "", any_joined, key=row[0])
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
    if view.pending is not None:
        return Decision("stuck", any_joined=any_joined, stuck=view.pending)
    if view.mismatch is not None:
        det = dict(view.details).get(view.mismatch)
        message = mismatch_message(view.mismatch, _ungroup(det)) if det is not None else ""
        return Decision("mismatch", [view.mismatch], message, any_joined, key=digest(view.mismatch))
    if view.n_active == 0:
        return Decision("done_join", any_joined=True, last_joined=view.join_rank, joined_ranks=view.joined_ranks)
    if not view.ready:
        return Decision("wait", any_joined=any_joined, waiting=view.waiting, joined_ranks=view.joined_ranks)
    chosen = view.ready[:1] if any_joined else _fuse(list(view.ready), fusion_bytes)
    return Decision("run", [e.name for e in chosen], any_joined=any_joined, head=chosen[0],
                    joined_ranks=view.joined_ranks)
