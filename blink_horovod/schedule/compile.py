"""Compile a plan into per-rank programs: chunked, pipelined tree collectives.

Blink (Wang et al., MLSys 2020), section 4: the generated code splits each
tree's share of the buffer into chunks and pipelines them, so that while chunk
``c`` is reduced one level up a tree, chunk ``c + 1`` is reduced one level
below; for AllReduce the broadcast back down the same tree follows in the same
pipeline.  Section 4, "Link sharing": when several trees use one link, their
transfers over that link reuse one CUDA stream, so chunks cross the link in a
fixed order instead of at the hardware's unfair whim.

The output is the pull-model IR of :mod:`blink_horovod.schedule.program`:

- ``reduce`` (up): for tree ``t``, chunk ``c``, a node ``v`` of height ``h``
  (leaves 0) reduces the chunk from each child at step ``c + h``, children in
  ascending height; a child that is a leaf is read as soon as its
  ``START_FLAG`` is up, an inner child after its own "chunk reduced" post.
- ``broadcast`` (down): a node at depth ``d`` copies the chunk from its parent
  at step ``base + c + d`` after the parent's post ("final"); for AllReduce
  ``base`` is the tree root's height, so the down phase of chunk ``c`` follows
  its up phase.  Broadcast roots need no per-chunk post: their input is ready
  at ``START_FLAG``.

Every op waits only for posts of strictly smaller steps; each rank's ops are
sorted by step.

Lanes (``stream``) follow the paper's stream reuse: the transfers of several
trees over one link share a lane, so they cross it in a fixed order.  Which
trees share is the ``lanes`` policy:

``"root"`` (default)  one lane per incoming link and tree root: the trees of one
                      root carry one segment in lockstep (the same chunk steps),
                      the "similarly positioned" links; trees of different
                      roots use a link at different phases of their pipelines
                      (one reducing up while another broadcasts down), and in an
                      in-order lane one would block the other.  For broadcast
                      plans (one root) this is reuse over every shared link.
``"link"``            one lane per incoming link ``(channel, peer)``, every tree.
``"tree"``            one lane per (tree, link): no reuse.

Measured with the simulator (sim/, 1 GB, DGX-1V, 8 GPUs, 21-tree allreduce,
1 MB chunks): time over the bound 1.19 (root), 2.07 (link), 1.19 (tree), with
22, 4 and 49 lanes on the busiest rank.

``after`` serializes writes to one region that sit on different lanes and
orders a post after the write it covers when that write is on another lane.

Byte ranges (docs/formats.md, Plan file): trees carry their fractions in list
order.  For AllReduce plans the i-th GPU's trees cover exactly
``[i*count//n, (i+1)*count//n)`` (boundaries snapped there, a root's trees
splitting its range in proportion to their fractions), so that servers with
different plans agree on the ranges of the cross-server stage.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from ..errors import BlinkInternalError, ScheduleError
from ..planner.plan import CHANNELS, Plan, Tree
from .program import DONE_FLAG, PROGRAM_KINDS, START_FLAG, Op, Program, make_op

__all__ = ["FRACTION_EPS", "chunk_count", "compile_program", "tree_ranges"]

# Trees whose fraction is at most this carry no bytes (the plan's own tolerance).
FRACTION_EPS = 1e-9
_FIRST_EVENT_FLAG = 2  # flags 0 and 1 are START_FLAG and DONE_FLAG
LANE_POLICIES = ("root", "link", "tree")
CHUNKING_POLICIES = ("fixed", "even")
_STEP_SEQ = operator.itemgetter(0, 1)  # op records sort by (step, generation order)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def tree_ranges(plan: Plan, count: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Element ranges ``[lo, hi)`` of every tree and of every rank's segment.

    Parameters
    ----------
    plan : Plan
        Its trees carry their fractions in list order.
    count : int
        Elements in the buffer.

    Returns
    -------
    (trees, segments)
        ``trees[t]`` is tree t's range (empty for trees without bytes);
        ``segments[r]`` the range rank r roots: for AllReduce plans exactly
        ``[r*count//n, (r+1)*count//n)``, for broadcast plans the whole buffer
        on the root and ``(0, 0)`` elsewhere.

    Raises
    ------
    ScheduleError
        when an AllReduce plan's trees do not follow the roots' order or leave a
        rank's segment without a tree.
    """
    n = plan.n
    rank_of = {g: i for i, g in enumerate(plan.gpus)}
    ntrees = len(plan.trees)
    out: list[tuple[int, int]] = [(0, 0)] * ntrees
    if plan.collective != "allreduce":
        fracs = [t.fraction if t.fraction > FRACTION_EPS else 0.0 for t in plan.trees]
        total = math.fsum(fracs)
        if total <= 0:
            raise ScheduleError("plan.trees: no tree carries bytes (fractions sum to 0)")
        carrying = [i for i, f in enumerate(fracs) if f > 0]
        pos = 0
        for i, f in enumerate(fracs):
            if f == 0:
                out[i] = (pos, pos)
                continue
            hi = count if i == carrying[-1] else min(count, max(pos, round(count * math.fsum(fracs[: i + 1]) / total)))
            out[i] = (pos, hi)
            pos = hi
        root = rank_of.get(plan.root, 0) if plan.root is not None else 0
        segments = [(0, 0)] * n
        segments[root] = (0, count)
        return out, segments

    segments = [(i * count // n, (i + 1) * count // n) for i in range(n)]
    groups: list[list[int]] = [[] for _ in range(n)]
    last_root = -1
    for t, tree in enumerate(plan.trees):
        if tree.fraction <= FRACTION_EPS:
            continue
        r = rank_of[tree.root]
        if r < last_root:
            raise ScheduleError(
                f"plan.trees[{t}]: rooted at GPU {tree.root} (rank {r}) after a tree of rank {last_root}; "
                f"allreduce trees must follow the roots' order of gpus {list(plan.gpus)}"
            )
        last_root = r
        groups[r].append(t)
    for r, (lo, hi) in enumerate(segments):
        members = groups[r]
        if not members:
            if hi > lo:
                raise ScheduleError(
                    f"plan: GPU {plan.gpus[r]} (rank {r}) roots no tree, but its segment [{lo}, {hi}) needs one"
                )
            continue
        fr = [plan.trees[t].fraction for t in members]
        total = math.fsum(fr)
        pos = lo
        for k, t in enumerate(members):
            end = hi if k == len(members) - 1 else max(pos, min(hi, lo + round((hi - lo) * math.fsum(fr[: k + 1]) / total)))
            out[t] = (pos, end)
            pos = end
    # Trees without bytes get an empty range at the position of the tree before them.
    pos = 0
    for t, tree in enumerate(plan.trees):
        if tree.fraction <= FRACTION_EPS:
            out[t] = (pos, pos)
        else:
            pos = out[t][1]
    return out, segments


class _Shape:
    """A tree in rank indices: parent, children (ascending height), height, depth, orders."""

    __slots__ = ("children", "depth", "height", "parent", "postorder", "preorder", "root")

    def __init__(self, tree: Tree, rank_of: dict[int, int], where: str) -> None:
        try:
            self.root = rank_of[tree.root]
            edges = [(rank_of[p], rank_of[c]) for p, c in tree.edges]
        except KeyError as exc:
            raise ScheduleError(f"{where}: GPU {exc.args[0]} is not in the plan's gpus") from None
        kids: dict[int, list[int]] = {}
        self.parent: dict[int, int] = {}
        for p, c in edges:
            if c in self.parent or c == self.root:
                raise ScheduleError(f"{where}: GPU of rank {c} has two parents (not an arborescence)")
            self.parent[c] = p
            kids.setdefault(p, []).append(c)
        # Preorder from the root (iterative; also proves every edge hangs off the root).
        self.depth = {self.root: 0}
        order = [self.root]
        i = 0
        while i < len(order):
            v = order[i]
            i += 1
            for c in kids.get(v, ()):
                self.depth[c] = self.depth[v] + 1
                order.append(c)
        if len(order) != len(edges) + 1:
            raise ScheduleError(f"{where}: edges {list(map(list, tree.edges))} do not form a tree from GPU {tree.root}")
        self.preorder = order
        self.postorder = order[::-1]
        self.height = {}
        for v in self.postorder:
            self.height[v] = 1 + max((self.height[c] for c in kids.get(v, ())), default=-1)
        edge_pos = {c: k for k, (_, c) in enumerate(edges)}
        self.children = {v: sorted(cs, key=lambda c: (self.height[c], edge_pos[c])) for v, cs in kids.items()}


def _chunks(lo: int, hi: int, chunk_elems: int, k: int, ramp: int = 1) -> list[tuple[int, int]]:
    """``(offset, count)`` of each chunk of ``[lo, hi)``.

    ``k == 0``: chunks of ``chunk_elems`` (the last may be shorter).  Else ``k``
    chunks of near-equal size, except that with ``ramp > 1`` the first and last
    ``ramp - 1`` chunks grow and shrink in steps of ``1 / ramp`` (weights
    ``min(ramp, i + 1, k - i)``); chunks that would be empty are left out.
    """
    if k <= 0:
        return [(a, min(chunk_elems, hi - a)) for a in range(lo, hi, chunk_elems)]
    k = min(k, hi - lo)
    weights = [min(ramp, i + 1, k - i) for i in range(k)]
    total = sum(weights)
    cuts = [lo]
    acc = 0
    for w in weights:
        acc += w
        cuts.append(lo + (hi - lo) * acc // total)
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(k) if cuts[i + 1] > cuts[i]]


def _pace(recs: list[list], pace: int, streams: int = 1) -> None:
    """Add the pacing edges (module docstring) to one rank's op records, in place.

    A transfer of tree ``t`` at step ``s`` over link ``(channel, peer)`` waits
    for the latest transfer of each other tree over that link whose step is at
    most ``s - pace``: a tree can run at most ``pace`` steps ahead of another
    on a link they share.  Every such edge points to a smaller step, so the
    step contract (program.py) still holds.

    t's transfers over one link and of one lane run in step order, so an edge
    to u's k-th transfer also covers t's later ones in that lane: it is added
    once per lane, at the first of t's transfers (in that lane) that needs it.
    """
    by_link: dict[tuple, dict[int, list[list]]] = {}
    for rec in recs:
        if rec[2] != "post":
            by_link.setdefault((rec[10], rec[3]), {}).setdefault(rec[7], []).append(rec)
    for trees in by_link.values():
        if len(trees) < 2:
            continue
        steps = {t: np.fromiter((rec[0] for rec in rs), np.int64, len(rs)) for t, rs in trees.items()}
        if not all(bool(np.all(st[1:] >= st[:-1])) for st in steps.values()):  # pragma: no cover
            raise BlinkInternalError("pacing: a tree's transfers over a link are not generated in step order")
        _pace_sorted(trees, steps, pace, streams)


def _pace_sorted(trees: dict[int, list[list]], steps: dict[int, np.ndarray], pace: int, streams: int) -> None:
    """:func:`_pace` for transfers in ascending step order (the compiler generates them so), vectorised.

    Ascending steps make ``k`` (u's latest transfer at or before ``s - pace``)
    non-decreasing along t's transfers, so "k beyond the last edge of this
    lane" is "k beyond k of the lane's previous transfer".
    """
    seqs = {u: np.fromiter((rec[1] for rec in urs), np.int64, len(urs)) for u, urs in trees.items()}
    for t, rs in trees.items():
        limits = steps[t] - pace
        lanes = np.fromiter((rec[8] % streams for rec in rs), np.int64, len(rs))
        at: list[np.ndarray] = []
        to: list[np.ndarray] = []
        for u in trees:
            if u == t:
                continue
            k = np.searchsorted(steps[u], limits, side="right") - 1
            emit = np.zeros(len(rs), bool)
            for lane in range(streams):
                where = np.flatnonzero(lanes == lane)
                if where.size:
                    kk = k[where]
                    prev = np.concatenate(([-1], kk[:-1]))
                    emit[where[kk > prev]] = True
            pos = np.flatnonzero(emit)
            at.append(pos)
            to.append(seqs[u][k[pos]])
        if not at:
            continue
        pos_all = np.concatenate(at)
        seq_all = np.concatenate(to)
        order = np.argsort(pos_all, kind="stable")  # per transfer, the other trees in dict order
        pos_sorted = pos_all[order]
        seq_list = seq_all[order].tolist()
        firsts, starts = np.unique(pos_sorted, return_index=True)
        bounds = [*starts.tolist(), len(seq_list)]
        for j, p in enumerate(firsts.tolist()):
            rec = rs[p]
            rec[11] = (*rec[11], *seq_list[bounds[j]:bounds[j + 1]])


class _Rank:
    """Op records of one rank before sorting: [step, seq, kind, peer, flag, offset, count,
    tree, chunk, lane_key, channel, after_seqs, fanin_sources]."""

    __slots__ = ("needs_start", "next_flag", "recs")

    def __init__(self) -> None:
        self.recs: list[list] = []
        self.next_flag = _FIRST_EVENT_FLAG
        self.needs_start = False


def compile_program(
    plan: Plan, count: int, chunk_elems: int, kind: str | None = None, *, lanes: str = "root", chunking: str = "fixed",
    pace: int | None = None, streams: int = 1, fanin: bool = False,
) -> Program:
    """Per-rank programs for ``plan`` over a buffer of ``count`` elements.

    Parameters
    ----------
    plan : Plan
        Trees and fractions (``blink-plan/1``); rank r is ``plan.gpus[r]``.
    count : int
        Elements per rank buffer (0 or more).
    chunk_elems : int
        Elements per chunk (1 or more); a tree's last chunk may be shorter.
    kind : str, optional
        ``"allreduce"`` (reduce up, broadcast down), ``"reduce"`` (up only: each
        tree root ends with its range reduced, hierarchical stage 1) or
        ``"broadcast"`` (down only from each tree's root: the whole buffer for
        broadcast plans, each root's segment for AllReduce plans, hierarchical
        stage 3).  Default: ``plan.collective``.
    lanes : str
        Which trees share a lane over a link: ``"root"`` (trees of one root),
        ``"link"`` (all) or ``"tree"`` (none); see the module docstring.
    chunking : str
        ``"fixed"`` (default): every chunk has ``chunk_elems`` elements (a
        tree's last one may be shorter), so a tree with a larger fraction has
        more chunks.  ``"even"``: every tree carrying bytes gets the same number
        of chunks, ``ceil(largest tree range / chunk_elems)`` (fewer for a tree
        with fewer elements than that), of sizes in proportion to its range:
        the trees then advance one chunk per pipeline step together and finish
        together, each at its plan rate (see the module docstring).
    pace : int, optional
        Couple the trees that share a link (see the module docstring,
        "Pacing"): a transfer of pipeline step ``s`` over link ``(channel,
        peer)`` also waits (``after``) for every other tree's latest transfer
        over that link of step ``s - pace`` or earlier.  None (default): no
        coupling.
    streams : int
        Lanes per lane key (default 1).  With more, chunk ``c`` of a tree
        takes the ``c % streams``-th, so one chunk's fixed cost overlaps the
        bytes of another (double buffering with 2); with ``chunking="even"``
        the first and last ``streams - 1`` chunks then ramp up and down in
        size (see the module docstring, "Double buffering").
    fanin : bool
        A node reduces the chunks of all its children with one ``fanin`` op
        (program.py) instead of one ``reduce`` per child in sequence (default
        False: the runtimes do not execute ``fanin`` ops).

    Returns
    -------
    Program
        ``meta`` holds ``tree_ranges``, ``steps`` (one more than the largest
        step), ``start_flag``/``done_flag``, ``plan_collective``, ``gpus`` and
        ``lanes`` (``lanes[r][s]``: the ``(channel, peer rank)`` link whose
        transfers lane s of rank r carries).

    Raises
    ------
    ScheduleError
        naming the argument or the plan field that makes compiling impossible.

    Examples
    --------
    >>> from blink_horovod.planner.plan import Plan, Tree
    >>> chain = Tree(0, 1.0, ((0, 1), (1, 2)))
    >>> plan = Plan("broadcast", "custom", (0, 1, 2), 0, (chain,), 1.0, 1.0)
    >>> prog = compile_program(plan, count=10, chunk_elems=4)
    >>> [(op.kind, op.peer, op.offset, op.count, op.step) for op in prog.ranks[2] if op.kind == "copy"]
    [('copy', 1, 0, 4, 2), ('copy', 1, 4, 4, 3), ('copy', 1, 8, 2, 4)]
    """
    kind = plan.collective if kind is None else kind
    if kind not in PROGRAM_KINDS:
        raise ScheduleError(f"kind: expected one of {', '.join(PROGRAM_KINDS)}, got {kind!r}")
    if not _is_int(count) or count < 0:
        raise ScheduleError(f"count: expected a non-negative integer number of elements, got {count!r}")
    if not _is_int(chunk_elems) or chunk_elems < 1:
        raise ScheduleError(f"chunk_elems: expected a positive integer, got {chunk_elems!r}")
    if lanes not in LANE_POLICIES:
        raise ScheduleError(f"lanes: expected one of {', '.join(LANE_POLICIES)}, got {lanes!r}")
    if chunking not in CHUNKING_POLICIES:
        raise ScheduleError(f"chunking: expected one of {', '.join(CHUNKING_POLICIES)}, got {chunking!r}")
    if pace is not None and (not _is_int(pace) or pace < 1):
        raise ScheduleError(f"pace: expected None or a positive integer number of steps, got {pace!r}")
    if not isinstance(fanin, bool):
        raise ScheduleError(f"fanin: expected True or False, got {fanin!r}")
    if not _is_int(streams) or streams < 1:
        raise ScheduleError(f"streams: expected a positive integer number of lanes per link, got {streams!r}")
    if not isinstance(plan, Plan) or not plan.gpus:
        raise ScheduleError(f"plan: expected a Plan with GPUs, got {plan!r}")
    n = plan.n
    rank_of = {g: i for i, g in enumerate(plan.gpus)}
    if len(rank_of) != n:
        raise ScheduleError(f"plan.gpus: duplicate GPU ids in {list(plan.gpus)}")
    for t, tree in enumerate(plan.trees):
        if tree.channel not in CHANNELS:
            raise ScheduleError(f"plan.trees[{t}].channel: expected one of {', '.join(CHANNELS)}, got {tree.channel!r}")
    ranges, segments = tree_ranges(plan, count)
    # "even": the largest tree's middle chunks have chunk_elems elements (the
    # ramp's 2 (streams - 1) partial chunks add up to streams - 1 whole ones).
    nchunks_even = max((-(-(hi - lo) // chunk_elems) for lo, hi in ranges), default=0) + streams - 1
    ranks = [_Rank() for _ in range(n)]
    seq = 0  # global generation counter: sort key within a step, and the id `after` refers to

    for t, tree in enumerate(plan.trees):
        lo, hi = ranges[t]
        if hi <= lo or n == 1:
            continue
        shape = _Shape(tree, rank_of, f"plan.trees[{t}]")
        if len(shape.preorder) != n:
            missing = sorted(set(plan.gpus) - {plan.gpus[v] for v in shape.preorder})
            raise ScheduleError(f"plan.trees[{t}]: carries elements [{lo}, {hi}) but does not reach GPUs {missing}")
        ch = tree.channel
        # lane key: (channel, peer) + what else must match to share a lane
        share = () if lanes == "link" else (shape.root,) if lanes == "root" else (t,)
        height, depth, parent, children = shape.height, shape.depth, shape.parent, shape.children
        root = shape.root
        inner_up = [v for v in shape.postorder if v in children]  # nodes that reduce
        down = shape.preorder[1:]
        top = height[root]
        for c, (a, m) in enumerate(_chunks(lo, hi, chunk_elems, nchunks_even if chunking == "even" else 0, streams)):
            spread = (c % streams,) if streams > 1 else ()
            up_flag: dict[int, int] = {}  # rank -> flag "chunk reduced" (inner nodes)
            last_write: dict[int, int] = {}  # rank -> seq of its last write of this chunk
            last_lane: dict[int, tuple] = {}
            if kind != "broadcast":
                for v in inner_up:
                    rv = ranks[v]
                    step = c + height[v]
                    prev = None
                    sources = []
                    for u in children[v]:
                        if u in children:
                            flag = up_flag[u]
                        else:
                            flag = START_FLAG
                            ranks[u].needs_start = True
                        sources.append((u, flag))
                    if fanin and len(sources) > 1:
                        # One op reads every child (lane of the first child's link).
                        u, flag = sources[0]
                        lane = (ch, u, *share, *spread)
                        rv.recs.append([step, seq, "fanin", u, flag, a, m, t, c, lane, ch, (), tuple(sources)])
                        prev = seq
                        last_lane[v] = lane
                        seq += 1
                        sources = []
                    for u, flag in sources:
                        lane = (ch, u, *share, *spread)
                        rv.recs.append([step, seq, "reduce", u, flag, a, m, t, c, lane, ch, () if prev is None else (prev,), ()])
                        prev = seq
                        last_lane[v] = lane
                        seq += 1
                    last_write[v] = prev
                    if v != root or kind == "allreduce":
                        flag = rv.next_flag
                        rv.next_flag += 1
                        up_flag[v] = flag
                        rv.recs.append([step, seq, "post", -1, flag, a, m, t, c, last_lane[v], ch, (prev,), ()])
                        seq += 1
            if kind == "reduce":
                continue
            if kind == "allreduce":
                down_flag = {root: up_flag[root]}
                base = c + top
            else:
                down_flag = {root: START_FLAG}
                ranks[root].needs_start = True
                base = c
            for v in down:
                rv = ranks[v]
                p = parent[v]
                step = base + depth[v]
                lane = (ch, p, *share, *spread)
                prev = last_write.get(v)
                rv.recs.append([step, seq, "copy", p, down_flag[p], a, m, t, c, lane, ch, () if prev is None else (prev,), ()])
                copy_seq = seq
                seq += 1
                if v in children:
                    flag = rv.next_flag
                    rv.next_flag += 1
                    down_flag[v] = flag
                    rv.recs.append([step, seq, "post", -1, flag, a, m, t, c, lane, ch, (copy_seq,), ()])
                    seq += 1

    out_ranks: list[tuple[Op, ...]] = []
    lanes_meta: list[tuple[tuple[str, int], ...]] = []
    nflags: list[int] = []
    nstreams: list[int] = []
    max_step = 0
    for r, rk in enumerate(ranks):
        recs = rk.recs
        if not recs and not rk.needs_start:
            out_ranks.append(())
            lanes_meta.append(())
            nflags.append(0)
            nstreams.append(0)
            continue
        # Lanes: one per incoming link (channel, peer); nvlink before pcie, by peer.
        keys = sorted({rec[9] for rec in recs}, key=lambda k: (CHANNELS.index(k[0]), *k[1:]))
        lane_of = {k: i for i, k in enumerate(keys)}
        lanes_meta.append(tuple(k[:2] for k in keys))
        if pace is not None:
            _pace(recs, pace, streams)
        if rk.needs_start:
            recs.append([0, -1, "post", -1, START_FLAG, 0, 0, -1, -1, None, "nvlink", (), ()])
        recs.sort(key=_STEP_SEQ)
        index_of = {rec[1]: i for i, rec in enumerate(recs)}
        lane_idx = [0 if rec[9] is None else lane_of[rec[9]] for rec in recs]
        ops: list[Op] = []
        append = ops.append
        position = index_of.__getitem__
        last_in_lane: dict[int, int] = {}
        for i, rec in enumerate(recs):
            step, _, okind, peer, flag, a, m, t, c, _, ch, after_seqs, sources = rec
            lane = lane_idx[i]
            # Keep only dependencies on other lanes: a lane runs its ops in order.
            after = tuple([j for j in map(position, after_seqs) if lane_idx[j] != lane]) if after_seqs else ()
            # Chunk posts keep the chunk's region (informational, for traces).
            append(make_op(okind, peer, flag, a, m, t, c, step, lane, ch, after, sources))
            last_in_lane[lane] = i
        max_step = max(max_step, recs[-1][0])  # sorted by step
        has_reads = any(op.kind != "post" for op in ops)
        if has_reads:
            last_step = ops[-1].step
            done_after = tuple(sorted(i for ln, i in last_in_lane.items() if ln != 0))
            ops.append(Op("post", -1, DONE_FLAG, 0, 0, -1, -1, last_step, 0, "nvlink", done_after))
        out_ranks.append(tuple(ops))
        nflags.append(rk.next_flag)
        nstreams.append(max(1, len(keys)))

    root = rank_of.get(plan.root) if plan.root is not None else None
    meta = {
        "tree_ranges": tuple(ranges),
        "steps": max_step + 1,
        "start_flag": START_FLAG,
        "done_flag": DONE_FLAG,
        "plan_collective": plan.collective,
        "gpus": tuple(plan.gpus),
        "channels": tuple(t.channel for t in plan.trees),
        # lanes[r][s] = (channel, peer rank): the incoming link lane s of rank r serves
        "lanes": tuple(lanes_meta),
        "lane_policy": lanes,
        "chunking": chunking,
    }
    return Program(
        kind=kind,
        nranks=n,
        count=count,
        chunk_elems=chunk_elems,
        ranks=tuple(out_ranks),
        nflags=tuple(nflags),
        nstreams=tuple(nstreams),
        segments=tuple(segments),
        root=root,
        meta=meta,
    )


def chunk_count(plan: Plan, count: int, chunk_elems: int) -> Sequence[int]:
    """Chunks per tree for ``count`` elements (empty trees: 0)."""
    ranges, _ = tree_ranges(plan, count)
    return [0 if hi <= lo else -(-(hi - lo) // chunk_elems) for lo, hi in ranges]
