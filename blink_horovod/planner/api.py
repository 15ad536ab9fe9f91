"""``make_plan``: from the links a job got to a provably optimal, few-tree plan.

The stages, per channel (Blink, section 3; docs/architecture.md):

1. the channel's resource model (:mod:`.network`): NVLink links and switch
   ports, or the PCIe tree of switches;
2. Blink's MWU packing (:mod:`.mwu`, Garg–Könemann) for candidate trees;
3. the exact optimum by column generation (:mod:`.optimum`), seeded with the
   MWU trees and shallow seed trees, with an LP-duality certificate;
4. the few-tree refinement (:mod:`.refine`) that keeps >= 0.9999 x optimum;

then, across channels, the hybrid split (:mod:`.hybrid`, section 3.4) and,
for allreduce, the multi-root layout (:mod:`.layout`): GPU i roots exactly
the i-th 1/n of the bytes.  ``rate_gbps`` is the finished plan's own
bandwidth-model rate (:mod:`.load`).

Plans are deterministic: they depend on the topology, collective, root and
channels only (effort limits are iteration and node counts, never seconds),
so every rank that plans the same allocation gets the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError
from ..topology.model import Topology
from .hybrid import channel_shares
from .layout import multi_root, orient
from .load import predicted_rate
from .mwu import mwu_packing
from .network import Network, TreeKey, channel_network
from .optimum import optimal_packing
from .plan import CHANNELS, COLLECTIVES, Plan, Tree, validate_plan
from .refine import fewest_trees, tight_trees

__all__ = ["PlannerSettings", "available_channels", "make_plan", "plan_channel"]


@dataclass(frozen=True)
class PlannerSettings:
    """Effort knobs (deterministic: counts, never seconds)."""

    mwu_eps: float = 0.1
    mwu_iterations: int = 600  # for up to 8 GPUs; fewer above (see mwu_budget)
    tight_samples: int = 64
    milp_nodes: int = 50
    seed: int = 0

    def mwu_budget(self, n: int) -> int:
        """MWU iterations for ``n`` GPUs: each costs a spanning-tree call, O(n^2) and up."""
        return self.mwu_iterations if n <= 8 else max(100, self.mwu_iterations * 8 // n)

    def tight_budget(self, n: int) -> int:
        return self.tight_samples if n <= 16 else max(16, self.tight_samples * 16 // n)


DEFAULT_SETTINGS = PlannerSettings()


@dataclass
class ChannelPlan:
    """One channel's packing: trees (vertex-index keys) with rates, and how it was found."""

    channel: str
    network: Network
    optimum: float
    upper_bound: float
    trees: list[TreeKey]
    x: np.ndarray
    info: dict = field(default_factory=dict)


def available_channels(topology: Topology) -> tuple[str, ...]:
    """The channels ``topology`` has: ``nvlink`` if it has NVLink links, ``pcie`` if it has a PCIe channel."""
    out = []
    if topology.has_kind("nvlink"):
        out.append("nvlink")
    if topology.pcie is not None:
        out.append("pcie")
    return tuple(out)


def _resolve_channels(topology: Topology, channels: Sequence[str] | str | None) -> tuple[str, ...]:
    if channels is None:
        have = available_channels(topology)
        return have or ("nvlink",)
    if isinstance(channels, str):
        channels = [c.strip() for c in channels.split(",")]
    chosen = []
    for c in channels:
        if c not in CHANNELS:
            raise PlanError(f"channels: unknown channel {c!r} (expected one of {', '.join(CHANNELS)})")
        if c not in chosen:
            chosen.append(c)
    if not chosen:
        raise PlanError(f"channels: empty channel list {list(channels)!r}")
    if "pcie" in chosen and topology.pcie is None:
        raise PlanError(f"channels: topology {topology.name!r} has no pcie channel (asked for {','.join(chosen)})")
    return tuple(c for c in CHANNELS if c in chosen)


def _shallow_seeds(net: Network, root: int) -> list[TreeKey]:
    """Breadth-first trees: from every vertex (allreduce) or root -> v -> the rest (broadcast).

    On a switch these are the one-hop stars and two-level trees that reach the
    optimum with the least depth; elsewhere they are cheap, diverse starts.
    """
    n = net.n
    adj = [[v for v in range(n) if v != u and net.pair_index[u, v] >= 0] for u in range(n)]

    def bfs(starts: list[tuple[int, int]], seen: set[int], frontier: list[int]) -> list[tuple[int, int]] | None:
        edges = list(starts)
        while frontier:
            nxt = []
            for u in frontier:
                for v in adj[u]:
                    if v not in seen:
                        seen.add(v)
                        edges.append((u, v))
                        nxt.append(v)
            frontier = nxt
        return edges if len(seen) == n else None

    out: list[TreeKey] = []
    if net.directed:
        t = bfs([], {root}, [root])
        if t is not None:
            out.append(net.canonical(t))
        for v in adj[root]:
            t = bfs([(root, v)], {root, v}, [v])
            if t is not None:
                out.append(net.canonical(t))
    else:
        for c in range(n):
            t = bfs([], {c}, [c])
            if t is not None:
                out.append(net.canonical(t))
    return list(dict.fromkeys(out))


def plan_channel(net: Network, root: int, shallow: bool, settings: PlannerSettings = DEFAULT_SETTINGS) -> ChannelPlan:
    """Pack one channel: MWU candidates, exact optimum, few-tree refinement."""
    seeds = _shallow_seeds(net, root)
    mwu = mwu_packing(net, settings.mwu_eps, root, max_iterations=settings.mwu_budget(net.n))
    opt = optimal_packing(net, list(mwu.trees) + seeds, root)
    rng = np.random.default_rng(settings.seed)
    tight = tight_trees(net, opt.duals, root, settings.tight_budget(net.n), rng)
    refined = fewest_trees(
        net,
        # most promising first: the pool is capped
        tight + seeds + opt.columns + list(mwu.trees),
        opt,
        root,
        shallow=shallow,
        effort=settings.milp_nodes,
    )
    info = {
        "mwu_trees": len(mwu.trees),
        "mwu_iterations": mwu.iterations,
        "mwu_complete": mwu.complete,
        "mwu_gbps": mwu.value,
        "lp_trees": len(opt.trees),
        "column_generation_rounds": opt.iterations,
        "candidates": refined.candidates,
        "refinement": refined.method,
    }
    return ChannelPlan(net.channel, net, opt.value, opt.upper_bound, refined.trees, refined.x, info)


def _disconnected(net: Network) -> str:
    parts = net.components()
    return " | ".join("{" + ", ".join(map(str, p)) + "}" for p in parts)


def _stars(plan: Plan, topology: Topology, packed: list[ChannelPlan], collective: str) -> tuple[Plan, float] | None:
    """The one-hop allreduce plan on a switch (every GPU roots a star over its own 1/n), when it reaches
    the packing's rate: n trees, the fewest a multi-root allreduce has, each one hop deep, which is the
    two-shot allreduce of vLLM and PyTorch's SymmetricMemory (and a GPU executor writes no partial sums
    on the way up)."""
    n = len(plan.gpus)
    if collective != "allreduce" or not topology.switches or n < 2 or len(plan.trees) <= n:
        return None
    if len(packed) != 1 or packed[0].channel != "nvlink":
        return None
    trees = tuple(Tree(g, 1.0 / n, tuple((g, c) for c in plan.gpus if c != g)) for g in plan.gpus)
    star = Plan(plan.collective, plan.topology, plan.gpus, plan.root, trees, 0.0, plan.optimum_gbps,
                plan.nvlink_optimum_gbps, plan.channels, plan.extras)
    try:
        validate_plan(star, topology)
    except PlanError:
        return None
    rate = predicted_rate(star, topology)
    if rate < plan.optimum_gbps * (1 - 1e-9):
        return None
    plan.extras["one_hop"] = True
    return star, rate


def make_plan(
    topology: Topology,
    collective: str,
    root: int | None = None,
    channels: Sequence[str] | str | None = None,
    *,
    settings: PlannerSettings | None = None,
) -> Plan:
    """Plan ``collective`` on ``topology``: weighted spanning trees at the proven optimum.

    Parameters
    ----------
    topology : the allocation (see :meth:`~blink_horovod.topology.model.Topology.allocate`).
    collective : ``"broadcast"`` or ``"allreduce"``.
    root : the broadcast root, a GPU id of ``topology.gpus`` (default: the first).
        An allreduce has no root; a value given is only checked.
    channels : ``nvlink``, ``pcie`` or both (a list or ``"nvlink,pcie"``); None:
        every channel the topology has.  ``pcie`` adds a share over PCIe sized
        so both channels finish together; where NVLink does not connect the
        GPUs, the plan is PCIe only.
    settings : effort knobs (tests and benchmarks).

    Returns
    -------
    Plan
        with ``optimum_gbps`` (the proven optimum over the requested channels),
        ``nvlink_optimum_gbps`` and ``rate_gbps`` (this plan's rate, >= 0.9999
        x optimum); ``extras`` say how it was found.

    Raises
    ------
    PlanError
        naming the value: unknown collective or channel, a root outside the
        allocation, GPUs that the requested channels do not connect.

    Examples
    --------
    >>> from blink_horovod.topology import machine
    >>> plan = make_plan(machine("dgx1v"), "broadcast", channels=["nvlink"])
    >>> round(plan.optimum_gbps, 6), len(plan.trees) <= 6
    (150.0, True)
    """
    settings = settings or DEFAULT_SETTINGS
    if not isinstance(topology, Topology):
        raise PlanError(f"topology: expected a Topology, got {type(topology).__name__}")
    if collective not in COLLECTIVES:
        raise PlanError(f"collective: expected one of {', '.join(COLLECTIVES)}, got {collective!r}")
    gpus = tuple(topology.gpus)
    if root is not None and (isinstance(root, bool) or not isinstance(root, (int, np.integer)) or int(root) not in gpus):
        raise PlanError(f"root: GPU {root!r} is not in the allocation {list(gpus)}")
    root_gpu = (gpus[0] if root is None else int(root)) if collective == "broadcast" else None
    wanted = _resolve_channels(topology, channels)
    # The plan cache's version: the package version and a hash of the planner's sources.
    from .cache import planner_version

    extras: dict = {"planner_version": planner_version()}
    if len(gpus) == 1:
        tree = Tree(gpus[0], 1.0, (), wanted[0])
        extras["note"] = "single GPU: nothing moves"
        return Plan(collective, topology.name, gpus, root_gpu, (tree,), 0.0, 0.0, 0.0, wanted, extras)
    root_idx = gpus.index(root_gpu) if root_gpu is not None else 0
    shallow = bool(topology.switches)
    packed: list[ChannelPlan] = []
    nvlink_opt = 0.0
    for ch in wanted:
        net = channel_network(topology, collective, ch)
        if not net.connected():
            if ch == "nvlink" and "pcie" in wanted:
                extras["nvlink_unused"] = f"NVLink does not connect GPUs {_disconnected(net)}"
                continue
            hint = " (add pcie to channels)" if ch == "nvlink" and topology.pcie is not None else ""
            raise PlanError(
                f"channels: {'NVLink' if ch == 'nvlink' else 'PCIe'} does not connect GPUs {_disconnected(net)} "
                f"of {topology.name}{hint}"
            )
        cp = plan_channel(net, root_idx, shallow and ch == "nvlink", settings)
        if ch == "nvlink":
            nvlink_opt = cp.optimum
        packed.append(cp)
    # Hybrid split (section 3.4): each channel's share in proportion to its rate.
    shares = channel_shares({cp.channel: float(cp.x.sum()) for cp in packed})
    weighted: list[tuple[str, TreeKey, float]] = []
    for cp in packed:
        total = float(cp.x.sum())
        for t, x in zip(cp.trees, cp.x):
            weighted.append((cp.channel, t, shares[cp.channel] * float(x) / total))
    trees = _lay_out(weighted, gpus, collective, root_idx)
    optimum = math.fsum(cp.optimum for cp in packed)
    plan = Plan(
        collective=collective,
        topology=topology.name,
        gpus=gpus,
        root=root_gpu,
        trees=tuple(trees),
        rate_gbps=0.0,
        optimum_gbps=_tidy(optimum),
        nvlink_optimum_gbps=_tidy(nvlink_opt),
        channels=wanted,
        extras=extras,
    )
    validate_plan(plan, topology)
    rate = predicted_rate(plan, topology)
    stars = _stars(plan, topology, packed, collective)
    if stars is not None:
        plan, rate = stars
    extras.update(
        {
            "optimum_upper_bound_gbps": _tidy(math.fsum(cp.upper_bound for cp in packed)),
            "channel_shares": {ch: shares[ch] for ch in shares},
            "channel_optimum_gbps": {cp.channel: _tidy(cp.optimum) for cp in packed},
            "distinct_trees": len(weighted),
            "trees_before_refinement": sum(cp.info["mwu_trees"] for cp in packed),
            "max_depth": max((_depth(t) for t in trees), default=0),
            "refinement": {cp.channel: cp.info for cp in packed},
        }
    )
    return Plan(
        collective=plan.collective,
        topology=plan.topology,
        gpus=plan.gpus,
        root=plan.root,
        trees=plan.trees,
        # The plan's own rate; float noise may put it a hair above the optimum.
        rate_gbps=_tidy(min(rate, optimum)),
        optimum_gbps=plan.optimum_gbps,
        nvlink_optimum_gbps=plan.nvlink_optimum_gbps,
        channels=plan.channels,
        extras=extras,
    )


def _lay_out(weighted: list[tuple[str, TreeKey, float]], gpus: tuple[int, ...], collective: str, root_idx: int) -> list[Tree]:
    """Plan trees in byte order: broadcast as they are, allreduce cut into owner-rooted pieces."""
    if collective == "broadcast":
        out = []
        for ch, key, f in weighted:
            edges = _bfs_order(key, root_idx)
            out.append(Tree(gpus[root_idx], f, tuple((gpus[p], gpus[c]) for p, c in edges), ch))
        return out
    pieces = multi_root([key for _, key, _ in weighted], [f for _, _, f in weighted], len(gpus))
    out = []
    for p in pieces:
        ch = weighted[p.index][0]
        edges = orient(p.tree, p.root)
        out.append(Tree(gpus[p.root], p.fraction, tuple((gpus[u], gpus[v]) for u, v in edges), ch))
    return out


def _bfs_order(key: TreeKey, root: int) -> list[tuple[int, int]]:
    kids: dict[int, list[int]] = {}
    for p, c in key:
        kids.setdefault(p, []).append(c)
    out, frontier = [], [root]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(kids.get(u, ())):
                out.append((u, v))
                nxt.append(v)
        frontier = nxt
    return out


def _depth(tree: Tree) -> int:
    return tree.depth()


def _tidy(x: float) -> float:
    """Round away float noise (12 significant digits): 149.99999999999997 -> 150.0."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.12g}")

