"""The symbolic checker: run a program on symbols and prove it correct.

In the manner of MSCCLang's checker (``msccl/language/collectives.py``: each
collective states what the buffers hold before and after, and a program is run
on symbols before any byte moves), but for the pull-model IR of
:mod:`blink_horovod.schedule.program` and under the weakest executor the IR
allows: each rank runs several lanes, a lane runs its ops in order, and an op
also waits for its ``after`` ops and, for ``copy``/``reduce``, for the peer's
flag.  A sequential executor (each rank's ops in list order) is one schedule of
that model, so what holds here holds there too.

What is proved, and how:

1. *Structure*: peers, flags, lanes, regions and ``after`` indices in range;
   each flag posted at most once per rank; steps non-decreasing per rank.
2. *No deadlock, every awaited flag posted*: a scheduler runs any runnable op
   until none is left; ops left over are reported as the ranks that wait and
   the flags (or local ops) they wait on.
3. *The step contract*: every op waits only for a post of a strictly smaller
   step, which makes the sequential executor deadlock-free too.
4. *No races*: happens-before is tracked with vector clocks (Lamport 1978;
   Fidge/Mattern 1988) over lanes, with an edge from each post to the ops that
   wait for it.  Every read must happen after the last write of the data it
   reads (on the peer: the peer's post it waited for covers that write, or the
   peer's input), writes to one region must be ordered, and a write must come
   after every read of the old data.  With all conflicting accesses ordered,
   the symbolic result below is the result of *every* schedule.
5. *Result*: each region of each rank holds a set of input contributions
   (one bit per rank, so adding a contribution twice is caught at the reduce
   that does it).  allreduce: every rank holds the sum of all n inputs over the
   whole buffer; reduce: each segment's root holds the sum over its segment;
   broadcast: every rank holds the root's input (multi-root programs: rank r's
   input over rank r's segment).
6. *Done*: a rank that reads peers posts ``DONE_FLAG`` after all its reads,
   the "done" the next epoch waits for (program.py).

Work is per region, not per element: regions are the elementary intervals cut
by every op's boundaries, so a compiled program costs O(ops * lanes).

Results are cached (by program identity, then by the program's value), so the
runtime can call :func:`check_program` for every program it executes.
"""

from __future__ import annotations

import bisect
import heapq
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import ScheduleError
from ..planner.plan import CHANNELS, Plan
from .program import DONE_FLAG, PROGRAM_KINDS, Op, Program

__all__ = ["check_program", "clear_check_cache", "describe_op"]

_CACHE_MAX = 128
_lock = threading.Lock()
_by_value: OrderedDict[tuple[Program, Plan | None], None] = OrderedDict()
_by_id: dict[tuple[int, int], Any] = {}


def clear_check_cache() -> None:
    """Forget every program proved so far (tests)."""
    with _lock:
        _by_value.clear()
        _by_id.clear()


def describe_op(program: Program, rank: int, index: int) -> str:
    """``rank 3 op 17 (reduce tree 2 chunk 0 elements [0, 256) from rank 5 flag 4, step 3)``."""
    op = program.ranks[rank][index]
    parts = [op.kind]
    if op.tree >= 0:
        parts.append(f"tree {op.tree} chunk {op.chunk}")
    if op.kind == "post":
        parts.append(f"flag {op.flag}")
    elif op.kind == "fanin":
        srcs = ", ".join(f"rank {q} flag {f}" for q, f in op.peers)
        parts.append(f"elements [{op.offset}, {op.offset + op.count}) from {srcs}")
    else:
        parts.append(f"elements [{op.offset}, {op.offset + op.count}) from rank {op.peer} flag {op.flag}")
    parts.append(f"step {op.step}")
    return f"rank {rank} op {index} ({' '.join(parts[:1])} {', '.join(parts[1:])})"


def check_program(program: Program, plan: Plan | None = None) -> None:
    """Prove ``program`` correct, or raise :class:`ScheduleError` naming the rank and op.

    Parameters
    ----------
    program : Program
        As compiled by :func:`blink_horovod.schedule.compile_program` or built
        by hand.
    plan : Plan, optional
        When given, also check that every transfer follows an edge of the tree
        it names, on that tree's channel, and that the ranks and segments match
        the plan.

    Raises
    ------
    ScheduleError
        on the first violation found: a malformed op, a deadlock (which ranks
        wait on which flag), an op that waits for a post of a step not smaller
        than its own, a read of data not yet posted, a write race, a double
        reduction, or a wrong final result.

    Notes
    -----
    A program that passed once is remembered: a second call with the same
    program object costs a dictionary lookup, with an equal program one hash.
    """
    id_key = (id(program), id(plan))
    with _lock:
        hit = _by_id.get(id_key)
        if hit is not None and hit[0]() is program and hit[1]() is plan:
            return
        value_key = (program, plan)
        try:
            if value_key in _by_value:
                _by_value.move_to_end(value_key)
                _remember_id(program, plan, id_key)
                return
        except TypeError:  # unhashable contents (a hand-built program with lists): just check it
            value_key = None  # type: ignore[assignment]
    _Checker(program, plan).run()
    with _lock:
        if value_key is not None:
            _by_value[value_key] = None
            while len(_by_value) > _CACHE_MAX:
                _by_value.popitem(last=False)
        _remember_id(program, plan, id_key)


def _remember_id(program: Program, plan: Plan | None, key: tuple[int, int]) -> None:
    try:
        ref_prog = weakref.ref(program, lambda _r, k=key: _by_id.pop(k, None))
        ref_plan = (lambda: None) if plan is None else weakref.ref(plan, lambda _r, k=key: _by_id.pop(k, None))
    except TypeError:
        return
    _by_id[key] = (ref_prog, ref_plan)
    if len(_by_id) > 4 * _CACHE_MAX:
        _by_id.pop(next(iter(_by_id)))


def _contributions(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


class _Checker:
    def __init__(self, program: Program, plan: Plan | None) -> None:
        self.p = program
        self.plan = plan

    def fail(self, msg: str) -> None:
        raise ScheduleError(f"{self.p.kind} program ({self.p.nranks} ranks, {self.p.count} elements): {msg}")

    def op(self, r: int, i: int) -> str:
        return describe_op(self.p, r, i)

    # -- 1. structure -------------------------------------------------------
    def check_structure(self) -> None:
        p = self.p
        n = p.nranks
        if p.kind not in PROGRAM_KINDS:
            self.fail(f"kind: expected one of {', '.join(PROGRAM_KINDS)}, got {p.kind!r}")
        if not isinstance(n, int) or n < 1:
            self.fail(f"nranks: expected a positive integer, got {n!r}")
        for name in ("ranks", "nflags", "nstreams"):
            if len(getattr(p, name)) != n:
                self.fail(f"{name}: {len(getattr(p, name))} entries for {n} ranks")
        if not isinstance(p.count, int) or p.count < 0:
            self.fail(f"count: expected a non-negative integer, got {p.count!r}")
        if p.root is not None and not (0 <= p.root < n):
            self.fail(f"root: rank {p.root} is not in 0..{n - 1}")
        if p.segments and len(p.segments) != n:
            self.fail(f"segments: {len(p.segments)} entries for {n} ranks")
        for r, (lo, hi) in enumerate(p.segments):
            if not (0 <= lo <= hi <= p.count):
                self.fail(f"segments[{r}]: [{lo}, {hi}) is not inside [0, {p.count})")
        self.poster: dict[tuple[int, int], int] = {}
        for r, ops in enumerate(p.ranks):
            last_step = None
            for i, op in enumerate(ops):
                if not isinstance(op, Op):
                    self.fail(f"rank {r} op {i}: expected an Op, got {op!r}")
                if op.kind not in ("post", "copy", "reduce", "fanin"):
                    self.fail(f"rank {r} op {i}: kind {op.kind!r} is not post, copy, reduce or fanin")
                if op.kind == "fanin":
                    qs = [q for q, _ in op.peers]
                    if len(qs) < 1 or len(set(qs)) != len(qs) or (op.peer, op.flag) != tuple(op.peers[0]):
                        self.fail(f"{self.op(r, i)}: peers {op.peers!r} must list distinct (peer, flag) pairs, the first one (peer, flag)")
                elif op.peers:
                    self.fail(f"{self.op(r, i)}: peers {op.peers!r} given for a {op.kind} op (fanin only)")
                if op.channel not in CHANNELS:
                    self.fail(f"{self.op(r, i)}: channel {op.channel!r} is not one of {', '.join(CHANNELS)}")
                if not (0 <= op.stream < p.nstreams[r]):
                    self.fail(f"{self.op(r, i)}: stream {op.stream} outside the rank's {p.nstreams[r]} lanes")
                for j in op.after:
                    if not (0 <= j < i):
                        self.fail(f"{self.op(r, i)}: after index {j} is not an earlier op of rank {r}")
                if last_step is not None and op.step < last_step:
                    self.fail(f"{self.op(r, i)}: step {op.step} after step {last_step}: ops must be sorted by step")
                last_step = op.step
                if op.kind == "post":
                    if not (0 <= op.flag < p.nflags[r]):
                        self.fail(f"{self.op(r, i)}: flag {op.flag} outside the rank's {p.nflags[r]} flags")
                    if (r, op.flag) in self.poster:
                        self.fail(
                            f"{self.op(r, i)}: flag {op.flag} already posted by op {self.poster[(r, op.flag)]}; "
                            "a flag may be posted once per epoch"
                        )
                    self.poster[(r, op.flag)] = i
                else:
                    for q, f in op.sources():
                        if not (0 <= q < n) or q == r:
                            self.fail(f"{self.op(r, i)}: peer {q} is not another rank of 0..{n - 1}")
                        if not (0 <= f < p.nflags[q]):
                            self.fail(f"{self.op(r, i)}: flag {f} outside rank {q}'s {p.nflags[q]} flags")
                    if op.count < 1 or op.offset < 0 or op.offset + op.count > p.count:
                        self.fail(f"{self.op(r, i)}: region [{op.offset}, {op.offset + op.count}) is empty or outside [0, {p.count})")

    # -- plan conformance -----------------------------------------------------
    def check_plan(self) -> None:
        plan, p = self.plan, self.p
        assert plan is not None
        if plan.n != p.nranks:
            self.fail(f"nranks: {p.nranks} ranks, the plan has {plan.n} GPUs")
        if plan.collective == "allreduce" and p.segments:
            n = p.nranks
            for r, seg in enumerate(p.segments):
                want = (r * p.count // n, (r + 1) * p.count // n)
                if tuple(seg) != want:
                    self.fail(f"segments[{r}]: {tuple(seg)}, the cross-server stage needs exactly {want}")
        edges: list[set[tuple[int, int]]] = []
        rank_of = {g: i for i, g in enumerate(plan.gpus)}
        for tree in plan.trees:
            edges.append({(rank_of[a], rank_of[b]) for a, b in tree.edges})
        for r, i, op in p.ops():
            if op.kind == "post":
                continue
            if not (0 <= op.tree < len(plan.trees)):
                self.fail(f"{self.op(r, i)}: tree {op.tree} is not a tree of the plan")
            tree = plan.trees[op.tree]
            if op.channel != tree.channel:
                self.fail(f"{self.op(r, i)}: moves on {op.channel}, tree {op.tree} is on {tree.channel}")
            e = edges[op.tree]
            for q, _ in op.sources():
                up = op.kind in ("reduce", "fanin") and (r, q) in e  # child -> parent
                downward = op.kind == "copy" and (q, r) in e  # parent -> child
                if not (up or downward):
                    rel = "parent" if op.kind == "copy" else "child"
                    self.fail(
                        f"{self.op(r, i)}: rank {q} (GPU {plan.gpus[q]}) is not the {rel} of rank {r} "
                        f"(GPU {plan.gpus[r]}) in tree {op.tree}"
                    )

    # -- 2..6 -----------------------------------------------------------------
    def run(self) -> None:
        self.check_structure()
        if self.plan is not None:
            self.check_plan()
        p = self.p
        n = p.nranks
        ranks = p.ranks
        total_ops = sum(len(o) for o in ranks)

        # Lanes: (rank, stream), plus one "input" lane per rank: the executor's
        # placing of the input, before any op of that rank.
        lane_base = []
        nl = 0
        for r in range(n):
            lane_base.append(nl)
            nl += max(1, p.nstreams[r])
        input_lane = [nl + r for r in range(n)]
        nl += n

        # Dependencies: lane predecessor, after, and the awaited post.
        succ: dict[tuple[int, int], list[tuple[int, int]]] = {}
        pending: list[list[int]] = []
        # Runnable ops, earliest step first: the order a sequential executor
        # would favour, so a race shows as the read that comes too early.
        ready: list[tuple[int, int, int]] = []
        self.waits_on: dict[tuple[int, int], tuple[int, int]] = {}
        unposted: dict[tuple[int, int], tuple[int, int]] = {}
        # How many later ops still need an op's vector clock (its `after` users and
        # waiters); clocks are dropped once used, so memory follows the pipeline's
        # width, not the program's length.
        vc_refs: dict[tuple[int, int], int] = {}
        for r, ops in enumerate(ranks):
            last_of_lane: dict[int, int] = {}
            row = []
            for i, op in enumerate(ops):
                deps = set(op.after)
                for j in deps:
                    vc_refs[(r, j)] = vc_refs.get((r, j), 0) + 1
                prev = last_of_lane.get(op.stream)
                if prev is not None:
                    deps.add(prev)
                last_of_lane[op.stream] = i
                cnt = len(deps)
                for j in deps:
                    succ.setdefault((r, j), []).append((r, i))
                waits = []
                for q, f in op.sources():
                    src = self.poster.get((q, f))
                    if src is None:
                        unposted.setdefault((r, i), (q, f))
                    else:
                        waits.append((q, src))
                        vc_refs[(q, src)] = vc_refs.get((q, src), 0) + 1
                        succ.setdefault((q, src), []).append((r, i))
                    cnt += 1  # an unposted flag is never satisfied
                if waits:
                    self.waits_on[(r, i)] = waits
                row.append(cnt)
                if cnt == 0:
                    ready.append((op.step, r, i))
            pending.append(row)

        # Elementary intervals.
        bounds = {0, p.count}
        for _, _, op in p.ops():
            if op.kind != "post":  # copy, reduce, fanin
                bounds.add(op.offset)
                bounds.add(op.offset + op.count)
        self.bnd = sorted(bounds)
        nint = len(self.bnd) - 1
        # Symbolic state: value[r][x] is a bitmask of contributing inputs.
        value = [[1 << r] * nint for r in range(n)]
        last_write: list[list[tuple[int, int] | None]] = [[None] * nint for _ in range(n)]
        readers: list[list[list[tuple[int, int]] | None]] = [[None] * nint for _ in range(n)]
        self.label: list[tuple[int, int] | None] = [None] * nint

        vcs: dict[tuple[int, int], np.ndarray] = {}
        lane_cnt: dict[tuple[int, int], int] = {}
        lane_of: dict[tuple[int, int], int] = {}
        counters = [0] * nl
        lane_last_vc: dict[int, np.ndarray] = {}
        done_vc: dict[int, np.ndarray] = {}
        base_vc = []
        for r in range(n):
            v = np.zeros(nl, dtype=np.int32)
            v[input_lane[r]] = 1
            base_vc.append(v)

        def hb(a: tuple[int, int] | None, owner: int, b_vc: np.ndarray) -> bool:
            """Does event ``a`` (None: the input of rank ``owner``) happen before the op with ``b_vc``?"""
            if a is None:
                return b_vc[input_lane[owner]] >= 1
            return b_vc[lane_of[a]] >= lane_cnt[a]

        done = 0
        bisect_left = bisect.bisect_left
        bnd = self.bnd
        heapq.heapify(ready)
        heappop, heappush = heapq.heappop, heapq.heappush
        while ready:
            _, r, i = heappop(ready)
            key = (r, i)
            op = ranks[r][i]
            # Vector clock: join of the predecessors, then tick this op's lane.
            ln = lane_base[r] + op.stream
            # the lane predecessor is the last op executed on this lane
            vc = lane_last_vc[ln].copy() if counters[ln] else base_vc[r].copy()
            preds = [(r, j) for j in op.after]
            if op.kind != "post":
                preds.extend(self.waits_on[key])
            for pk in preds:
                np.maximum(vc, vcs[pk], out=vc)
                left = vc_refs[pk] - 1
                if left:
                    vc_refs[pk] = left
                else:
                    del vc_refs[pk], vcs[pk]
            counters[ln] += 1
            vc[ln] = counters[ln]
            if key in vc_refs:
                vcs[key] = vc
            if op.kind == "post" and op.flag == DONE_FLAG:
                done_vc[r] = vc
            lane_of[key] = ln
            lane_cnt[key] = counters[ln]
            lane_last_vc[ln] = vc
            if op.kind != "post":
                srcs = [q for q, _ in op.sources()]
                x0 = bisect_left(bnd, op.offset)
                x1 = bisect_left(bnd, op.offset + op.count)
                vr = value[r]
                lwr = last_write[r]
                rdr = readers[r]
                for x in range(x0, x1):
                    if self.label[x] is None and op.tree >= 0:
                        self.label[x] = (op.tree, op.chunk)
                    # the reads of B_q[x]
                    for q in srcs:
                        w = last_write[q][x]
                        if not hb(w, q, vc):
                            self.fail_read(r, i, q, x, w)
                        lst = readers[q][x]
                        if lst is None:
                            readers[q][x] = [key]
                        else:
                            lst.append(key)
                    # the write of B_r[x]
                    w = lwr[x]
                    if w is not None and not hb(w, r, vc):
                        self.fail(
                            f"write race: {self.op(r, i)} and {self.op(*w)} both write rank {r}'s elements "
                            f"{self.region(x)} and nothing orders them (a missing `after` or wait)"
                        )
                    lst = rdr[x]
                    if lst:
                        for rd in lst:
                            if not hb(rd, rd[0], vc):
                                self.fail(
                                    f"write race: {self.op(r, i)} overwrites rank {r}'s elements {self.region(x)} "
                                    f"while {self.op(*rd)} may still read them (no post/wait orders the read first)"
                                )
                        rdr[x] = None
                    lwr[x] = key
                    if op.kind == "copy":
                        vr[x] = value[srcs[0]][x]
                    else:
                        for q in srcs:
                            vq = value[q]
                            if vr[x] & vq[x]:
                                twice = _contributions(vr[x] & vq[x])
                                self.fail(
                                    f"double reduction: {self.op(r, i)} adds the inputs of ranks {twice} to rank {r}'s "
                                    f"elements {self.region(x)}, which already hold them"
                                )
                            vr[x] |= vq[x]
            done += 1
            for nxt in succ.get(key, ()):
                row = pending[nxt[0]]
                row[nxt[1]] -= 1
                if row[nxt[1]] == 0:
                    heappush(ready, (ranks[nxt[0]][nxt[1]].step, nxt[0], nxt[1]))
        if done != total_ops:
            self.fail_deadlock(pending, unposted)
        self.check_steps()
        self.check_done(done_vc, lane_of, lane_cnt)
        self.check_result(value)

    def region(self, x: int) -> str:
        lab = self.label[x] if x < len(self.label) else None
        where = f" (tree {lab[0]} chunk {lab[1]})" if lab else ""
        return f"[{self.bnd[x]}, {self.bnd[x + 1]}){where}"

    def fail_read(self, r: int, i: int, q: int, x: int, w: tuple[int, int] | None) -> None:
        op = self.p.ranks[r][i]
        if w is None:
            what = f"rank {q}'s input, but no post of rank {q} it waits for (directly or through others) comes after the input is placed"
        else:
            what = f"what {self.op(*w)} writes there, but the post it waits for (rank {q} flag {op.flag}) does not cover that write"
        self.fail(f"read before post: {self.op(r, i)} reads rank {q}'s elements {self.region(x)}, expecting {what}")

    def fail_deadlock(self, pending: list[list[int]], unposted: dict[tuple[int, int], tuple[int, int]]) -> None:
        causes, blocked = [], []
        for r, row in enumerate(pending):
            stuck = [i for i, c in enumerate(row) if c > 0]
            if not stuck:
                continue
            # Every earlier op of the rank ran, so its first stuck op waits for a peer's flag.
            i = stuck[0]
            if (r, i) in unposted:
                q, f = unposted[(r, i)]
                causes.append(f"{self.op(r, i)} waits for rank {q} flag {f}, which rank {q} never posts")
            elif (r, i) in self.waits_on:
                q, j = self.waits_on[(r, i)][0]
                blocked.append(f"{self.op(r, i)} waits for rank {q} flag {self.p.ranks[q][j].flag}, posted by {self.op(q, j)}, which never runs")
            else:
                blocked.append(f"{self.op(r, i)} waits for an op of its own lane or `after` that never runs")
        # Where no flag is missing, the waits form a cycle.
        head = "" if causes else "the waits form a cycle; "
        lines = causes + blocked
        self.fail("deadlock: no op can run; " + head + "; ".join(lines[:8]) + ("; ..." if len(lines) > 8 else ""))

    # -- 3. steps -------------------------------------------------------------
    def check_steps(self) -> None:
        ranks = self.p.ranks
        for (r, i), waits in self.waits_on.items():
            for q, j in waits:
                s, t = ranks[r][i].step, ranks[q][j].step
                if t >= s:
                    self.fail(
                        f"{self.op(r, i)} waits for {self.op(q, j)} of step {t} >= {s}: an op may wait only for posts of "
                        "smaller steps (a sequential executor would deadlock)"
                    )

    # -- 6. done --------------------------------------------------------------
    def check_done(self, done_vc: dict[int, np.ndarray], lane_of: dict, lane_cnt: dict) -> None:
        for r, ops in enumerate(self.p.ranks):
            reads = [i for i, op in enumerate(ops) if op.kind != "post"]
            if not reads:
                continue
            d = self.poster.get((r, DONE_FLAG))
            if d is None:
                self.fail(f"rank {r} reads peers but never posts DONE_FLAG ({DONE_FLAG}), which the next epoch waits for")
            dvc = done_vc[r]
            for i in reads:
                if dvc[lane_of[(r, i)]] < lane_cnt[(r, i)]:
                    self.fail(
                        f"{self.op(r, d)} (DONE) does not come after {self.op(r, i)}: "
                        "the next epoch could overwrite data still being read"
                    )

    # -- 5. result ------------------------------------------------------------
    def check_result(self, value: list[list[int]]) -> None:
        p = self.p
        n = p.nranks
        full = (1 << n) - 1
        nint = len(self.bnd) - 1
        if p.kind == "allreduce":
            for r in range(n):
                for x in range(nint):
                    if value[r][x] != full:
                        self.fail_value(r, x, value[r][x], full, "the sum of every rank's input")
        elif p.kind == "reduce":
            segs = self._segments()
            for owner, (lo, hi) in enumerate(segs):
                for x in self._intervals(lo, hi):
                    if value[owner][x] != full:
                        self.fail_value(owner, x, value[owner][x], full, f"the sum of every rank's input (rank {owner} roots [{lo}, {hi}))")
        else:
            if p.root is not None:
                want = 1 << p.root
                for r in range(n):
                    for x in range(nint):
                        if value[r][x] != want:
                            self.fail_value(r, x, value[r][x], want, f"root rank {p.root}'s input")
            else:
                for owner, (lo, hi) in enumerate(self._segments()):
                    for x in self._intervals(lo, hi):
                        for r in range(n):
                            if value[r][x] != 1 << owner:
                                self.fail_value(r, x, value[r][x], 1 << owner, f"rank {owner}'s segment [{lo}, {hi})")

    def _segments(self) -> list[tuple[int, int]]:
        p = self.p
        segs = list(p.segments)
        if not segs:
            n = p.nranks
            segs = [(r * p.count // n, (r + 1) * p.count // n) for r in range(n)]
        # Segments must cover the buffer once, or part of it would be unchecked.
        covered = sorted((lo, hi) for lo, hi in segs if hi > lo)
        pos = 0
        for lo, hi in covered:
            if lo != pos:
                self.fail(f"segments: {segs} do not partition [0, {p.count}) (gap or overlap at {pos})")
            pos = hi
        if pos != p.count:
            self.fail(f"segments: {segs} do not cover [0, {p.count})")
        return segs

    def _intervals(self, lo: int, hi: int) -> range:
        return range(bisect.bisect_left(self.bnd, lo), bisect.bisect_left(self.bnd, hi))

    def fail_value(self, r: int, x: int, got: int, want: int, what: str) -> None:
        have = _contributions(got)
        missing = _contributions(want & ~got)
        extra = _contributions(got & ~want)
        detail = f"holds the inputs of ranks {have}"
        if missing:
            detail += f", missing {missing}"
        if extra:
            detail += f", extra {extra}"
        self.fail(f"wrong result: rank {r} elements {self.region(x)} {detail}; expected {what} (a dropped or misdirected op)")
