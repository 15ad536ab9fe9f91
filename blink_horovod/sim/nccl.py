"""A model of NCCL, the baseline: its rings (and trees) over a topology and its cost model.

How NCCL builds rings (NCCL >= 2.4, ``src/graph/search.cc``): it searches for
``nChannels`` rings, each a Hamiltonian cycle through the GPUs, at one
per-channel speed, subtracting that speed from every link a ring crosses, and
keeps the solution with the most total bandwidth (``nChannels x speed``),
trying speeds from high to low.  Hops must be of the best path type first
(NVLink); only when no ring at all exists over NVLink does the search relax to
PCIe paths -- the "fallback to PCIe when NVLink-only rings cannot be
constructed" that Blink (sections 1 and 5) measures.  A V100 NVLink carries
one channel in each direction; a double link carries two.

This model does the same search *exactly*: it enumerates the directed
Hamiltonian cycles over the allocation's NVLink pairs (direct bundles, or
pairs sharing a switch), and for each candidate speed (a link's bandwidth, or
a bundle's multiple) solves an integer program for the most rings whose hops
fit every link direction's capacity (scipy's HiGHS MILP), capped at NCCL's 16
channels.  Without any NVLink ring it uses one ring over the PCIe channel in
PCI (device) order, whose speed is the PCIe bottleneck (resources.py).

Where this differs from NCCL (honestly stated in docs/paper/):

- NCCL's search is greedy with backtracking under a time budget; the model's
  integer program finds the maximum, so it never gives NCCL *fewer* rings
  than NCCL would find -- it errs in NCCL's favour.
- NCCL >= 2.4 may also build rings that mix NVLink hops with a PCIe hop; such
  a ring still runs at the PCIe hop's speed, so its bandwidth is that of the
  PCIe fallback modelled here.  NCCL's SHM path across CPU sockets (slower
  than PCIe peer-to-peer) is not modelled; the PCIe fallback gets the full
  ``pcie.bandwidth_gbps``, again in NCCL's favour.
- Link speeds are the topology's (e.g. 25 GB/s per NVLink2), not NCCL's own
  internal estimates (20 GB/s for SM70), so Blink and NCCL see the same wires.
- Within one server NCCL's "tree" is a chain through the GPUs (the double
  binary tree spans servers, ``src/graph/trees.cc``); the model prices it as
  NCCL's tuning model does: ``2 (n - 1)`` hops.  :func:`dbt_depth` gives the
  idealized double binary tree over all GPUs for comparison (figure b).

Times come from NCCL's own cost model (``src/graph/tuning.cc``): per
algorithm (ring, tree) and protocol (LL, LL128, Simple),
``latency + bytes / algbw`` with NCCL's latency table and protocol bandwidth
factors (params.py), and NCCL's choice of the cheapest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ScheduleError
from ..topology.model import Topology
from .params import DEFAULT_PARAMS, SimParams
from .resources import ResourceMap

__all__ = [
    "NcclEstimate",
    "RingSet",
    "dbt_depth",
    "hamiltonian_cycles",
    "nccl_estimate",
    "nccl_rings",
    "nccl_time",
    "nvlink_rings",
    "pcie_rings",
]

GB = 1e9
_MAX_CYCLES = 20000  # beyond this many candidate cycles, search greedily instead


@dataclass(frozen=True)
class RingSet:
    """NCCL's rings for one allocation: every ring runs at ``speed_gbps`` one way round."""

    rings: tuple[tuple[int, ...], ...]  # GPU ids; ring k sends rings[k][i] -> rings[k][i+1]
    channel: str  # "nvlink" or "pcie"
    speed_gbps: float

    @property
    def nchannels(self) -> int:
        return len(self.rings)

    @property
    def total_gbps(self) -> float:
        """NCCL's ring bus bandwidth: channels x speed."""
        return self.nchannels * self.speed_gbps


@dataclass(frozen=True)
class NcclEstimate:
    """NCCL's time for one collective, with what it chose."""

    time_s: float
    algorithm: str  # "ring" or "tree"
    protocol: str  # "LL", "LL128" or "Simple"
    rings: RingSet
    algbw_gbps: float
    latency_s: float


def hamiltonian_cycles(gpus: Sequence[int], adjacent, limit: int = _MAX_CYCLES) -> list[tuple[int, ...]]:
    """Directed Hamiltonian cycles over ``gpus`` starting at ``gpus[0]``, at most ``limit`` of them.

    ``adjacent(u, v)`` says whether a hop ``u -> v`` exists.  A result of
    exactly ``limit`` cycles may be incomplete (the caller then searches
    greedily).

    Examples
    --------
    >>> sorted(hamiltonian_cycles([0, 1, 2], lambda u, v: True))
    [(0, 1, 2), (0, 2, 1)]
    """
    gpus = list(gpus)
    n = len(gpus)
    if n < 2:
        return []
    if n == 2:
        return [tuple(gpus)] if adjacent(gpus[0], gpus[1]) and adjacent(gpus[1], gpus[0]) else []
    nbr = {u: [v for v in gpus if v != u and adjacent(u, v)] for u in gpus}
    start = gpus[0]
    out: list[tuple[int, ...]] = []
    path = [start]
    seen = {start}

    def dfs(u: int) -> bool:
        """False once ``limit`` cycles are found (stop)."""
        if len(path) == n:
            if adjacent(u, start):
                out.append(tuple(path))
            return len(out) < limit
        for v in nbr[u]:
            if v not in seen:
                seen.add(v)
                path.append(v)
                more = dfs(v)
                path.pop()
                seen.discard(v)
                if not more:
                    return False
        return True

    dfs(start)
    return out


def _usage(cycle: Sequence[int], rmap: ResourceMap, channel: str) -> dict[int, int]:
    use: dict[int, int] = {}
    n = len(cycle)
    for k in range(n):
        for r in rmap.route(cycle[k], cycle[(k + 1) % n], channel):
            use[r] = use.get(r, 0) + 1
    return use


def _max_rings(cycles: list[tuple[int, ...]], usages: list[dict[int, int]], units: dict[int, int], cap: int) -> list[int]:
    """Most rings (with repetition) whose resource use fits ``units``: an integer program."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    res_ids = sorted(units)
    row = {r: i for i, r in enumerate(res_ids)}
    a = np.zeros((len(res_ids) + 1, len(cycles)))
    for j, use in enumerate(usages):
        for r, k in use.items():
            a[row[r], j] = k
    a[-1, :] = 1.0
    ub = np.array([units[r] for r in res_ids] + [cap], dtype=float)
    sol = milp(
        c=-np.ones(len(cycles)),
        constraints=LinearConstraint(a, -np.inf, ub),
        integrality=np.ones(len(cycles)),
        bounds=Bounds(0, cap),
    )
    if sol.x is None:
        return [0] * len(cycles)
    return [round(x) for x in sol.x]


def _greedy_rings(gpus: Sequence[int], rmap: ResourceMap, units: dict[int, int], cap: int) -> list[tuple[int, ...]]:
    """Rings found one at a time on the residual capacity (large allocations)."""
    left = dict(units)
    rings: list[tuple[int, ...]] = []

    def fits(u: int, v: int) -> bool:
        return all(left.get(r, 0) >= 1 for r in rmap.route(u, v, "nvlink")) if rmap.nvlink_connected(u, v) else False

    while len(rings) < cap:
        # The previous ring again first (NCCL's "replay"), then a fresh search.
        cand = None
        if rings and all(fits(rings[-1][k], rings[-1][(k + 1) % len(gpus)]) for k in range(len(gpus))):
            cand = rings[-1]
        else:
            found = hamiltonian_cycles(gpus, fits, limit=1)
            if found:
                cand = found[0]
        if cand is None:
            break
        use = _usage(cand, rmap, "nvlink")
        if any(left.get(r, 0) < k for r, k in use.items()):
            break
        for r, k in use.items():
            left[r] -= k
        rings.append(cand)
    return rings


def nvlink_rings(topology: Topology, params: SimParams = DEFAULT_PARAMS) -> RingSet | None:
    """NCCL's NVLink rings for ``topology`` (module docstring), or None when no NVLink ring exists."""
    gpus = list(topology.gpus)
    n = len(gpus)
    if n < 2:
        return None
    rmap = ResourceMap(topology, params)
    cap_channels = params.nccl.max_channels

    def adjacent(u: int, v: int) -> bool:
        return rmap.nvlink_connected(u, v)

    cycles: list[tuple[int, ...]] | None = hamiltonian_cycles(gpus, adjacent)
    if not cycles:
        return None
    if len(cycles) < _MAX_CYCLES:
        usages = [_usage(c, rmap, "nvlink") for c in cycles]
        used: set[int] = set().union(*usages)
    else:
        # Too many cycles to enumerate (a large switched machine): greedy search.
        cycles = None
        usages = []
        used = {r for u in gpus for v in gpus if u != v and adjacent(u, v) for r in rmap.route(u, v, "nvlink")}
    # Candidate speeds: each resource's capacity divided by 1 .. its link count.
    speeds: set[float] = set()
    for r in used:
        c = rmap.capacity[r] / GB
        links = _links_of(topology, rmap.names[r])
        for k in range(1, max(1, links) + 1):
            speeds.add(round(c / k, 9))
    best: tuple[float, float, list[tuple[int, ...]]] | None = None
    for speed in sorted(speeds, reverse=True):
        units = {r: math.floor(rmap.capacity[r] / GB / speed + 1e-9) for r in used}
        if cycles is not None:
            counts = _max_rings(cycles, usages, units, cap_channels)
            rings = [c for c, k in zip(cycles, counts) for _ in range(k)]
        else:
            rings = _greedy_rings(gpus, rmap, units, cap_channels)
        total = len(rings) * speed
        # Equal totals: the most channels (NCCL duplicates channels to keep SMs busy).
        if rings and (best is None or total >= best[0] - 1e-9):
            best = (total, speed, rings)
    if best is None:
        return None
    return RingSet(tuple(best[2]), "nvlink", best[1])


def _links_of(topology: Topology, name: str) -> int:
    """Physical links behind a resource named by ResourceMap ("nvlink a->b")."""
    try:
        a, b = name.split(" ", 1)[1].split("->")
    except ValueError:
        return 1
    def vid(x: str):
        return int(x) if x.isdigit() else x
    return max(1, topology.link_count(vid(a), vid(b), "nvlink"))


def pcie_rings(topology: Topology, params: SimParams = DEFAULT_PARAMS) -> RingSet:
    """NCCL's fallback: one ring over PCIe in PCI (device id) order, at the PCIe bottleneck."""
    gpus = sorted(topology.gpus)
    if len(gpus) < 2:
        return RingSet((tuple(gpus),), "pcie", params.default_pcie_gbps)
    rmap = ResourceMap(topology, params)
    use = _usage(gpus, rmap, "pcie")
    speed = min(rmap.capacity[r] / k for r, k in use.items()) / GB
    return RingSet((tuple(gpus),), "pcie", speed)


_RING_CACHE: dict[tuple, RingSet] = {}


def nccl_rings(topology: Topology, params: SimParams = DEFAULT_PARAMS) -> RingSet:
    """NVLink rings when NVLink forms any ring over the allocation, else the PCIe ring (memoized)."""
    key = (topology, params.nccl.max_channels, params.default_pcie_gbps)
    hit = _RING_CACHE.get(key)
    if hit is None:
        if len(_RING_CACHE) > 4096:
            _RING_CACHE.clear()
        hit = _RING_CACHE[key] = nvlink_rings(topology, params) or pcie_rings(topology, params)
    return hit


def dbt_depth(n: int) -> int:
    """Depth of each of the two binary trees of NCCL's double binary tree over ``n`` ranks."""
    return max(1, math.ceil(math.log2(n + 1)) - 1) if n > 1 else 0


def nccl_estimate(topology: Topology, collective: str, size_bytes: int, params: SimParams = DEFAULT_PARAMS,
                  rings: RingSet | None = None, algorithms: Sequence[str] = ("ring", "tree"),
                  tree_hops: int | None = None) -> NcclEstimate:
    """NCCL's time for ``collective`` of ``size_bytes`` on ``topology``: its cheapest algorithm/protocol.

    Parameters
    ----------
    algorithms : which NCCL algorithms may be chosen ("tree" applies to allreduce only).
    tree_hops : hops of the tree one way (default NCCL's intra-server chain,
        ``n - 1``; ``dbt_depth(n)`` prices an idealized double binary tree).
    """
    if collective not in ("allreduce", "broadcast"):
        raise ScheduleError(f"collective: expected allreduce or broadcast, got {collective!r}")
    n = topology.n
    rs = rings if rings is not None else nccl_rings(topology, params)
    if n < 2 or size_bytes <= 0:
        return NcclEstimate(0.0, "ring", "Simple", rs, math.inf, 0.0)
    p = params.nccl
    nvl = rs.channel == "nvlink"
    ring_hop = p.ring_hop_nvlink_us if nvl else p.ring_hop_pcie_us
    tree_hop = p.tree_hop_nvlink_us if nvl else p.tree_hop_pcie_us
    nch = rs.nchannels
    bus = rs.total_gbps
    if collective == "allreduce":
        nsteps = 2 * (n - 1)
        ll_factor = p.ll_ring_factor_allreduce
    else:
        nsteps = n
        ll_factor = p.ll_ring_factor_broadcast
    best: NcclEstimate | None = None
    for algo in algorithms:
        if algo == "tree" and collective != "allreduce":
            continue
        for proto in p.protocols:
            if proto == "LL128" and not nvl:
                continue  # NCCL enables LL128 only over NVLink
            if algo == "ring":
                if proto == "Simple":
                    bw = bus
                elif proto == "LL":
                    bw = min(p.ll_max_gbps, bus * ll_factor)
                else:
                    bw = min(bus * p.ll128_factor, p.ll128_max_per_channel_gbps[collective] * nch)
                algbw = bw * n / nsteps
                lat = p.ring_base_us[proto]
                if collective == "allreduce":
                    lat += nsteps * ring_hop[proto]
                else:
                    # tuning.cc: broadcast over distinct channels adds a chunk latency per step.
                    lat += nsteps * (tree_hop["Simple"] if proto == "Simple" else ring_hop[proto])
            elif algo == "tree":
                bw = min(bus * p.tree_factor, nch * p.tree_max_per_channel_gbps)
                if proto == "LL":
                    bw = min(bw * p.tree_ll_factor, p.ll_max_gbps)
                elif proto == "LL128":
                    bw = min(bw * p.tree_ll128_factor, p.ll128_max_per_channel_gbps[collective] * nch)
                algbw = bw * 0.5
                hops = (n - 1) if tree_hops is None else tree_hops
                lat = p.tree_base_us[proto] + 2 * hops * tree_hop[proto]
            else:
                raise ScheduleError(f"algorithm: expected ring or tree, got {algo!r}")
            t = lat * 1e-6 + size_bytes / (algbw * GB)
            if best is None or t < best.time_s:
                best = NcclEstimate(t, algo, proto, rs, algbw, lat * 1e-6)
    assert best is not None
    return best


def nccl_time(topology: Topology, collective: str, size_bytes: int, params: SimParams = DEFAULT_PARAMS) -> float:
    """Seconds NCCL (as modelled) takes; see :func:`nccl_estimate`."""
    return nccl_estimate(topology, collective, size_bytes, params).time_s
