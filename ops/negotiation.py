"""The per-collective agreement across ranks: same collective, same metadata, and who has joined.

Stock Horovod negotiates in its background thread which named tensors every
rank has submitted, so ranks may submit in different orders.  Blink moves
the data itself and so must run collectives in one order on every rank
(../shared/DESIGN.md, "Same order on every rank").  Before any byte moves,
each round of the engine agrees on what runs next, cheaply:

1. within the server, the ranks allgather a small *proposal* over the
   runtime's rendezvous: the metadata of the collectives at the head of the
   rank's queue (kind, name, dtype, shapes, op, root, scaling factors,
   process set), or "joined" for a rank inside ``hvd.join()``;
2. across servers (multi-server jobs), each rank allgathers its server's
   fixed-size summary with its cross-server peers (a Horovod process set);
3. every rank then computes the same :class:`Decision` from the same data:
   run the first ``count`` queued collectives (fused when ``count > 1``),
   raise a :class:`~blink_horovod.errors.MismatchError` on every rank that
   names the disagreeing ranks (Horovod's "Mismatched ... One rank sent ...,
   another rank sent ..."), or finish ``join``.

Proposals carry a chain of digests (``d_j = H(d_{j-1}, meta_j)``), so the
longest common prefix of queued collectives is found from one number per
collective: that is how ranks agree to fuse several queued small allreduces,
as Horovod's tensor fusion does, while staying deterministic.

``join`` (Horovod's ``hvd.join``): a joined rank keeps taking part in rounds;
it contributes the identity of the reduction (zeros for sum) to allreduces
the others run, and only single collectives run while anyone is joined so
that a joined rank can size its buffers from the summary alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import MismatchError

__all__ = [
    "Meta",
    "Proposal",
    "Decision",
    "chain_digests",
    "decide_server",
    "encode_summary",
    "decide_global",
    "SUMMARY_LEN",
    "MAX_FUSED",
    "DTYPE_CODES",
]

# Collective kinds: what a round can run.
KINDS = ("allreduce", "broadcast", "stock", "barrier")
OP_CODES = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4}
DTYPE_CODES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16", "bool")
MAX_FUSED = 64  # queued collectives one round may fuse


@dataclass(frozen=True)
class Meta:
    """What every rank must agree on for one collective.

    ``sizes`` maps dtype name -> element count per tensor, in order (grouped
    allreduces carry several tensors); ``shapes`` are checked as Horovod does.
    """

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
        """The fields compared across ranks (the name only when the rank gave one)."""
        return (self.kind, self.dtypes, self.shapes, self.op, self.root, self.prescale, self.postscale,
                self.process_set, self.stock_kind)

    def numel_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dt, shape in zip(self.dtypes, self.shapes):
            out[dt] = out.get(dt, 0) + int(np.prod(shape, dtype=np.int64))
        return out

    def describe(self) -> str:
        shapes = ", ".join("[" + ",".join(str(d) for d in s) + "]" for s in self.shapes)
        dts = ",".join(sorted(set(self.dtypes)))
        extra = f" root {self.root}" if self.kind == "broadcast" else f" op {self.op}"
        if self.kind == "stock":
            extra = f" ({self.stock_kind})"
        name = f" {self.name!r}" if self.name else ""
        return f"{self.kind}{name} of {dts} shape {shapes}{extra}"


def _digest(prev: int, meta: Meta) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(prev.to_bytes(8, "little", signed=False))
    h.update(repr(meta.key()).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


def chain_digests(metas: Sequence[Meta]) -> tuple[int, ...]:
    """``d_j = H(d_{j-1}, meta_j)``: equal ``d_j`` means equal prefixes of length ``j``."""
    out = []
    prev = 0
    for m in metas:
        prev = _digest(prev, m)
        out.append(prev)
    return tuple(out)


@dataclass(frozen=True)
class Proposal:
    """One rank's input to a round: its queued head (``metas``) or ``joined``."""

    rank: int
    metas: tuple[Meta, ...] = ()
    joined: bool = False
    join_round: int = -1  # the round in which this rank joined (for "last joined rank")

    @property
    def digests(self) -> tuple[int, ...]:
        return chain_digests(self.metas)


@dataclass
class Decision:
    """What every rank does in a round (identical on all ranks).

    ``action``: ``"run"`` (the first ``count`` queued collectives), ``"mismatch"``
    (raise ``message`` for the head collective), ``"done_join"`` (every rank
    has joined; ``last_joined`` is Horovod's return value of ``join``).
    """

    action: str
    count: int = 0
    message: str = ""
    any_joined: bool = False
    head: Meta | None = None
    last_joined: int = -1
    joined_ranks: tuple[int, ...] = field(default_factory=tuple)


def _mismatch_message(metas: dict[int, Meta]) -> str:
    """Horovod-style: 'Mismatched <field>: One rank sent ..., but another rank sent ...'."""
    items = sorted(metas.items())
    r0, m0 = items[0]
    for r1, m1 in items[1:]:
        if m1.key() == m0.key() and (m0.name is None or m1.name is None or m0.name == m1.name):
            continue
        if m0.kind != m1.kind or m0.stock_kind != m1.stock_kind:
            what = "collective operations"
            a, b = m0.describe(), m1.describe()
        elif m0.name and m1.name and m0.name != m1.name:
            what = "tensor names"
            a, b = repr(m0.name), repr(m1.name)
        elif m0.dtypes != m1.dtypes:
            what = "data types"
            a, b = ",".join(m0.dtypes), ",".join(m1.dtypes)
        elif m0.shapes != m1.shapes:
            what = f"{m0.kind} tensor shapes"
            a, b = str([list(s) for s in m0.shapes]), str([list(s) for s in m1.shapes])
        elif m0.root != m1.root:
            what = "root ranks"
            a, b = str(m0.root), str(m1.root)
        elif m0.op != m1.op:
            what = "reduction operations"
            a, b = m0.op, m1.op
        elif m0.process_set != m1.process_set:
            what = "process sets"
            a, b = str(list(m0.process_set)), str(list(m1.process_set))
        else:
            what = "prescale/postscale factors"
            a, b = f"{m0.prescale}/{m0.postscale}", f"{m1.prescale}/{m1.postscale}"
        return (f"Mismatched {what}: rank {r0} sent {a}, but rank {r1} sent {b} "
                f"(Blink runs collectives in submission order: every rank must submit the same "
                f"collectives in the same order)")
    return "Mismatched collectives across ranks"


def _common_prefix(digest_lists: Sequence[Sequence[int]]) -> int:
    n = min(len(d) for d in digest_lists)
    k = 0
    while k < n and all(d[k] == digest_lists[0][k] for d in digest_lists):
        k += 1
    return k


def _names_agree(proposals: Sequence[Proposal], k: int) -> int:
    """Shrink ``k`` so that explicitly given names agree too (Horovod keys ops by name)."""
    for j in range(k):
        names = {p.metas[j].name for p in proposals if p.metas[j].name is not None}
        if len(names) > 1:
            return j
    return k


@dataclass(frozen=True)
class ServerView:
    """What a server's ranks agreed within the server (computed identically on each)."""

    n_active: int
    n_joined: int
    count: int              # common prefix length among active ranks (0 with none active)
    digests: tuple[int, ...]
    head: Meta | None
    mismatch: str = ""
    join_round: int = -1    # max join round among joined ranks
    join_rank: int = -1     # the rank that joined in join_round (max rank on ties)
    joined_ranks: tuple[int, ...] = ()


def decide_server(proposals: Sequence[Proposal]) -> ServerView:
    """Agree within one server from its ranks' proposals (pure; same result on every rank)."""
    active = [p for p in proposals if not p.joined]
    joined = [p for p in proposals if p.joined]
    jr, jrank = -1, -1
    for p in joined:
        if (p.join_round, p.rank) > (jr, jrank):
            jr, jrank = p.join_round, p.rank
    joined_ranks = tuple(sorted(p.rank for p in joined))
    if not active:
        return ServerView(0, len(joined), 0, (), None, join_round=jr, join_rank=jrank, joined_ranks=joined_ranks)
    digs = [p.digests for p in active]
    k = _names_agree(active, _common_prefix(digs))
    if k == 0:
        msg = _mismatch_message({p.rank: p.metas[0] for p in active})
        return ServerView(len(active), len(joined), 0, (), active[0].metas[0], mismatch=msg,
                          join_round=jr, join_rank=jrank, joined_ranks=joined_ranks)
    return ServerView(len(active), len(joined), k, digs[0][:k], active[0].metas[0],
                      join_round=jr, join_rank=jrank, joined_ranks=joined_ranks)


# Cross-server summary: fixed-length int64 vector.
_HDR = 12
SUMMARY_LEN = _HDR + len(DTYPE_CODES) + MAX_FUSED
_ST_OK, _ST_MISMATCH, _ST_IDLE = 0, 1, 2


def _kind_code(kind: str) -> int:
    return KINDS.index(kind)


def encode_summary(view: ServerView) -> np.ndarray:
    """The server's view as the fixed-size int64 vector the cross-server allgather carries."""
    v = np.zeros(SUMMARY_LEN, dtype=np.int64)
    status = _ST_MISMATCH if view.mismatch else (_ST_IDLE if view.n_active == 0 else _ST_OK)
    v[0] = status
    v[1] = view.n_active
    v[2] = view.n_joined
    v[3] = view.count
    v[4] = view.join_round
    v[5] = view.join_rank
    if view.head is not None:
        h = view.head
        v[6] = _kind_code(h.kind)
        v[7] = OP_CODES.get(h.op, 0)
        v[8] = h.root
        v[9] = np.float64(h.prescale).view(np.int64)
        v[10] = np.float64(h.postscale).view(np.int64)
        v[11] = len(h.shapes)
        for dt, n in h.numel_by_dtype().items():
            v[_HDR + DTYPE_CODES.index(dt)] = n
    for j, d in enumerate(view.digests[:MAX_FUSED]):
        v[_HDR + len(DTYPE_CODES) + j] = d
    return v


def head_from_summary(v: np.ndarray) -> Meta:
    """Rebuild enough of the head collective for a fully joined server to serve it."""
    kind = KINDS[int(v[6])]
    op = [k for k, c in OP_CODES.items() if c == int(v[7])][0]
    dtypes, shapes = [], []
    for i, dt in enumerate(DTYPE_CODES):
        n = int(v[_HDR + i])
        if n:
            dtypes.append(dt)
            shapes.append((n,))
    return Meta(kind=kind, name=None, dtypes=tuple(dtypes), shapes=tuple(shapes), op=op, root=int(v[8]),
                prescale=float(np.int64(v[9]).view(np.float64)), postscale=float(np.int64(v[10]).view(np.float64)))


def decide_global(local: ServerView, summaries: np.ndarray | None, server_index: int) -> Decision:
    """Combine the servers' views into the round's :class:`Decision` (pure; same on every rank).

    ``summaries`` is the ``[num_servers, SUMMARY_LEN]`` allgather result, or
    None for a single-server job.
    """
    if summaries is None:
        views = [encode_summary(local)]
        server_index = 0
    else:
        views = [np.asarray(s) for s in summaries]
    any_joined = any(int(v[2]) > 0 for v in views)
    joined_ranks = local.joined_ranks
    for s, v in enumerate(views):
        if int(v[0]) == _ST_MISMATCH:
            msg = local.mismatch if s == server_index else \
                f"Mismatched collectives across servers: the ranks of server {s} disagree among themselves"
            return Decision("mismatch", message=msg, any_joined=any_joined, head=local.head)
    active = [(s, v) for s, v in enumerate(views) if int(v[0]) == _ST_OK]
    if not active:
        best = max(((int(v[4]), int(v[5])) for v in views), default=(-1, -1))
        return Decision("done_join", any_joined=True, last_joined=best[1], joined_ranks=joined_ranks)
    off = _HDR + len(DTYPE_CODES)
    digs = [tuple(int(x) for x in v[off:off + int(v[3])]) for _, v in active]
    k = _common_prefix(digs)
    if k == 0:
        s0, v0 = active[0]
        s1, v1 = next((sv for sv, d in zip(active, digs) if d[:1] != digs[0][:1]), active[-1])
        h0, h1 = head_from_summary(v0), head_from_summary(v1)
        return Decision("mismatch", any_joined=any_joined, head=local.head,
                        message=f"Mismatched collectives across servers: server {s0} runs "
                                f"{h0.describe()}, but server {s1} runs {h1.describe()}")
    if any_joined:
        k = 1
    head = local.head if local.head is not None else head_from_summary(active[0][1])
    return Decision("run", count=k, any_joined=any_joined, head=head, joined_ranks=joined_ranks)


def negotiate(proposal: Proposal,
              intra_allgather: Callable[[Any], list],
              cross_allgather: Callable[[np.ndarray], np.ndarray] | None,
              server_index: int) -> Decision:
    """One round: intra-server allgather, optional cross-server allgather, then the decision."""
    proposals = intra_allgather(proposal)
    view = decide_server(proposals)
    summaries = None
    if cross_allgather is not None:
        summaries = cross_allgather(encode_summary(view))
    return decide_global(view, summaries, server_index)
