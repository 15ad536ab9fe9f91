"""Multi-server allreduce, hierarchically: Blink inside each server, a ring across servers.

The three stages of docs/architecture.md ("The flow of one allreduce"), as
Horovod's hierarchical allreduce runs them, one after the other:

1. intra-server reduce: each tree's share reduced up to its root, so local
   rank i holds its server's sum of the i-th 1/n of the buffer -- the
   compiled ``reduce`` program of the allreduce plan, simulated chunk by chunk;
2. cross-server: local rank i allreduces its 1/n with the same local rank of
   the other ``M - 1`` servers, a ring over the network; the n rings of a
   server share its network bandwidth ``net_gbps`` (one direction), so the
   stage moves ``2 (M - 1) / M`` of the buffer through each server's NIC;
3. intra-server broadcast of each share down its trees (the ``broadcast``
   program of the same plan).

Blink (section 5, "Multi-server training") simulates exactly this and finds
that Blink's advantage grows with the network bandwidth until the servers'
own links become the bottleneck.  The baselines use the same network stage:
NCCL hierarchical (NCCL's ring reduce-scatter inside the server, the network
ring, NCCL's ring all-gather; Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``)
and NCCL flat (one ring through all ``M x n`` GPUs, whose every channel
crosses each server's NIC, so it moves ``2 (Mn - 1) / Mn`` of the buffer per
NIC and runs no faster than its intra-server rings).  Not modelled: the
GPU-to-NIC PCIe path, and overlap between the stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..planner.plan import Plan
from ..topology.model import Topology
from .blink import plan_for, simulate_plan
from .nccl import nccl_rings
from .params import DEFAULT_PARAMS, SimParams

__all__ = ["HierarchicalResult", "hierarchical_allreduce"]

GB = 1e9


@dataclass
class HierarchicalResult:
    servers: int
    net_gbps: float
    size_bytes: int
    blink_reduce_s: float
    network_s: float
    blink_broadcast_s: float
    nccl_hier_s: float
    nccl_flat_s: float

    @property
    def blink_s(self) -> float:
        return self.blink_reduce_s + self.network_s + self.blink_broadcast_s

    @property
    def speedup_vs_hier(self) -> float:
        return self.nccl_hier_s / self.blink_s

    @property
    def speedup_vs_flat(self) -> float:
        return self.nccl_flat_s / self.blink_s


def _network_ring_s(size_bytes: float, servers: int, net_gbps: float, params: SimParams) -> float:
    """Ring allreduce of ``size_bytes`` per server across ``servers`` NICs (NCCL's NET ring latency per step)."""
    if servers <= 1:
        return 0.0
    steps = 2 * (servers - 1)
    lat = params.nccl.ring_base_us["Simple"] + steps * 9.6  # hwLat[NET][Ring][Simple] (tuning.cc)
    return lat * 1e-6 + steps / servers * size_bytes / (net_gbps * GB)


def hierarchical_allreduce(server: Topology, servers: int, net_gbps: float, size_bytes: int,
                           params: SimParams = DEFAULT_PARAMS, plan: Plan | None = None,
                           chunk_bytes: int | None = None, channels=("nvlink",)) -> HierarchicalResult:
    """Times of one allreduce of ``size_bytes`` over ``servers`` identical servers (module docstring)."""
    if plan is None:
        plan = plan_for(server, "allreduce", channels=channels)
    red = simulate_plan(plan, server, size_bytes, chunk_bytes, params, kind="reduce")
    bc = simulate_plan(plan, server, size_bytes, chunk_bytes, params, kind="broadcast")
    net = _network_ring_s(size_bytes, servers, net_gbps, params)
    n = server.n
    rings = nccl_rings(server, params)
    p = params.nccl
    hop = (p.ring_hop_nvlink_us if rings.channel == "nvlink" else p.ring_hop_pcie_us)["Simple"]
    # NCCL ring reduce-scatter / all-gather inside the server: (n - 1) / n of the buffer each.
    rs = (p.ring_base_us["Simple"] + (n - 1) * hop) * 1e-6 + (n - 1) / n * size_bytes / (rings.total_gbps * GB)
    hier = 2 * rs + net
    total = servers * n
    steps = 2 * (total - 1)
    bw = min(net_gbps, rings.total_gbps)
    flat_lat = p.ring_base_us["Simple"] + 2 * (servers - 1) * 9.6 + (steps - 2 * (servers - 1)) * hop
    flat = flat_lat * 1e-6 + steps / total * size_bytes / (bw * GB) if servers > 1 else math.nan
    return HierarchicalResult(servers, net_gbps, size_bytes, red.time_s, net, bc.time_s, hier, flat)
