"""The capacitated resource model a packing is planned on, per channel and collective.

Blink (section 3.1) models GPUs as vertices and links as bandwidth-capacity
edges and packs spanning trees under those capacities.  This module turns a
:class:`~blink_horovod.topology.model.Topology` into the linear model every
planner stage shares (MWU, the exact column-generation LP, the MILP):

* **resources** ``r`` with capacities ``c_r`` (GB/s),
* **pairs** ``(u, v)`` of GPUs a tree edge may join, each with a **route**: how
  many bytes each resource carries per byte sent over the pair.

A packing then is ``max sum_t x_t  s.t.  sum_t x_t load(t, r) <= c_r`` where
``load(t, r)`` is the sum of the routes of tree ``t``'s edges.

Resources (docs/formats.md, Plan file):

* ``nvlink``, broadcast: each *direction* of each link (a tree's share flows
  parent -> child).  An edge ``[u, v]`` loads the link ``u -> v``, or, between
  GPUs that share a switch but no direct link, ``u -> switch`` and
  ``switch -> v``.  Where two GPUs share several switches the bytes are spread
  over them in proportion to the narrower port of each route (switch fabrics
  interleave traffic over their planes).
* ``nvlink``, allreduce: each *undirected* link with capacity ``min(c_uv,
  c_vu)``: a tree reduces up and broadcasts down, loading both directions of
  each of its links once, so a link is one resource.
* ``pcie``: the PCIe channel of the topology as a tree of switches (Blink,
  section 3.4; DGX-1 wiring): each GPU's x16 port to its group's PCIe switch,
  each group's uplink to the host, each of ``pcie.bandwidth_gbps`` per
  direction; a GPU in no group hangs off the host directly.  An edge may join
  any two GPUs and is routed up to their lowest common switch and down.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError
from ..topology.model import Topology

__all__ = ["Network", "TreeKey", "channel_network", "nvlink_network", "pcie_network"]

# A tree inside the planner: a sorted tuple of (parent, child) vertex *indices*
# (positions in Network.gpus).  For allreduce the pairs are (min, max): the tree
# is undirected there and rooted only when the plan is laid out.
TreeKey = tuple[tuple[int, int], ...]


@dataclass
class Network:
    """Resources, capacities and routes of one channel for one collective.

    Attributes
    ----------
    channel : ``"nvlink"`` or ``"pcie"``.
    collective : ``"broadcast"`` or ``"allreduce"``.
    gpus : the allocation; vertex ``i`` of every array is ``gpus[i]``.
    directed : True for broadcast (pairs are ordered), False for allreduce.
    resources : a readable name per resource, e.g. ``"0->3"``, ``"0-nvswitch0"``.
    capacity : ``(R,)`` GB/s per resource.
    pairs : ``(K, 2)`` vertex indices ``(u, v)`` an edge may join
        (allreduce: ``u < v``).
    route : ``(K, R)`` bytes per resource per byte over the pair.
    """

    channel: str
    collective: str
    gpus: tuple[int, ...]
    directed: bool
    resources: tuple[str, ...]
    capacity: np.ndarray
    pairs: np.ndarray
    route: np.ndarray
    pair_index: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.gpus)
        # pair_index[u, v] = row of route for an edge u -> v (both orders for
        # allreduce), -1 where no edge is possible.
        self.pair_index = np.full((n, n), -1, dtype=np.int64)
        for k, (u, v) in enumerate(self.pairs):
            self.pair_index[u, v] = k
            if not self.directed:
                self.pair_index[v, u] = k

    # -- sizes ---------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.gpus)

    @property
    def num_resources(self) -> int:
        return len(self.resources)

    # -- weights and loads ---------------------------------------------------
    def edge_weights(self, y: np.ndarray) -> np.ndarray:
        """``(n, n)`` matrix: the cost ``sum_r route(u, v, r) y_r`` of edge ``u -> v``; inf if absent."""
        w = self.route @ y
        out = np.full((self.n, self.n), np.inf)
        out[self.pairs[:, 0], self.pairs[:, 1]] = w
        if not self.directed:
            out[self.pairs[:, 1], self.pairs[:, 0]] = w
        return out

    def tree_load(self, tree: TreeKey) -> np.ndarray:
        """``(R,)`` bytes each resource carries per byte sent over ``tree``."""
        if not tree:
            return np.zeros(self.num_resources)
        idx = self.edge_rows(tree)
        return self.route[idx].sum(axis=0)

    def edge_rows(self, tree: Iterable[tuple[int, int]]) -> np.ndarray:
        """Rows of :attr:`route` for the edges of ``tree``; PlanError for a missing edge."""
        rows = []
        for u, v in tree:
            k = self.pair_index[u, v]
            if k < 0:
                raise PlanError(
                    f"edge [{self.gpus[u]}, {self.gpus[v]}]: no {self.channel} route between these GPUs"
                )
            rows.append(k)
        return np.asarray(rows, dtype=np.int64)

    def load_matrix(self, trees: Sequence[TreeKey]) -> np.ndarray:
        """``(R, T)``: column ``t`` is :meth:`tree_load` of ``trees[t]``."""
        if not trees:
            return np.zeros((self.num_resources, 0))
        return np.stack([self.tree_load(t) for t in trees], axis=1)

    def canonical(self, edges: Iterable[tuple[int, int]]) -> TreeKey:
        """The planner's key for a tree given as (parent, child) index pairs."""
        if self.directed:
            return tuple(sorted((int(u), int(v)) for u, v in edges))
        return tuple(sorted((int(min(u, v)), int(max(u, v))) for u, v in edges))

    # -- structure -----------------------------------------------------------
    def components(self) -> list[list[int]]:
        """Connected components of the GPUs (as GPU ids) joined by possible edges."""
        parent = list(range(self.n))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for u, v in self.pairs:
            ru, rv = find(int(u)), find(int(v))
            if ru != rv:
                parent[ru] = rv
        groups: dict[int, list[int]] = {}
        for i in range(self.n):
            groups.setdefault(find(i), []).append(self.gpus[i])
        return sorted(groups.values(), key=lambda g: self.gpus.index(g[0]))

    def connected(self) -> bool:
        return len(self.components()) == 1


class _Builder:
    """Collects resources and pair routes, then freezes them into a :class:`Network`."""

    def __init__(self, channel: str, collective: str, gpus: Sequence[int]) -> None:
        self.channel, self.collective, self.gpus = channel, collective, tuple(gpus)
        self.directed = collective == "broadcast"
        self.names: list[str] = []
        self.caps: list[float] = []
        self.index: dict[tuple[object, object], int] = {}
        self.routes: dict[tuple[int, int], dict[int, float]] = {}

    def resource(self, a: object, b: object, cap: float) -> None:
        """Declare the link a-b: two directed resources (broadcast) or one (allreduce)."""
        # Keys are typed tuples so a switch named "3" never meets GPU 3.
        keys = [((a, b), f"{a}->{b}"), ((b, a), f"{b}->{a}")] if self.directed else [((a, b), f"{a}-{b}")]
        for key, name in keys:
            if key in self.index:
                raise AssertionError(f"resource {name} declared twice")  # builder bug, not user input
            self.index[key] = len(self.names)
            self.names.append(name)
            self.caps.append(float(cap))

    def rid(self, a: object, b: object) -> int:
        """Resource id of moving bytes a -> b over the a-b link."""
        if self.directed:
            return self.index[(a, b)]
        return self.index[(a, b)] if (a, b) in self.index else self.index[(b, a)]

    def add_route(self, u: int, v: int, hops: dict[int, float]) -> None:
        self.routes[(u, v)] = hops

    def build(self) -> Network:
        keys = sorted(self.routes)
        route = np.zeros((len(keys), len(self.names)))
        for k, key in enumerate(keys):
            for r, coef in self.routes[key].items():
                route[k, r] += coef
        pairs = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
        return Network(
            channel=self.channel,
            collective=self.collective,
            gpus=self.gpus,
            directed=self.directed,
            resources=tuple(self.names),
            capacity=np.asarray(self.caps, dtype=float),
            pairs=pairs,
            route=route,
        )


def _ordered_pairs(n: int, directed: bool) -> Iterable[tuple[int, int]]:
    for u in range(n):
        for v in range(n):
            if u != v and (directed or u < v):
                yield u, v


def nvlink_network(topology: Topology, collective: str) -> Network:
    """The NVLink channel of ``topology`` as a :class:`Network` (see the module docstring)."""
    b = _Builder("nvlink", collective, topology.gpus)
    caps = topology.capacities("nvlink")
    for (a, c), cap in caps.items():
        b.resource(a, c, cap)
    # Which switches each GPU reaches, and with what port capacity.
    ports: dict[int, dict[str, float]] = {}
    for (a, c), cap in caps.items():
        if isinstance(a, int) and isinstance(c, str):
            ports.setdefault(a, {})[c] = cap
        elif isinstance(c, int) and isinstance(a, str):
            ports.setdefault(c, {})[a] = cap
    gpus = topology.gpus
    for u, v in _ordered_pairs(len(gpus), b.directed):
        gu, gv = gpus[u], gpus[v]
        if (gu, gv) in caps or (gv, gu) in caps:
            b.add_route(u, v, {b.rid(gu, gv): 1.0})
            continue
        shared = sorted(set(ports.get(gu, {})) & set(ports.get(gv, {})))
        if not shared:
            continue
        width = {s: min(ports[gu][s], ports[gv][s]) for s in shared}
        total = sum(width.values())
        hops: dict[int, float] = {}
        for s in shared:
            share = width[s] / total
            for r in (b.rid(gu, s), b.rid(s, gv)):
                hops[r] = hops.get(r, 0.0) + share
        b.add_route(u, v, hops)
    return b.build()


def pcie_network(topology: Topology, collective: str) -> Network:
    """The PCIe channel of ``topology`` (its ``pcie`` field) as a :class:`Network`.

    Raises
    ------
    PlanError
        if the topology has no PCIe channel.
    """
    if topology.pcie is None:
        raise PlanError(f"channels: topology {topology.name!r} has no pcie channel")
    bw = topology.pcie.bandwidth_gbps
    b = _Builder("pcie", collective, topology.gpus)
    group_of: dict[int, int] = {}
    for i, group in enumerate(topology.pcie.switch_groups):
        for g in group:
            group_of[g] = i
    upper = {g: (f"pcieswitch{group_of[g]}" if g in group_of else "host") for g in topology.gpus}
    for g in topology.gpus:
        b.resource(g, upper[g], bw)
    for i in sorted(set(group_of.values())):
        b.resource(f"pcieswitch{i}", "host", bw)
    gpus = topology.gpus
    for u, v in _ordered_pairs(len(gpus), b.directed):
        gu, gv = gpus[u], gpus[v]
        su, sv = upper[gu], upper[gv]
        hops = [b.rid(gu, su)]
        if su != sv:
            if su != "host":
                hops.append(b.rid(su, "host"))
            if sv != "host":
                hops.append(b.rid("host", sv))
        hops.append(b.rid(sv, gv))
        route: dict[int, float] = {}
        for r in hops:
            route[r] = route.get(r, 0.0) + 1.0
        b.add_route(u, v, route)
    return b.build()


def channel_network(topology: Topology, collective: str, channel: str) -> Network:
    """The :class:`Network` of ``channel`` (``nvlink`` or ``pcie``) of ``topology``."""
    if channel == "nvlink":
        return nvlink_network(topology, collective)
    if channel == "pcie":
        return pcie_network(topology, collective)
    raise PlanError(f"channels: unknown channel {channel!r} (expected nvlink or pcie)")
