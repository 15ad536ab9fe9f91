"""What NVML reports on known machines, written out as data port by port (``NvmlFacts``), for the
prober's and the allocation's tests."""

from __future__ import annotations

from blink_horovod.topology import machine
from blink_horovod.topology.probe import GpuFacts, NvLinkFacts, NvmlFacts

VOLTA, HOPPER, BLACKWELL = 5, 9, 10
SINGLE, MULTIPLE, HOSTBRIDGE, SYSTEM = 10, 20, 30, 50


def bus(i: int) -> str:
    return f"00000000:{0x10 + i:02x}:00"


def switch_bus(i: int) -> str:
    return f"00000000:{0xa0 + i:02x}:00"


def dgx1v_facts(**overrides) -> NvmlFacts:
    """What NVML reports on a DGX-1V: six NVLink2 ports per GPU, each naming its peer."""
    ref = machine("dgx1v")
    ports: dict[int, list[int]] = {g: [] for g in range(8)}
    for link in ref.links:
        for _ in range(link.count):
            ports[link.src].append(link.dst)
            ports[link.dst].append(link.src)
    gpus = tuple(
        GpuFacts(
            index=g,
            bus_id=bus(g),
            name="Tesla V100-SXM2-32GB",
            uuid=f"GPU-{g:08x}-aaaa",
            nvlinks=tuple(NvLinkFacts(l, bus(peer), "gpu", 2) for l, peer in enumerate(ports[g])),
            pcie_gen=3,
            pcie_width=16,
            arch=VOLTA,
        )
        for g in range(8)
    )
    ancestor = {}
    for i in range(8):
        for j in range(i + 1, 8):
            ancestor[(i, j)] = SINGLE if i // 2 == j // 2 else (HOSTBRIDGE if i // 4 == j // 4 else SYSTEM)
    fields = {"gpus": gpus, "common_ancestor": ancestor, "p2p_nvlink": {}}
    fields.update(overrides)
    return NvmlFacts(**fields)


def hgx_facts(n: int = 8, arch: int = HOPPER, remote_type: str = "switch", version: int | None = 6) -> NvmlFacts:
    """HGX H100/H200: 18 NVLink4 ports per GPU, spread over four NVSwitches."""
    gpus = tuple(
        GpuFacts(
            index=g,
            bus_id=bus(g),
            nvlinks=tuple(NvLinkFacts(l, switch_bus(l % 4), remote_type, version) for l in range(18)),
            pcie_gen=5,
            pcie_width=16,
            arch=arch,
        )
        for g in range(n)
    )
    return NvmlFacts(gpus, {(i, j): SYSTEM for i in range(n) for j in range(i + 1, n)}, {})
