"""Run lowered command lists of every rank on numpy: the reference semantics of the GPU executor.

The GPU executor captures each rank's :class:`~.lowering.Lowered` commands as
a CUDA graph and launches one graph per epoch.  This interpreter executes the
same commands for all ranks in one process, modelling exactly what the graph
promises and nothing more:

* a command runs after its predecessor on its stream and, for ``join``, after
  the ``record`` of its event (the edges stream capture turns into graph
  edges); a rank's graph of epoch ``e`` starts after its graph of ``e - 1``
  ended (``same_stream``) or as soon as the host launched it (graphs on
  different streams);
* ``wait`` runs only once ``flags_peer[word] & mask != 0``; ``write`` stores
  the epoch's one-hot value, ``reset`` zeroes the program flags;
* among runnable commands one is picked at random (``seed``), so repeated runs
  walk different interleavings; with ``channels=k`` every rank's commands
  are first serialised, in a random order the graph's edges allow, onto ``k``
  FIFO queues, as CUDA may map graph branches onto few hardware queues: a
  blocked wait then blocks its whole queue (the deadlock the lowering's order
  edges prevent);
* with ``check_races`` every access of a buffer region is checked against
  earlier conflicting accesses (one of them a write): they must be ordered by
  happens-before (graph edges plus flag write -> satisfied wait), else
  :class:`~blink_horovod.errors.BlinkInternalError` names both commands.

Buffers are numpy arrays of the collective's dtype; reductions use
:func:`blink_horovod.runtime.dtypes.reduce_to` and ``average`` is finished
by :func:`~blink_horovod.runtime.dtypes.finish_average` inside ``stage_out``,
as the device kernels do.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...errors import BlinkInternalError
from ..dtypes import finish_average, reduce_to
from .lowering import (
    COPY,
    DONE_WORD,
    JOIN,
    RECORD,
    REDUCE,
    RESET,
    STAGE_IN,
    STAGE_OUT,
    WAIT,
    WRITE,
    Lowered,
    accept_mask,
    epoch_value,
)

__all__ = ["Launch", "World", "run_launches"]


@dataclass
class Launch:
    """One graph launch of one rank: the lowered program, its epoch, the user's tensor."""

    lowered: Lowered
    epoch: int
    user: np.ndarray
    op: str = "sum"
    dtype: str = "float32"


@dataclass
class World:
    """Device memory of the ranks: shared buffers and flag words (as the executor allocates them)."""

    buffers: list[np.ndarray]
    flags: list[np.ndarray]
    stats: dict = field(default_factory=dict)

    @classmethod
    def make(cls, nranks: int, capacity: int, nwords: int, dtype: np.dtype, epoch: int = 0) -> World:
        """Fresh memory; DONE words say ``epoch`` finished (the executor's initial state)."""
        flags = [np.zeros(nwords, dtype=np.uint32) for _ in range(nranks)]
        for f in flags:
            f[DONE_WORD] = epoch_value(epoch)
        # Garbage, not zeros, in fresh buffers: a read before a write must not look right.
        bufs = [np.full(capacity, 77, dtype=dtype) for _ in range(nranks)]
        return cls(bufs, flags)


class _Node:
    __slots__ = ("cmd", "deps", "done", "hb", "launch", "rank", "seq")

    def __init__(self, rank: int, launch: int, seq: int, cmd) -> None:
        self.rank, self.launch, self.seq, self.cmd = rank, launch, seq, cmd
        self.deps: list[int] = []
        self.done = False
        self.hb = 0


def _graph_nodes(r: int, k: int, lw: Lowered, base: int) -> list[_Node]:
    """Nodes of one graph with their intra-graph edges; checks the capture rules."""
    nodes = [_Node(r, k, base + i, c) for i, c in enumerate(lw.cmds)]
    last: dict[int, int] = {}
    record_at: dict[int, int] = {}
    for i, c in enumerate(lw.cmds):
        node = nodes[i]
        if c.stream in last:
            node.deps.append(base + last[c.stream])
        elif c.stream != 0 and c.kind != JOIN:
            raise BlinkInternalError(
                f"rank {r}: stream {c.stream} issues {c.kind} before joining the capture (it must wait on an event "
                "recorded on a capturing stream first)"
            )
        if c.kind == RECORD:
            if c.event in record_at:
                raise BlinkInternalError(f"rank {r}: event {c.event} recorded twice in one capture")
            record_at[c.event] = i
        elif c.kind == JOIN:
            if c.event not in record_at:
                raise BlinkInternalError(f"rank {r}: stream {c.stream} joins event {c.event} before it is recorded")
            node.deps.append(base + record_at[c.event])
        last[c.stream] = i
    # Every command must be an ancestor of the origin's last one (capture: all streams rejoined).
    final = last.get(0)
    if final is None:
        raise BlinkInternalError(f"rank {r}: nothing on the origin stream")
    reach = {base + final}
    for i in range(len(nodes) - 1, -1, -1):
        if nodes[i].seq in reach:
            reach.update(nodes[i].deps)
    lost = [nodes[i].cmd for i in range(len(nodes)) if nodes[i].seq not in reach]
    if lost:
        raise BlinkInternalError(f"rank {r}: {len(lost)} commands never rejoin the origin stream (first: {lost[0]})")
    return nodes


def run_launches(
    world: World,
    launches: Sequence[Sequence[Launch]],
    seed: int | None = 0,
    channels: int | None = None,
    same_stream: bool = True,
    check_races: bool = True,
    max_steps: int = 10_000_000,
) -> World:
    """Execute every rank's launches (``launches[r]`` in launch order) to the end.

    Raises
    ------
    BlinkInternalError
        on a deadlock (no command can run; the blocked waits are named), a
        race (two unordered conflicting accesses), or commands that break
        stream capture's rules.
    """
    n = len(launches)
    rng = random.Random(seed)
    nodes: list[_Node] = []
    graphs: list[list[tuple[int, int, Launch]]] = []  # rank -> [(first seq, end seq, launch)]
    for r, ls in enumerate(launches):
        g = []
        for k, la in enumerate(ls):
            if la.lowered.rank != r or la.lowered.nranks != n:
                raise BlinkInternalError(f"launch {k} of rank {r} holds the program of rank {la.lowered.rank}")
            if world.flags[r].size < la.lowered.nwords:
                raise BlinkInternalError(f"rank {r}: {world.flags[r].size} flag words, the program needs {la.lowered.nwords}")
            ns = _graph_nodes(r, k, la.lowered, len(nodes))
            g.append((len(nodes), len(nodes) + len(ns), la))
            nodes.extend(ns)
        graphs.append(g)
    owner = {}  # seq -> (rank, graph index)
    for r, g in enumerate(graphs):
        for k, (a, b, _) in enumerate(g):
            for s in range(a, b):
                owner[s] = (r, k)
    graph_left = [[b - a for a, b, _ in g] for g in graphs]
    graph_hb = [[0] * len(g) for g in graphs]

    # Successors and gates: a node is "released" once its edges are done (and, with
    # same_stream, once the rank's previous graph ended).
    succ: list[list[int]] = [[] for _ in nodes]
    missing = [len(nd.deps) for nd in nodes]
    for nd in nodes:
        for d in nd.deps:
            succ[d].append(nd.seq)
    gated: dict[tuple[int, int], list[int]] = {}
    released: list[int] = []
    for nd in nodes:
        if missing[nd.seq] == 0:
            if same_stream and nd.launch > 0:
                gated.setdefault((nd.rank, nd.launch), []).append(nd.seq)
            else:
                released.append(nd.seq)

    # Hardware queues: a random topological order per rank, dealt onto `channels` FIFOs.
    queues: list[list[list[int]]] | None = None
    if channels is not None:
        queues = []
        for r, g in enumerate(graphs):
            # Launches reach the queues in host order: graph k's commands all before graph k+1's.
            miss = {s: len(nodes[s].deps) for a, b, _ in g for s in range(a, b)}
            left_in = [b - a for a, b, _ in g]
            ready = [s for s, m in miss.items() if m == 0 and nodes[s].launch == 0]
            gate = {k: [s for s, m in miss.items() if m == 0 and nodes[s].launch == k] for k in range(1, len(g))}
            qs: list[list[int]] = [[] for _ in range(channels)]
            while ready:
                s = ready.pop(rng.randrange(len(ready)))
                qs[rng.randrange(channels)].append(s)
                for t in succ[s]:
                    miss[t] -= 1
                    if miss[t] == 0:
                        ready.append(t)
                k = nodes[s].launch
                left_in[k] -= 1
                if left_in[k] == 0 and k + 1 < len(g):
                    ready.extend(gate[k + 1])
            queues.append([q[::-1] for q in qs])  # reversed: pop() takes the head

    last_writer: dict[tuple[int, int], int] = {}
    accesses: dict[tuple, list[tuple[int, int, int, bool]]] = {}

    def mask_ok(node: _Node) -> bool:
        c = node.cmd
        la = graphs[node.rank][node.launch][2]
        return bool(int(world.flags[c.peer][c.word]) & accept_mask(la.epoch, c.accept))

    free = [False] * len(nodes)  # released: edges done, graph started
    for s0 in released:
        free[s0] = True
    ready_set: set[int] = set(released)

    def runnable(s: int) -> bool:
        return free[s] and not nodes[s].done and (nodes[s].cmd.kind != WAIT or mask_ok(nodes[s]))

    def access(node: _Node, key: tuple, lo: int, hi: int, write: bool) -> None:
        if not check_races or hi <= lo:
            return
        lst = accesses.setdefault(key, [])
        for p, a, b, w in lst:
            if (w or write) and a < hi and lo < b and p != node.seq and not (node.hb >> p) & 1:
                pc, pr = nodes[p].cmd, owner[p]
                raise BlinkInternalError(
                    f"race on {key}: [{lo}, {hi}) by rank {node.rank} graph {node.launch} {node.cmd} and "
                    f"[{a}, {b}) by rank {pr[0]} graph {pr[1]} {pc}, not ordered"
                )
        lst.append((node.seq, lo, hi, write))

    def execute(s: int) -> None:
        node = nodes[s]
        r, k = node.rank, node.launch
        la = graphs[r][k][2]
        c = node.cmd
        hb = 0
        for d in node.deps:
            hb |= nodes[d].hb | (1 << d)
        if same_stream and k > 0:
            hb |= graph_hb[r][k - 1]
        if c.kind == WAIT:
            w = last_writer.get((c.peer, c.word))
            if w is not None:
                hb |= nodes[w].hb | (1 << w)
        node.hb = hb
        own = world.buffers[r]
        a, b = c.offset, c.offset + c.count
        if c.kind == WRITE:
            world.flags[r][c.word] = epoch_value(la.epoch)
            last_writer[(r, c.word)] = s
        elif c.kind == RESET:
            world.flags[r][1:] = 0
            for wd in range(1, world.flags[r].size):
                last_writer[(r, wd)] = s
        elif c.kind == COPY:
            access(node, ("buf", c.peer), a, b, False)
            access(node, ("buf", r), a, b, True)
            own[a:b] = world.buffers[c.peer][a:b]
        elif c.kind == REDUCE:
            access(node, ("buf", c.peer), a, b, False)
            access(node, ("buf", r), a, b, True)
            reduce_to(own[a:b], own[a:b], world.buffers[c.peer][a:b], la.op, la.dtype)
        elif c.kind == STAGE_IN:
            u = c.user_offset
            access(node, ("user", r, k), u, u + c.count, False)
            access(node, ("buf", r), a, b, True)
            own[a:b] = la.user[u : u + c.count]
        elif c.kind == STAGE_OUT:
            u = c.user_offset
            access(node, ("buf", r), a, b, False)
            access(node, ("user", r, k), u, u + c.count, True)
            dst = la.user[u : u + c.count]
            dst[...] = own[a:b]
            if la.op == "average":
                finish_average(dst, n, la.dtype)
        node.done = True
        graph_left[r][k] -= 1
        graph_hb[r][k] |= hb | (1 << s)
        for t in succ[s]:
            missing[t] -= 1
            if missing[t] == 0 and (not same_stream or nodes[t].launch == 0 or graph_left[r][nodes[t].launch - 1] == 0):
                free[t] = True
                ready_set.add(t)
        if graph_left[r][k] == 0:
            for t in gated.get((r, k + 1), ()):
                free[t] = True
                ready_set.add(t)

    left = len(nodes)
    steps = 0
    if queues is None:
        while left:
            steps += 1
            if steps > max_steps:
                raise BlinkInternalError("interpreter: step limit reached")
            cands = sorted(s for s in ready_set if runnable(s))
            if not cands:
                _deadlock(nodes, sorted(ready_set), graphs, world)
            s = cands[rng.randrange(len(cands))] if seed is not None else cands[0]
            ready_set.discard(s)
            execute(s)
            left -= 1
    else:
        while left:
            steps += 1
            if steps > max_steps:
                raise BlinkInternalError("interpreter: step limit reached")
            heads = [(r, q) for r, qs in enumerate(queues) for q in range(len(qs)) if qs[q] and runnable(qs[q][-1])]
            if not heads:
                _deadlock(nodes, [qs[q][-1] for qs in queues for q in range(len(qs)) if qs[q]], graphs, world)
            r, q = heads[rng.randrange(len(heads))]
            s = queues[r][q].pop()
            execute(s)
            left -= 1
    world.stats["commands"] = len(nodes)
    return world


def _deadlock(nodes: list[_Node], blocked: list[int], graphs, world: World) -> None:
    waits = []
    for s in blocked:
        node = nodes[s]
        if node.cmd.kind == WAIT and not node.done:
            c = node.cmd
            la = graphs[node.rank][node.launch][2]
            waits.append(
                f"rank {node.rank} graph {node.launch} (epoch {la.epoch}) stream {c.stream} waits rank {c.peer} "
                f"word {c.word} mask {accept_mask(la.epoch, c.accept):#x} (holds {int(world.flags[c.peer][c.word]):#x})"
            )
    raise BlinkInternalError("interpreter: deadlock; " + ("; ".join(waits[:6]) or "no wait blocked (queue order)"))
