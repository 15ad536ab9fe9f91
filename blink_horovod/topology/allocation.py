"""The topology of the GPUs a server's ranks use, from what NVML says of the machine (Blink, section 3.1:
plan for the allocation a job actually got).

Each rank knows the PCI bus id of the GPU it uses; :func:`server_topology` finds those GPUs among the
machine's (``NvmlFacts``, read once by local rank 0) and returns the allocation in local-rank order:
rank ``i`` is GPU ``gpus[i]``.  Ranks that share a GPU get a topology that says so (``one-gpu-xN``: the
ranks as vertices of one switch, since every rank reaches every other one through the same memory);
where NVML could not be read, or a rank's GPU is not among NVML's, a fully connected allocation
(``unprobed-xN``) with the reason, which the caller reports.

Pure: tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from .model import Link, Topology
from .probe import NvmlFacts, normalize_bus_id, topology_from_facts

__all__ = ["SHARED_GBPS", "UNPROBED_GBPS", "rank_gpus", "server_topology", "uniform"]

SHARED_GBPS = 1000.0  # nominal per-rank bandwidth of ranks sharing one GPU's memory
UNPROBED_GBPS = 25.0  # one NVLink, the least a fully connected allocation is assumed to have


def uniform(name: str, n: int, gbps: float) -> Topology:
    """``n`` ranks on one switch, ``gbps`` each: every pair one hop apart."""
    links = tuple(Link(g, "nvswitch0", "nvlink", 1, gbps) for g in range(n))
    return Topology(gpus=tuple(range(n)), links=links, name=name, switches=("nvswitch0",))


def rank_gpus(facts: NvmlFacts, bus_ids: Sequence[str]) -> list[int | None]:
    """Each rank's GPU id in :func:`topology_from_facts`'s numbering (None: not among NVML's GPUs)."""
    order = facts.visible if facts.visible is not None else tuple(g.index for g in facts.gpus)
    by_index = {g.index: g for g in facts.gpus}
    gpu_of = {normalize_bus_id(by_index[i].bus_id): pos for pos, i in enumerate(order) if i in by_index}
    return [gpu_of.get(normalize_bus_id(b)) for b in bus_ids]


def server_topology(facts: NvmlFacts | None, bus_ids: Sequence[str], why: str = "") -> tuple[Topology, str]:
    """The topology of the ranks' GPUs in local-rank order, and one line saying what was found.

    ``facts`` None means NVML could not be read (``why`` says why): the fully connected fallback.
    """
    n = len(bus_ids)
    distinct = list(dict.fromkeys(normalize_bus_id(b) for b in bus_ids))
    if len(distinct) < n:
        desc = (f"{n} ranks on {len(distinct)} GPU{'s' if len(distinct) > 1 else ''} "
                f"({', '.join(distinct)}): ranks share GPUs, planned as one switch")
        return uniform(f"one-gpu-x{n}", n, SHARED_GBPS), desc
    if facts is None:
        return uniform(f"unprobed-x{n}", n, UNPROBED_GBPS), f"NVML not readable ({why}): planned as fully connected"
    gpus = rank_gpus(facts, bus_ids)
    missing = [b for b, g in zip(bus_ids, gpus) if g is None]
    if missing:
        return (uniform(f"unprobed-x{n}", n, UNPROBED_GBPS),
                f"GPUs {missing} are not among NVML's: planned as fully connected")
    machine = topology_from_facts(facts)
    topo = machine.allocate([g for g in gpus if g is not None])
    nvlinks = sum(link.count for link in topo.links if link.kind == "nvlink")
    desc = (f"{n} GPUs {list(topo.gpus)} of {len(machine.gpus)}: {nvlinks} NVLink links"
            f"{' through NVSwitch' if topo.switches else ''}{', PCIe' if topo.pcie is not None else ''}")
    return topo, desc
