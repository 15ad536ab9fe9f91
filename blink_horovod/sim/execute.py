"""Run a compiled :class:`~blink_horovod.schedule.program.Program` on a topology, in simulation.

The program's semantics (schedule/program.py) become a task graph for the
fluid engine (engine.py):

- ops of one lane (``stream``) of a rank run in list order, as on a CUDA stream;
- an op also waits for the ops its ``after`` lists;
- a ``copy``/``reduce`` waits until the peer has posted ``flag`` (the first
  post of that flag sets it, as ``flags_peer[flag] >= epoch`` does), pays a
  fixed cost (params.py: ``copy_s``, plus ``reduce_extra_s`` for a reduction),
  then pulls ``count * itemsize`` bytes from the peer's GPU over its channel:
  NVLink (a direct bundle, or the two ports of a shared switch) or PCIe
  (resources.py); a reduction also loads the GPU's reduction rate;
- a ``post`` costs ``post_s`` and sets the rank's flag;
- the collective starts after one graph launch (``launch_s``); a program with
  PCIe ops first pays the channel switch (``pcie_switch_s`` per GPU pair that
  moves bytes over PCIe and that NVLink also joins), before its first PCIe op,
  as Blink's hybrid transfers do (Blink, section 3.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ScheduleError
from ..schedule.program import Program
from ..topology.model import Topology
from .engine import TaskGraph, run
from .params import DEFAULT_PARAMS, SimParams
from .resources import ResourceMap

__all__ = ["SimResult", "program_task_graph", "simulate_program"]


@dataclass
class SimResult:
    """One simulated collective."""

    time_s: float  # from launch to the last op's completion
    rank_finish_s: tuple[float, ...]  # per rank: its last op's completion
    ops: int  # operations simulated
    events: int  # engine events (a cost measure)
    bytes_per_resource: dict[str, float] = field(default_factory=dict)
    capacity_per_resource: dict[str, float] = field(default_factory=dict)  # bytes/s

    def utilization(self) -> dict[str, float]:
        """Fraction of each resource's capacity used over the whole collective."""
        if self.time_s <= 0:
            return {k: 0.0 for k in self.bytes_per_resource}
        return {k: b / (self.capacity_per_resource[k] * self.time_s) for k, b in self.bytes_per_resource.items()}


def program_task_graph(
    program: Program,
    resources: ResourceMap,
    gpus: Sequence[int],
    params: SimParams = DEFAULT_PARAMS,
    fold_posts: bool = True,
) -> tuple[TaskGraph, list[tuple[int, int]]]:
    """The task graph of ``program``; also the ``(rank, index)`` of every task (-1 for extras).

    ``fold_posts`` folds a post into the op it follows on its lane where that
    cannot change any time (a speed-up; the tests check both give one answer).
    """
    if len(gpus) != program.nranks:
        raise ScheduleError(f"gpus: program has {program.nranks} ranks, got {len(gpus)} GPU ids {list(gpus)}")
    g = TaskGraph()
    itemsize = params.itemsize
    where: list[tuple[int, int]] = []
    # Signal of (rank, flag): dense ids for the flags each rank declares (program.nflags), a dict for others.
    sig_base = [0] * (program.nranks + 1)
    nflags = tuple(program.nflags) + (0,) * max(0, program.nranks - len(program.nflags))
    for q in range(program.nranks):
        sig_base[q + 1] = sig_base[q] + max(0, nflags[q])
    g.nsignals = sig_base[-1]
    signals: dict[tuple[int, int], int] = {}
    new_signal = g.signal

    def sig(rank: int, flag: int) -> int:
        if 0 <= flag < nflags[rank]:
            return sig_base[rank] + flag
        key = (rank, flag)
        s = signals.get(key)
        if s is None:
            s = signals[key] = new_signal()
        return s

    # The PCIe channel switch, paid once before the first PCIe byte (Blink 3.4):
    # GPU pairs that NVLink joins must have peer access disabled for their
    # bytes to take PCIe; pairs without NVLink use PCIe anyway.  Collected below.
    pcie_pairs: set[frozenset[int]] = set()
    reduce_lat = params.copy_s + params.reduce_extra_s
    copy_lat = params.copy_s
    post_s = params.post_s
    # Appended straight to the graph's lists: this loop runs once per op.
    g_lat, g_bytes, g_tail, g_res, g_deps, g_waits, g_raises, g_tags = (
        g.latency, g.nbytes, g.tail, g.resources, g.deps, g.waits, g.raises, g.tags
    )
    route_of = resources.route
    reducer = resources.reducer
    nranks = program.nranks
    gate_deps: list[list[int]] = []  # pcie tasks: wired to the gate once its id is known
    for r, ops in enumerate(program.ranks):
        nops = len(ops)
        # A post that directly follows a copy/reduce on its lane, waits for
        # nothing else, and covers an op no other op waits for, is folded into
        # that op as a tail latency: the same timing, one task fewer.
        referenced: set[int] = set()
        for k, op in enumerate(ops):
            after = op.after
            if after:
                if min(after) < 0 or max(after) >= nops:
                    j = next(x for x in after if not 0 <= x < nops)
                    raise ScheduleError(f"rank {r} op {k}: after index {j} is outside the rank's {nops} ops")
                referenced.update(after)
        tid_of = [0] * nops
        last_in_lane: dict[int, int] = {}  # stream -> op index
        dst = gpus[r]
        # (peer, channel, kind) -> resources of a copy or reduce into this rank
        routes: dict[tuple[int, str, str], tuple[int, ...]] = {}
        for i, op in enumerate(ops):
            stream = op.stream
            prev = last_in_lane.get(stream)
            kind = op.kind
            after = op.after
            if (
                fold_posts
                and kind == "post"
                and prev is not None
                and ops[prev].kind != "post"
                and not after
                and prev not in referenced
                and g_raises[tid_of[prev]] < 0
            ):
                tid = tid_of[prev]
                g_tail[tid] += post_s
                g_raises[tid] = sig(r, op.flag)
                tid_of[i] = tid
                last_in_lane[stream] = i
                continue
            deps = [] if prev is None else [tid_of[prev]]
            if after:
                if max(after) >= i:
                    j = next(x for x in after if x >= i)
                    raise ScheduleError(f"rank {r} op {i}: after index {j} is not an earlier op")
                deps.extend([tid_of[j] for j in after])
            tid = len(g_lat)
            tid_of[i] = tid
            last_in_lane[stream] = i
            key = (r, i)
            if kind == "post":
                g_lat.append(post_s)
                g_bytes.append(0.0)
                g_res.append(())
                g_waits.append(())
                g_raises.append(sig(r, op.flag))
            elif kind == "fanin":
                # One kernel reads every source: one fixed cost once all flags
                # are up, then one flow per source, done when the last lands.
                srcs = op.peers
                for q, _ in srcs:
                    if not 0 <= q < nranks or q == r:
                        raise ScheduleError(f"rank {r} op {i}: peer {q} is not another rank of {nranks}")
                if op.channel == "pcie":
                    gate_deps.append(deps)
                    if resources.nvlink_connected(gpus[op.peer], dst):
                        pcie_pairs.add(frozenset((r, op.peer)))
                head = len(g_lat)
                g_lat.append(reduce_lat)
                g_bytes.append(0.0)
                g_res.append(())
                g_waits.append(tuple(sig(q, f) for q, f in srcs))
                g_raises.append(-1)
                g_tail.append(0.0)
                g_deps.append(deps)  # type: ignore[arg-type]
                g_tags.append((r, i, "head"))
                where.append(key)
                flows = []
                nb = float(op.count * itemsize)
                for q, _ in srcs:
                    flows.append(len(g_lat))
                    g_lat.append(0.0)
                    g_bytes.append(nb)
                    g_res.append(route_of(gpus[q], dst, op.channel) + (reducer(dst),))
                    g_waits.append(())
                    g_raises.append(-1)
                    g_tail.append(0.0)
                    g_deps.append([head])
                    g_tags.append((r, i, q))
                    where.append(key)
                tid = len(g_lat)
                tid_of[i] = tid
                g_lat.append(0.0)
                g_bytes.append(0.0)
                g_res.append(())
                g_waits.append(())
                g_raises.append(-1)
                deps = flows
            elif kind == "copy" or kind == "reduce":
                peer = op.peer
                channel = op.channel
                rkey = (peer, channel, kind)
                route = routes.get(rkey)
                if route is None:
                    if not 0 <= peer < nranks or peer == r:
                        raise ScheduleError(f"rank {r} op {i}: peer {peer} is not another rank of {nranks}")
                    route = route_of(gpus[peer], dst, channel)
                    if kind == "reduce":
                        route = route + (reducer(dst),)
                    routes[rkey] = route
                g_lat.append(reduce_lat if kind == "reduce" else copy_lat)
                if channel == "pcie":
                    gate_deps.append(deps)
                    if resources.nvlink_connected(gpus[peer], dst):
                        pcie_pairs.add(frozenset((r, peer)))
                nb = op.count * itemsize
                if nb < 0:
                    raise ScheduleError(f"rank {r} op {i}: negative count {op.count}")
                g_bytes.append(float(nb))
                g_res.append(route)
                g_waits.append((sig(peer, op.flag),))
                g_raises.append(-1)
            else:
                raise ScheduleError(f"rank {r} op {i}: unknown op kind {kind!r}")
            g_tail.append(0.0)
            g_deps.append(deps)  # type: ignore[arg-type]
            g_tags.append(key)
            where.append(key)
    gate_id = len(g_lat)
    for deps in gate_deps:
        deps.append(gate_id)
    if gate_deps:  # no NVLink pair among them: a gate of no latency
        g.add(params.pcie_switch_s * len(pcie_pairs), tag=("pcie-switch", len(pcie_pairs)))
        where.append((-1, -1))
    return g, where


def simulate_program(
    program: Program,
    topology: Topology,
    params: SimParams = DEFAULT_PARAMS,
    gpus: Sequence[int] | None = None,
    resources: ResourceMap | None = None,
    fold_posts: bool = True,
) -> SimResult:
    """Simulate ``program`` on ``topology`` (its rank r is GPU ``gpus[r]``).

    Parameters
    ----------
    program : Program
        From :func:`blink_horovod.schedule.compile_program` or built by hand.
    topology : Topology
        The machine (or allocation); links move bytes at their ``bandwidth_gbps``.
    params : SimParams
        Fixed costs (params.py).
    gpus : sequence of int, optional
        GPU id of each rank; default ``program.meta["gpus"]``, else the
        topology's first ``nranks`` GPUs.

    Returns
    -------
    SimResult
        ``time_s`` counts from the launch (``launch_s`` included).

    Raises
    ------
    ScheduleError
        when an op needs a link the topology lacks, or the program deadlocks.
    """
    if gpus is None:
        gpus = program.meta.get("gpus") or topology.gpus[: program.nranks]
    gpus = tuple(gpus)
    unknown = [x for x in gpus if x not in topology.gpus]
    if unknown:
        raise ScheduleError(f"gpus: GPU {unknown[0]} of the program is not on topology {topology.name!r}")
    rmap = resources if resources is not None else ResourceMap(topology, params)
    graph, where = program_task_graph(program, rmap, gpus, params, fold_posts)
    out = run(graph, rmap.capacity, t0=params.launch_s)
    rank_finish = np.full(program.nranks, params.launch_s)
    if where:
        owner = np.fromiter((r for r, _ in where), np.int64, len(where))
        mine = owner >= 0
        np.maximum.at(rank_finish, owner[mine], np.asarray(out.finish, np.float64)[mine])
    used = {rmap.names[k]: b for k, b in enumerate(out.resource_bytes) if b > 0}
    caps = {rmap.names[k]: rmap.capacity[k] for k, b in enumerate(out.resource_bytes) if b > 0}
    return SimResult(
        time_s=out.makespan,
        rank_finish_s=tuple(rank_finish.tolist()),
        ops=program.num_ops(),
        events=out.events,
        bytes_per_resource=used,
        capacity_per_resource=caps,
    )
