"""Built-in machines, as named constructors (in the manner of msccl-tools' ``nvidia.py``).

Each returns a whole :class:`~blink_horovod.topology.model.Topology` with its
PCIe channel; :func:`resolve` also takes allocations (``"dgx1v:0,1,4,5"``),
topology files and ``local`` (the probe).

Sources: NVLink1 carries 20 GB/s per direction (P100), NVLink2 25 GB/s (V100),
NVLink4 25 GB/s per link with 18 links per H100/H200 (450 GB/s); PCIe 3.0 x16
delivers 8-12 GB/s (Blink, section 1), PCIe 5.0 x16 ~50 GB/s.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections.abc import Callable, Sequence

from ..errors import TopologyError
from .model import Link, PCIeChannel, Topology, links_from_pairs

__all__ = ["MACHINES", "cpu", "dgx1p", "dgx1v", "dgx2", "hgx_h100", "hgx_h200", "parse_gpu_list", "pcie", "resolve"]

PCIE3_GBPS = 12.0
PCIE5_GBPS = 50.0


def dgx1p() -> Topology:
    """DGX-1 with P100s: a hybrid cube-mesh of single NVLink1 links (20 GB/s).

    ::

        0 --- 1        4 --- 5        full meshes on {0,1,2,3} and {4,5,6,7},
        | \\ / |        | \\ / |        plus 0-4, 1-5, 2-6, 3-7
        | / \\ |        | / \\ |
        2 --- 3        6 --- 7
    """
    quad = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    pairs = [(a, b, 1) for a, b in quad] + [(a + 4, b + 4, 1) for a, b in quad]
    pairs += [(i, i + 4, 1) for i in range(4)]
    return Topology(
        gpus=tuple(range(8)),
        links=links_from_pairs(pairs, 20.0),
        name="dgx1p",
        pcie=PCIeChannel(PCIE3_GBPS, ((0, 1), (2, 3), (4, 5), (6, 7))),
    )


def dgx1v() -> Topology:
    """DGX-1 with V100s: NVLink2 (25 GB/s per link), six links per GPU.

    From ``nvidia-smi topo -m``: double links 0-3, 0-4, 1-2, 1-5, 2-3, 4-7,
    5-6, 6-7; single links 0-1, 0-2, 1-3, 2-6, 3-7, 4-5, 4-6, 5-7.
    """
    double = [(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)]
    single = [(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)]
    pairs = [(a, b, 2) for a, b in double] + [(a, b, 1) for a, b in single]
    return Topology(
        gpus=tuple(range(8)),
        links=links_from_pairs(sorted(pairs), 25.0),
        name="dgx1v",
        pcie=PCIeChannel(PCIE3_GBPS, ((0, 1), (2, 3), (4, 5), (6, 7))),
    )


def _switched(name: str, n: int, links_per_gpu: int, per_link_gbps: float, pcie_gbps: float) -> Topology:
    links = tuple(
        Link(g, "nvswitch0", "nvlink", links_per_gpu, links_per_gpu * per_link_gbps) for g in range(n)
    )
    groups = tuple((g, g + 1) for g in range(0, n, 2))
    return Topology(
        gpus=tuple(range(n)),
        links=links,
        name=name,
        switches=("nvswitch0",),
        pcie=PCIeChannel(pcie_gbps, groups),
    )


def dgx2() -> Topology:
    """DGX-2: 16 V100s on an NVSwitch fabric, 6 NVLink2 links (150 GB/s) per GPU.

    The twelve physical NVSwitches of the two baseboards act as one
    non-blocking switch, modelled as one switch vertex.
    """
    return _switched("dgx2", 16, 6, 25.0, PCIE3_GBPS)


def hgx_h100() -> Topology:
    """HGX H100: 8 GPUs on NVSwitch, 18 NVLink4 links (450 GB/s) per GPU."""
    return _switched("hgx-h100", 8, 18, 25.0, PCIE5_GBPS)


def hgx_h200() -> Topology:
    """HGX H200: 8 GPUs on NVSwitch, 18 NVLink4 links (450 GB/s) per GPU."""
    return _switched("hgx-h200", 8, 18, 25.0, PCIE5_GBPS)


def pcie(n: int = 8) -> Topology:
    """``n`` GPUs without NVLink, two per PCIe 3.0 switch."""
    if n < 1:
        raise TopologyError(f"gpus: a pcie machine needs at least 1 GPU, got {n}")
    groups = tuple(tuple(range(g, min(g + 2, n))) for g in range(0, n, 2))
    return Topology(gpus=tuple(range(n)), links=(), name="pcie" if n == 8 else f"pcie{n}", pcie=PCIeChannel(PCIE3_GBPS, groups))


def cpu(n: int = 4, gbps: float = 10.0) -> Topology:
    """``n`` CPU ranks of one host, fully connected by equal links.

    The tree channel between processes of one host is shared memory; it is
    written with kind ``nvlink`` because that is the channel trees are planned
    on (docs/formats.md: ``BLINK_TOPOLOGY`` unset on a host without GPUs).
    """
    if n < 1:
        raise TopologyError(f"gpus: a cpu machine needs at least 1 rank, got {n}")
    pairs = [(a, b, 1) for a in range(n) for b in range(a + 1, n)]
    return Topology(gpus=tuple(range(n)), links=links_from_pairs(pairs, gbps), name="cpu" if n == 4 else f"cpu{n}")


MACHINES: dict[str, Callable[[], Topology]] = {
    "dgx1p": dgx1p,
    "dgx1v": dgx1v,
    "dgx2": dgx2,
    "hgx-h100": hgx_h100,
    "hgx-h200": hgx_h200,
    "pcie": pcie,
    "cpu": cpu,
}

_SIZED = re.compile(r"^(pcie|cpu)(\d+)$")
# pcieN / cpuN build N^2 links: far beyond any server, a typo would take hours and all memory.
MAX_SIZED_MACHINE = 1024


def parse_gpu_list(text: str, field: str = "gpus") -> list[int]:
    """``"0,1,4,5"`` -> ``[0, 1, 4, 5]``; duplicates and junk are errors naming ``field``."""
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not str(text).strip() or any(p == "" for p in parts):
        raise TopologyError(f"{field}: empty GPU list {text!r}")
    out = []
    for p in parts:
        if not re.fullmatch(r"\d{1,9}", p):
            raise TopologyError(f"{field}: not a GPU id: {p!r} in {text!r}")
        out.append(int(p))
    if len(set(out)) != len(out):
        dup = sorted({g for g in out if out.count(g) > 1})
        raise TopologyError(f"{field}: duplicate GPU ids {dup} in {text!r}")
    return out


def _is_file(path: str) -> bool:
    """``Path.is_file`` that says False, not raises, for names the OS refuses (too long, NUL)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def machine(name: str) -> Topology:
    """A built-in machine by name (``dgx1v``, ``pcie4``, ``cpu8``, ...)."""
    if name in MACHINES:
        return MACHINES[name]()
    m = _SIZED.match(name)
    if m:
        if len(m.group(2)) > 4 or int(m.group(2)) > MAX_SIZED_MACHINE:
            raise TopologyError(f"topology: {name!r} has more than {MAX_SIZED_MACHINE} GPUs")
        return MACHINES[m.group(1)](int(m.group(2)))  # type: ignore[call-arg]
    names = ", ".join(list(MACHINES) + ["pcieN", "cpuN"])
    raise TopologyError(f"topology: unknown machine {name!r} (built-in: {names}; or a topology file)")


def resolve(spec: str, gpus: Sequence[int] | str | None = None) -> Topology:
    """A topology from ``NAME``, ``NAME:0,1,4,5``, a ``blink-topology/1`` file or ``local``.

    ``gpus`` (a list or ``"0,1,2"``) picks an allocation, as ``--gpus`` does;
    it must agree with one given in ``spec``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TopologyError(f"topology: expected a machine name or a file, got {spec!r}")
    spec = spec.strip()
    alloc: list[int] | None = None
    base = spec
    if not _is_file(spec) and ":" in spec and not os.sep in spec.split(":", 1)[0]:
        base, _, alloc_text = spec.partition(":")
        alloc = parse_gpu_list(alloc_text, "topology")
    if base == "local":
        from .probe import probe_local  # lazy: needs NVML

        topo = probe_local()
    elif _is_file(base):
        try:
            text = Path(base).read_bytes()
        except OSError as exc:
            raise TopologyError(f"topology: cannot read {base!r}: {exc.strerror or exc}") from None
        topo = Topology.from_json(text, source=base)  # type: ignore[arg-type]  # bytes: json decodes UTF-8
    elif base.endswith(".json") or os.sep in base:
        raise TopologyError(f"topology: no such file {base!r}")
    else:
        topo = machine(base)
    if gpus is not None:
        if isinstance(gpus, str):
            chosen = parse_gpu_list(gpus, "gpus")
        elif isinstance(gpus, (list, tuple)):
            chosen = list(gpus)
        else:
            raise TopologyError(f"gpus: expected a list of GPU ids or '0,1,2', got {gpus!r}")
        if alloc is not None and alloc != chosen:
            raise TopologyError(f"gpus: --gpus {chosen} disagrees with the allocation {alloc} in {spec!r}")
        alloc = chosen
    return topo.allocate(alloc) if alloc is not None else topo
