"""Probe this machine's GPUs through NVML (``blink topology local``).

Blink builds its graph from the links a job actually got (section 3.1); NVML
tells them link by link.  For each GPU and each NVLink port ``l``:

- ``nvmlDeviceGetNvLinkState`` -- is the port up;
- ``nvmlDeviceGetNvLinkRemotePciInfo`` -- the PCI bus id at its far end, which
  is another GPU's (a direct link) or an NVSwitch's;
- ``nvmlDeviceGetNvLinkRemoteDeviceType`` (newer drivers) -- GPU, switch or
  IBM NPU, where the driver says so;
- ``nvmlDeviceGetNvLinkVersion`` -- the NVLink version, which with the GPU's
  architecture sets the bandwidth of one link.  The architecture
  (:data:`NVLINK_GBPS_BY_ARCH`, as NCCL keys NVLink speed on the compute
  capability) is asked first because the version NVML reports is not
  reliable across drivers (some report 5.0 on H100); the version
  (:data:`NVLINK_GBPS`) decides where the architecture is unknown.

Ports NVML answers ``NotSupported`` (or ``InvalidArgument``, past the GPU's
last port) for are not there; a single GPU without NVLink (our H200 device
machine) answers so for every port and yields a 1-GPU topology.  Links are
counted per GPU pair from both ends (the smaller count wins), pairs whose
NVLink peer-to-peer status is not OK are dropped, and every link that ends at
a device that is not one of the machine's GPUs (and that the driver does not
call a GPU or a CPU) is a link to the NVSwitch fabric, modelled as one
non-blocking switch vertex ``nvswitch0`` as the built-in machines do.  ``nvmlDeviceGetTopologyCommonAncestor`` gives the PCIe
structure (GPUs whose common ancestor is at most a chain of PCIe switches share
a ``switch_group``) and the PCIe generation and width give its bandwidth
(:data:`PCIE_X16_GBPS`).

GPU ids are CUDA device indices (docs/formats.md, Topology file): NVML enumerates in PCI
bus order, which is CUDA's order on machines of identical GPUs (and always
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); ``CUDA_VISIBLE_DEVICES`` (indices or
``GPU-`` UUID prefixes) picks and renumbers them as CUDA does.

The module is split so that everything but the NVML calls is testable without
a GPU: :func:`read_nvml_facts` asks NVML and returns plain data
(:class:`NvmlFacts`); :func:`topology_from_facts` is a pure function of that
data; :func:`probe_local` joins the two.  ``pynvml`` (package
``nvidia-ml-py``) is imported only when probing.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..errors import TopologyError
from .model import Link, PCIeChannel, Topology

__all__ = [
    "NVLINK_GBPS",
    "NVLINK_GBPS_BY_ARCH",
    "PCIE_X16_GBPS",
    "GpuFacts",
    "NvLinkFacts",
    "NvmlFacts",
    "local_facts",
    "probe_local",
    "read_nvml_facts",
    "topology_from_facts",
    "visible_gpus",
]

log = logging.getLogger(__name__)

SWITCH_ID = "nvswitch0"
DEFAULT_NVLINK_GBPS = 25.0
DEFAULT_PCIE_GBPS = 12.0

# One NVLink, one direction, GB/s.  By NVML_DEVICE_ARCH_*: Pascal (P100,
# NVLink1) 20; Volta and Turing (NVLink2), Ampere (NVLink3), Hopper (NVLink4,
# 18 links = 450 GB/s) 25; Blackwell (NVLink5) 50; Rubin assumed as Blackwell.
NVLINK_GBPS_BY_ARCH: dict[int, float] = {4: 20.0, 5: 25.0, 6: 25.0, 7: 25.0, 9: 25.0, 10: 50.0, 13: 50.0}
# By NVML_NVLINK_VERSION_* (1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1,
# 6 = 4.0, 7 = 5.0, 8 = 6.0), for GPUs of an architecture not listed above.
NVLINK_GBPS: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0, 8: 50.0}

# Delivered bandwidth of an x16 link, one direction, GB/s, by PCIe generation:
# raw rates less packet overhead, matching the built-in machines (PCIe 3.0 x16
# 12 GB/s as Blink measures 8-12; PCIe 5.0 x16 50).
PCIE_X16_GBPS: dict[int, float] = {1: 3.0, 2: 6.0, 3: 12.0, 4: 25.0, 5: 50.0, 6: 100.0}

# NVML_TOPOLOGY_MULTIPLE: the common ancestor is a chain of PCIe switches
# (nvidia-smi's PXB); INTERNAL (0) and SINGLE (10, PIX) are nearer still.
_SAME_SWITCH_LEVEL = 20

# NVML error codes that mean "no such thing here" rather than a failure:
# NOT_SUPPORTED (3), INVALID_ARGUMENT (2, a port past the last), NOT_FOUND (6),
# FUNCTION_NOT_FOUND (13, an older driver).
_ABSENT = (2, 3, 6, 13)


@dataclass(frozen=True)
class NvLinkFacts:
    """One active NVLink port of a GPU, as NVML reports it."""

    link: int
    remote_bus_id: str
    remote_type: str = "unknown"  # "gpu", "switch", "npu" or "unknown" (not reported)
    version: int | None = None


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as NVML reports it (``index`` is NVML's)."""

    index: int
    bus_id: str
    name: str = ""
    uuid: str = ""
    nvlinks: tuple[NvLinkFacts, ...] = ()
    pcie_gen: int | None = None
    pcie_width: int | None = None
    arch: int | None = None  # NVML_DEVICE_ARCH_*


@dataclass(frozen=True)
class NvmlFacts:
    """What NVML said about the machine: plain data, no handles.

    ``common_ancestor`` and ``p2p_nvlink`` are keyed by NVML index pairs
    ``(i, j)`` with ``i < j``; a missing pair means NVML did not say.
    ``visible`` lists NVML indices in CUDA order (``CUDA_VISIBLE_DEVICES``).
    """

    gpus: tuple[GpuFacts, ...]
    common_ancestor: Mapping[tuple[int, int], int] = field(default_factory=dict)
    p2p_nvlink: Mapping[tuple[int, int], bool] = field(default_factory=dict)
    visible: tuple[int, ...] | None = None


def normalize_bus_id(bus_id: str | bytes) -> str:
    """``"00000000:07:00.0"`` or ``b"0000:07:00.0"`` -> ``"00000000:07:00"``.

    NVML writes the domain with 4 or 8 hex digits depending on the call; the
    function number is dropped since a GPU is function 0.
    """
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else str(bus_id)
    m = re.fullmatch(r"\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?\s*", text.strip("\x00"))
    if not m:
        return text.strip("\x00").strip().lower()
    domain, bus, dev = (int(g, 16) if g else 0 for g in m.groups())
    return f"{domain:08x}:{bus:02x}:{dev:02x}"


def visible_gpus(env_value: str | None, gpus: tuple[GpuFacts, ...]) -> tuple[int, ...]:
    """NVML indices CUDA exposes, in CUDA order, under ``CUDA_VISIBLE_DEVICES``.

    As CUDA does: entries are indices or ``GPU-`` UUID prefixes, and the list
    ends at the first entry that names no GPU (``-1``, a MIG id, a repeat).
    """
    everything = tuple(g.index for g in gpus)
    if env_value is None:
        return everything
    out: list[int] = []
    for token in env_value.split(","):
        token = token.strip()
        index: int | None = None
        if re.fullmatch(r"\d+", token):
            index = everything[int(token)] if int(token) < len(everything) else None
        elif token.startswith("GPU-") and len(token) > 4:
            matches = [g.index for g in gpus if g.uuid.lower().startswith(token.lower())]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in out:
            break
        out.append(index)
    return tuple(out)


def _per_link_gbps(arch: int | None, version: int | None) -> float:
    if arch in NVLINK_GBPS_BY_ARCH:
        return NVLINK_GBPS_BY_ARCH[arch]  # type: ignore[index]
    return NVLINK_GBPS.get(version or 0, DEFAULT_NVLINK_GBPS)


def _pcie_gbps(gen: int | None, width: int | None) -> float | None:
    if not gen or not width or gen not in PCIE_X16_GBPS:
        return None
    return PCIE_X16_GBPS[gen] * width / 16.0


def topology_from_facts(facts: NvmlFacts, name: str = "local") -> Topology:
    """The ``blink-topology/1`` topology of what NVML reported (pure).

    Parameters
    ----------
    facts
        NVML's answers, from :func:`read_nvml_facts` (or written by hand).
    name
        The topology's name.

    Raises
    ------
    TopologyError
        when no GPU is there or none is visible.
    """
    if not facts.gpus:
        raise TopologyError("no NVIDIA GPU found (NVML: 0 devices)")
    by_index = {g.index: g for g in facts.gpus}
    by_bus = {g.bus_id: g.index for g in facts.gpus}
    visible = facts.visible if facts.visible is not None else tuple(by_index)
    if not visible:
        raise TopologyError(f"no NVIDIA GPU found (CUDA_VISIBLE_DEVICES hides all {len(facts.gpus)} GPUs)")
    cuda = {nvml: i for i, nvml in enumerate(visible)}

    # Count links per (ordered) GPU pair from each end, and links to the fabric.
    seen: dict[tuple[int, int], list[float]] = {}
    fabric: dict[int, list[float]] = {}
    for g in visible:
        arch = by_index[g].arch
        for nl in by_index[g].nvlinks:
            peer = by_bus.get(nl.remote_bus_id)
            if nl.remote_type == "npu":
                continue  # an NVLink to a CPU (POWER9): not a GPU-GPU channel
            if nl.remote_type == "gpu" and peer is None:
                continue  # a GPU NVML does not show us (another container's)
            if nl.remote_type == "switch" or peer is None:
                # The far end is no GPU of this machine: the NVSwitch fabric.
                fabric.setdefault(g, []).append(_per_link_gbps(arch, nl.version))
            elif peer in cuda and peer != g:
                seen.setdefault((g, peer), []).append(_per_link_gbps(arch, nl.version))

    links: list[Link] = []
    done: set[frozenset[int]] = set()
    for (g, h), rates in sorted(seen.items(), key=lambda kv: (cuda[kv[0][0]], cuda[kv[0][1]])):
        pair = frozenset((g, h))
        if pair in done:
            continue
        done.add(pair)
        back = seen.get((h, g), [])
        count = min(len(rates), len(back)) if back else len(rates)
        if back and len(back) != len(rates):
            log.warning("NVML: GPU %d sees %d NVLinks to GPU %d but GPU %d sees %d; using %d", g, len(rates), h, h, len(back), count)
        key = (min(g, h), max(g, h))
        if facts.p2p_nvlink.get(key) is False:
            log.warning("NVML: GPUs %d and %d are NVLink-connected but NVLink P2P is not available; link not used", g, h)
            continue
        rate = min(rates + back)
        a, b = sorted((cuda[g], cuda[h]))
        links.append(Link(a, b, "nvlink", count, count * rate))
    switches: tuple[str, ...] = ()
    for g in visible:
        if g in fabric:
            rates = fabric[g]
            links.append(Link(cuda[g], SWITCH_ID, "nvlink", len(rates), sum(rates)))
            switches = (SWITCH_ID,)

    # PCIe: switch groups by common ancestor, bandwidth of the slowest GPU.
    parent = {g: g for g in visible}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (i, j), level in facts.common_ancestor.items():
        if i in parent and j in parent and level <= _SAME_SWITCH_LEVEL:
            parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for g in visible:
        groups.setdefault(find(g), []).append(cuda[g])
    switch_groups = tuple(tuple(sorted(grp)) for grp in sorted(groups.values(), key=min))
    rates = [_pcie_gbps(by_index[g].pcie_gen, by_index[g].pcie_width) for g in visible]
    known = [r for r in rates if r is not None]
    pcie_gbps = min(known) if known else DEFAULT_PCIE_GBPS
    return Topology(
        gpus=tuple(range(len(visible))),
        links=tuple(links),
        name=name,
        switches=switches,
        pcie=PCIeChannel(pcie_gbps, switch_groups),
        source="nvml",
    )


# -- talking to NVML -----------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _pci_bus_id(pci: Any) -> str:
    """Bus id of an ``nvmlPciInfo_t`` from its numeric fields (busId as fallback)."""
    try:
        domain, bus, device = int(pci.domain), int(pci.bus), int(pci.device)
    except (AttributeError, TypeError, ValueError):
        return normalize_bus_id(getattr(pci, "busId", ""))
    text = getattr(pci, "busId", b"")
    if (domain, bus, device) == (0, 0, 0) and text:
        return normalize_bus_id(text)  # numeric fields left empty: trust the string
    return f"{domain:08x}:{bus:02x}:{device:02x}"


def _asker(nvml: ModuleType) -> Callable[..., Any]:
    """``ask(name, *args, what=...)``: call ``nvml.name``; None where NVML says "not here"."""

    def ask(fn: str, *args: Any, what: str) -> Any:
        func = getattr(nvml, fn, None)
        if func is None:
            return None  # this pynvml predates the call
        try:
            return func(*args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in _ABSENT:
                return None
            raise TopologyError(f"NVML: {fn}({what}) failed: {exc}") from None

    return ask


def read_nvml_facts(nvml: ModuleType, cuda_visible_devices: str | None = None) -> NvmlFacts:
    """Ask an initialised NVML (the ``pynvml`` module) about every GPU.

    Parameters
    ----------
    nvml
        The ``pynvml`` module, after ``nvmlInit()``.
    cuda_visible_devices
        The value of ``CUDA_VISIBLE_DEVICES`` (None: unset).
    """
    ask = _asker(nvml)
    count = ask("nvmlDeviceGetCount", what="") or 0
    handles = []
    for i in range(count):
        handle = ask("nvmlDeviceGetHandleByIndex", i, what=f"GPU {i}")
        if handle is None:
            raise TopologyError(f"NVML: nvmlDeviceGetHandleByIndex(GPU {i}) found no GPU {i} of {count}")
        handles.append(handle)
    remote_types = {
        getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_GPU", 0): "gpu",
        getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", 1): "npu",
        getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2): "switch",
    }
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    gpus = []
    for i, h in enumerate(handles):
        links = []
        for link in range(max_links):
            state = ask("nvmlDeviceGetNvLinkState", h, link, what=f"GPU {i}, link {link}")
            if not state:
                continue  # NotSupported, past the last port, or down
            what = f"GPU {i}, link {link}"
            pci = ask("nvmlDeviceGetNvLinkRemotePciInfo", h, link, what=what)
            if pci is None:
                continue
            rtype = ask("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, what=what)
            version = ask("nvmlDeviceGetNvLinkVersion", h, link, what=what)
            links.append(NvLinkFacts(link, _pci_bus_id(pci), remote_types.get(rtype, "unknown"), version))
        gen = ask("nvmlDeviceGetMaxPcieLinkGeneration", h, what=f"GPU {i}") or ask(
            "nvmlDeviceGetCurrPcieLinkGeneration", h, what=f"GPU {i}"
        )
        width = ask("nvmlDeviceGetMaxPcieLinkWidth", h, what=f"GPU {i}") or ask(
            "nvmlDeviceGetCurrPcieLinkWidth", h, what=f"GPU {i}"
        )
        gpus.append(
            GpuFacts(
                index=i,
                bus_id=_pci_bus_id(ask("nvmlDeviceGetPciInfo", h, what=f"GPU {i}")),
                name=_text(ask("nvmlDeviceGetName", h, what=f"GPU {i}") or ""),
                uuid=_text(ask("nvmlDeviceGetUUID", h, what=f"GPU {i}") or ""),
                nvlinks=tuple(links),
                pcie_gen=gen,
                pcie_width=width,
                arch=ask("nvmlDeviceGetArchitecture", h, what=f"GPU {i}"),
            )
        )
    ancestor: dict[tuple[int, int], int] = {}
    p2p: dict[tuple[int, int], bool] = {}
    nvlink_cap = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    for i in range(count):
        for j in range(i + 1, count):
            what = f"GPU {i}, GPU {j}"
            level = ask("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j], what=what)
            if level is not None:
                ancestor[(i, j)] = int(level)
            status = ask("nvmlDeviceGetP2PStatus", handles[i], handles[j], nvlink_cap, what=what)
            if status is not None:
                p2p[(i, j)] = status == ok
    facts = NvmlFacts(tuple(gpus), ancestor, p2p)
    return NvmlFacts(facts.gpus, ancestor, p2p, visible_gpus(cuda_visible_devices, facts.gpus))


def local_facts(cuda_visible_devices: str | None) -> NvmlFacts:
    """What NVML says of this machine (``cuda_visible_devices`` picks and orders the GPUs, as CUDA does;
    None: every GPU).

    Raises
    ------
    TopologyError
        ``"no NVIDIA GPU found (NVML: ...)"`` where NVML (the ``pynvml`` module,
        the driver's library, or any GPU) is missing; naming the NVML call that
        failed otherwise.
    """
    try:
        import pynvml  # lazy: package nvidia-ml-py; only probing needs it
    except ImportError:
        raise TopologyError("no NVIDIA GPU found (NVML: the pynvml module is not installed; pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise TopologyError(f"no NVIDIA GPU found (NVML: {exc})") from None
    try:
        return read_nvml_facts(pynvml, cuda_visible_devices)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def probe_local(name: str = "local") -> Topology:
    """This machine's GPUs and links, from NVML (:func:`local_facts` under this process's
    ``CUDA_VISIBLE_DEVICES``)."""
    return topology_from_facts(local_facts(os.environ.get("CUDA_VISIBLE_DEVICES")), name=name)
