"""What a plan asks of each link: per-resource loads and the predicted rate (bandwidth model).

The bandwidth model of docs/formats.md (``rate_gbps``: bytes / second, no
latency): a plan moving ``S`` bytes puts ``S * sum_t fraction_t load(t, r)``
bytes on resource ``r`` (:mod:`.network` defines resources and routes, per
channel), every resource works in parallel, so the collective takes
``max_r S * load_r / c_r`` and its algorithm bandwidth is
``1 / max_r (load_r / c_r)``.  The channels are separate hardware, so a hybrid
plan's time is the max over both channels' resources too (Blink, section 3.4:
``max(T_pcie, T_nvlink)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..topology.model import Topology
from .network import Network, channel_network
from .plan import Plan

__all__ = ["ChannelLoad", "plan_loads", "predicted_rate", "utilisation"]


@dataclass
class ChannelLoad:
    """Bytes per byte of the buffer on each resource of one channel."""

    network: Network
    load: np.ndarray

    def time_per_byte(self) -> float:
        """Seconds per GB of the buffer (1 / GB/s) on this channel's busiest resource."""
        if not len(self.load):
            return 0.0
        return float(np.max(self.load / self.network.capacity))


def plan_loads(plan: Plan, topology: Topology) -> dict[str, ChannelLoad]:
    """Per channel used by ``plan``: the load on every resource of ``topology``.

    Raises
    ------
    PlanError
        if the plan's GPUs are not the topology's, or an edge has no route.
    """
    if set(plan.gpus) != set(topology.gpus):
        raise PlanError(f"gpus: plan is for GPUs {list(plan.gpus)}, topology {topology.name!r} has {list(topology.gpus)}")
    out: dict[str, ChannelLoad] = {}
    for channel in sorted({t.channel for t in plan.trees}):
        net = channel_network(topology, plan.collective, channel)
        index = {g: i for i, g in enumerate(net.gpus)}
        load = np.zeros(net.num_resources)
        for i, tree in enumerate(plan.trees):
            if tree.channel != channel or not tree.edges:
                continue
            try:
                rows = net.edge_rows((index[p], index[c]) for p, c in tree.edges)
            except PlanError as exc:
                raise PlanError(f"trees[{i}]: {exc}") from None
            load += tree.fraction * net.route[rows].sum(axis=0)
        out[channel] = ChannelLoad(net, load)
    return out


def predicted_rate(plan: Plan, topology: Topology) -> float:
    """The plan's algorithm bandwidth in GB/s under the bandwidth model (0 if nothing moves)."""
    loads = plan_loads(plan, topology)
    worst = max((c.time_per_byte() for c in loads.values()), default=0.0)
    return 1.0 / worst if worst > 0 else 0.0


def utilisation(plan: Plan, topology: Topology) -> dict[str, dict[str, float]]:
    """Per channel, per resource: the fraction of its capacity used at the predicted rate."""
    loads = plan_loads(plan, topology)
    rate = predicted_rate(plan, topology)
    return {
        ch: {name: float(l * rate / c) for name, l, c in zip(cl.network.resources, cl.load, cl.network.capacity)}
        for ch, cl in loads.items()
    }
