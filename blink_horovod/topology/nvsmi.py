"""``nvidia-smi topo -m`` text -> :class:`~blink_horovod.topology.model.Topology`.

A pure function of text, testable without a GPU (in the manner of msccl-tools'
topology parsing).  Blink (section 3.1) plans on "GPUs as vertices and NVLink
or PCIe connections as ... bandwidth-capacity edges"; ``nvidia-smi topo -m``
prints exactly that matrix.  docs/formats.md, Commands fixes how it is read:

- GPU rows and GPU columns (``GPU0`` ...) give the vertices; the GPU ids are
  the numbers in the labels.
- A cell ``NV#`` is a bundle of ``#`` NVLinks of ``link_gbps`` GB/s per
  direction each (default 25, NVLink2-4).
- The other cells (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``; the old
  names ``SOC`` = ``SYS`` and ``CPU`` = ``PHB`` too) are the PCIe structure:
  GPUs joined by ``PIX`` or ``PXB`` sit under one PCIe switch (hierarchy) and
  share a ``switch_group`` of the PCIe channel.
- NIC columns (``mlx5_0``, ``NIC0`` ...) and the affinity columns (``CPU
  Affinity``, ``NUMA Affinity``, ``GPU NUMA ID``) are not devices of the
  topology and add no links.  One thing is read from NIC columns: a NIC that
  is ``PIX``/``PXB`` to two GPUs witnesses that those GPUs share a PCIe switch
  hierarchy (PCIe is a tree: if neither path to the NIC crosses a host bridge,
  the path between the two GPUs does not either).  This matters because a GPU
  pair that has NVLink shows ``NV#`` and hides its PCIe relation: on a DGX-1
  the switch pairs {0,1}, {2,3}, ... are visible only through the NICs.
- ``X`` is the diagonal; ANSI underline codes (which nvidia-smi writes even
  when piped) and the legend are ignored.

Switched fabrics (docs/formats.md: "every GPU pair showing the same NV# where that
would exceed a GPU's link count ... is a switched fabric").  The rule used
here: the NVLink matrix is *complete* (every GPU pair shows ``NV#``), every
pair shows the *same* count ``k``, and ``k * (n - 1)`` exceeds
:data:`MAX_NVLINKS_PER_GPU` (18, the most NVLinks any GPU has: H100, H200,
B200).  No GPU could have that many direct links, so the links go through a
switch: the result is one switch vertex ``nvswitch0`` with one link of ``k``
NVLinks per GPU (the physical NVSwitches of a baseboard act as one
non-blocking switch).  DGX A100 (NV12, n=8: 84 > 18), HGX H100 (NV18: 126),
DGX-2 (NV6, n=16: 90) are switched; a 4-GPU HGX H100 board with direct NV6
links (18, not > 18), a 4-GPU A100 board (NV4: 12) and two bridged GPUs stay
direct, as they are.

The PCIe bandwidth cannot be read from the matrix; ``pcie_gbps`` (default
12 GB/s, PCIe 3.0 x16 as the built-in machines use) sets it.

Examples
--------
>>> text = '''
...         GPU0    GPU1    CPU Affinity
... GPU0     X      NV2     0-7
... GPU1    NV2      X      0-7
... '''
>>> topo = parse_topo_matrix(text)
>>> topo.gpus, topo.capacities()
((0, 1), {(0, 1): 50.0})
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import TopologyError
from .model import Link, PCIeChannel, Topology

__all__ = [
    "DEFAULT_LINK_GBPS",
    "DEFAULT_PCIE_GBPS",
    "MAX_NVLINKS_PER_GPU",
    "PCIE_CELLS",
    "SWITCH_ID",
    "parse_topo_matrix",
]

MAX_NVLINKS_PER_GPU = 18
DEFAULT_LINK_GBPS = 25.0
DEFAULT_PCIE_GBPS = 12.0
SWITCH_ID = "nvswitch0"

# PCIe relations, nearest first; old nvidia-smi (driver <= 384) wrote SOC for
# SYS and CPU for PHB.
PCIE_CELLS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_ALIASES = {"SOC": "SYS", "CPU": "PHB"}
_SAME_SWITCH = ("PIX", "PXB")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NV_CELL = re.compile(r"^NV(\d+)$")
# Words that begin the affinity columns of the header ("CPU Affinity",
# "NUMA Affinity", "GPU NUMA ID"): the device columns end before them.
_AFFINITY_WORDS = {"CPU", "NUMA", "GPU", "Affinity", "ID"}


@dataclass(frozen=True)
class _Row:
    lineno: int
    text: str
    label: str
    cells: tuple[str, ...]


def _positive(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TopologyError(f"{name}: bandwidth must be a positive finite number of GB/s, got {value!r}")
    return float(value)


def _header(lines: list[str]) -> tuple[int, list[str]]:
    """The header line's index and its device column labels (GPUs and NICs)."""
    for i, line in enumerate(lines):
        tokens = line.split()
        # The header starts with GPU0 like a row does, but holds no "X" cell.
        if tokens and _GPU_LABEL.match(tokens[0]) and "X" not in tokens:
            columns = []
            for tok in tokens:
                if tok in _AFFINITY_WORDS:
                    break
                columns.append(tok)
            return i, columns
    first = next((f"line {i + 1}: {l.strip()!r}" for i, l in enumerate(lines) if l.strip()), "the text is empty")
    raise TopologyError(
        f"nvidia-smi: no header row starting with GPU0 found (is this `nvidia-smi topo -m` output?); {first}"
    )


def _rows(lines: list[str], start: int, columns: list[str]) -> list[_Row]:
    """GPU rows after the header, up to the legend (NIC rows are skipped)."""
    rows = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith(("Legend", "NIC Legend")):
            break
        tokens = stripped.split()
        label = tokens[0]
        if label not in columns:
            raise TopologyError(
                f"nvidia-smi line {i + 1}: row {label!r} is not a column of the header ({' '.join(columns)}): {stripped!r}"
            )
        if not _GPU_LABEL.match(label):
            continue  # a NIC row: NICs are not devices of the topology
        if any(r.label == label for r in rows):
            raise TopologyError(f"nvidia-smi line {i + 1}: a second row {label!r}: {stripped!r}")
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            raise TopologyError(
                f"nvidia-smi line {i + 1}: expected {len(columns)} cells after {label!r}, got {len(cells)}: {stripped!r}"
            )
        rows.append(_Row(i + 1, stripped, label, tuple(cells)))
    return rows


def _cell_kind(cell: str, row: _Row) -> tuple[str, int]:
    """``("X", 0)``, ``("NV", k)`` or ``(pcie_relation, 0)``; junk raises naming the line."""
    if cell == "X":
        return "X", 0
    m = _NV_CELL.match(cell)
    if m:
        k = int(m.group(1))
        if k <= 0:
            raise TopologyError(f"nvidia-smi line {row.lineno}: NVLink count must be positive, got {cell!r}: {row.text!r}")
        return "NV", k
    rel = _ALIASES.get(cell, cell)
    if rel in PCIE_CELLS:
        return rel, 0
    raise TopologyError(
        f"nvidia-smi line {row.lineno}: unknown cell {cell!r} (expected X, NV#, {', '.join(PCIE_CELLS)}): {row.text!r}"
    )


def _find(parent: dict, x):
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def parse_topo_matrix(
    text: str,
    link_gbps: float = DEFAULT_LINK_GBPS,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    name: str = "nvidia-smi",
) -> Topology:
    """Parse ``nvidia-smi topo -m`` output into a ``blink-topology/1`` topology.

    Parameters
    ----------
    text
        The whole output, as saved from ``nvidia-smi topo -m`` (tabs or spaces,
        with or without ANSI codes and the legend).
    link_gbps
        Bandwidth of one NVLink in one direction, GB/s (``--link-gbps``).
    pcie_gbps
        Per-GPU bandwidth of the PCIe channel, GB/s.
    name
        The topology's name.

    Returns
    -------
    Topology
        GPUs, NVLink bundles (or one NVSwitch, see the module docstring) and the
        PCIe channel with its switch groups.

    Raises
    ------
    TopologyError
        naming the line of ``text`` that cannot be read (a missing header, a
        short row, an unknown cell, an asymmetric matrix) or the bad bandwidth.
    """
    link_gbps = _positive(link_gbps, "link_gbps")
    pcie_gbps = _positive(pcie_gbps, "pcie_gbps")
    if not isinstance(text, str):
        raise TopologyError(f"nvidia-smi: expected text, got {type(text).__name__}")
    lines = _ANSI.sub("", text).replace("\r", "").split("\n")
    hi, columns = _header(lines)
    if len(set(columns)) != len(columns):
        dup = sorted({c for c in columns if columns.count(c) > 1})
        raise TopologyError(f"nvidia-smi line {hi + 1}: duplicate columns {dup} in the header: {lines[hi].strip()!r}")
    gpu_cols = [c for c in columns if _GPU_LABEL.match(c)]
    gpu_id = {c: int(_GPU_LABEL.match(c).group(1)) for c in gpu_cols}  # type: ignore[union-attr]
    nic_cols = [c for c in columns if c not in gpu_id]
    rows = {r.label: r for r in _rows(lines, hi, columns) if r.label in gpu_id}
    missing = [c for c in gpu_cols if c not in rows]
    if missing:
        raise TopologyError(
            f"nvidia-smi: header line {hi + 1} has column {missing[0]} but no row {missing[0]} follows: {lines[hi].strip()!r}"
        )

    # Read every GPU-GPU and GPU-NIC cell once, checking the diagonal.
    kinds: dict[tuple[str, str], tuple[str, int]] = {}
    for label in gpu_cols:
        row = rows[label]
        for col, cell in zip(columns, row.cells):
            kind = _cell_kind(cell, row)
            if (col == label) != (kind[0] == "X"):
                what = "the diagonal must be X" if col == label else f"X off the diagonal (column {col})"
                raise TopologyError(f"nvidia-smi line {row.lineno}: {what}, got {cell!r}: {row.text!r}")
            if kind[0] == "NV" and col not in gpu_id:
                raise TopologyError(f"nvidia-smi line {row.lineno}: NVLink to NIC column {col!r} ({cell!r}): {row.text!r}")
            kinds[(label, col)] = kind

    gpus = [gpu_id[c] for c in gpu_cols]
    nv: dict[tuple[int, int], int] = {}
    parent: dict[str, str] = {c: c for c in columns}
    for a_i, a in enumerate(gpu_cols):
        for b in gpu_cols[a_i + 1 :]:
            ab, ba = kinds[(a, b)], kinds[(b, a)]
            if ab != ba:
                raise TopologyError(
                    f"nvidia-smi line {rows[b].lineno}: {b}-{a} shows {rows[b].cells[columns.index(a)]!r} but "
                    f"line {rows[a].lineno} shows {a}-{b} as {rows[a].cells[columns.index(b)]!r}: {rows[b].text!r}"
                )
            if ab[0] == "NV":
                nv[(gpu_id[a], gpu_id[b])] = ab[1]
            elif ab[0] in _SAME_SWITCH:
                parent[_find(parent, a)] = _find(parent, b)
        for nic in nic_cols:
            if kinds[(a, nic)][0] in _SAME_SWITCH:
                parent[_find(parent, a)] = _find(parent, nic)

    links, switches = _nvlinks(gpus, nv, link_gbps)
    groups: dict[str, list[int]] = {}
    for c in gpu_cols:
        groups.setdefault(_find(parent, c), []).append(gpu_id[c])
    switch_groups = tuple(tuple(sorted(g)) for g in sorted(groups.values(), key=min))
    return Topology(
        gpus=tuple(gpus),
        links=links,
        name=name,
        switches=switches,
        pcie=PCIeChannel(pcie_gbps, switch_groups),
        source="nvidia-smi topo -m",
    )


def _nvlinks(gpus: list[int], nv: dict[tuple[int, int], int], link_gbps: float) -> tuple[tuple[Link, ...], tuple[str, ...]]:
    """Direct NVLink bundles, or one switch when the matrix can only be a fabric."""
    n = len(gpus)
    counts = set(nv.values())
    complete = n >= 2 and len(nv) == n * (n - 1) // 2
    if complete and len(counts) == 1:
        k = counts.pop()
        if k * (n - 1) > MAX_NVLINKS_PER_GPU:
            links = tuple(Link(g, SWITCH_ID, "nvlink", k, k * link_gbps) for g in gpus)
            return links, (SWITCH_ID,)
    order = {g: i for i, g in enumerate(gpus)}
    pairs = sorted(nv.items(), key=lambda item: (order[item[0][0]], order[item[0][1]]))
    return tuple(Link(a, b, "nvlink", k, k * link_gbps) for (a, b), k in pairs), ()
