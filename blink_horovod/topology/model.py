"""The machine model: GPUs, switches and full-duplex links, as ``blink-topology/1``.

A topology is a capacitated graph (Blink, section 3.1: "GPUs as vertices and
NVLink or PCIe connections as directed, bandwidth-capacity edges").  Links are
undirected and full duplex; ``bandwidth_gbps`` is a bundle's bandwidth in ONE
direction in GB/s, and repeated pairs add up (docs/formats.md, Topology file).

The class is a small validated value in the manner of msccl-tools'
``Topology``: every constructor path goes through :meth:`Topology.from_dict`
or :func:`validate`, and bad data raises :class:`TopologyError` naming the
field and the value.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from ..errors import TopologyError

__all__ = ["FORMAT", "LINK_KINDS", "Link", "PCIeChannel", "Topology", "Vertex"]

FORMAT = "blink-topology/1"
LINK_KINDS = ("nvlink", "pcie", "net")

Vertex = int | str  # a GPU id (int) or a switch id (str)


@dataclass(frozen=True)
class Link:
    """One bundle of ``count`` physical links between ``src`` and ``dst``.

    ``bandwidth_gbps`` is the bundle's bandwidth in one direction (GB/s).
    """

    src: Vertex
    dst: Vertex
    kind: str = "nvlink"
    count: int = 1
    bandwidth_gbps: float = 25.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "kind": self.kind,
            "count": self.count,
            "bandwidth_gbps": self.bandwidth_gbps,
        }


@dataclass(frozen=True)
class PCIeChannel:
    """The PCIe channel as a whole: per-GPU bandwidth and the switch groups.

    GPUs of one group sit under one PCIe switch; groups meet at the host.
    """

    bandwidth_gbps: float
    switch_groups: tuple[tuple[int, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth_gbps": self.bandwidth_gbps,
            "switch_groups": [list(g) for g in self.switch_groups],
        }

    def group_of(self, gpu: int) -> int | None:
        """Index of the switch group holding ``gpu`` (None when ungrouped)."""
        for i, group in enumerate(self.switch_groups):
            if gpu in group:
                return i
        return None


@dataclass(frozen=True)
class Topology:
    """A validated machine, or an allocation of one.

    Build it with :meth:`from_dict` (or the named constructors of
    :mod:`blink_horovod.topology.machines`); the constructor itself validates
    too, so no invalid ``Topology`` exists.
    """

    gpus: tuple[int, ...]
    links: tuple[Link, ...]
    name: str = "custom"
    switches: tuple[str, ...] = ()
    pcie: PCIeChannel | None = None
    # Optional, informational: where a probed topology came from.
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        validate(self)

    # -- views -------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.gpus)

    def vertices(self) -> tuple[Vertex, ...]:
        return tuple(self.gpus) + tuple(self.switches)

    def capacities(self, kind: str = "nvlink") -> dict[tuple[Vertex, Vertex], float]:
        """One-direction capacity per unordered vertex pair, repeated links added.

        Keys are ``(a, b)`` with ``a`` before ``b`` in :meth:`vertices` order.
        """
        order = {v: i for i, v in enumerate(self.vertices())}
        caps: dict[tuple[Vertex, Vertex], float] = {}
        for link in self.links:
            if link.kind != kind:
                continue
            a, b = sorted((link.src, link.dst), key=order.__getitem__)
            caps[(a, b)] = caps.get((a, b), 0.0) + link.bandwidth_gbps
        return caps

    def link_count(self, u: Vertex, v: Vertex, kind: str = "nvlink") -> int:
        return sum(
            link.count for link in self.links if link.kind == kind and {link.src, link.dst} == {u, v}
        )

    def has_kind(self, kind: str) -> bool:
        return any(link.kind == kind for link in self.links)

    # -- allocations -------------------------------------------------------
    def allocate(self, gpus: Sequence[int]) -> Topology:
        """The sub-machine a job got: ``gpus`` and the links among them.

        Switch vertices stay when at least one allocated GPU reaches them; the
        PCIe groups are cut down to the allocated GPUs.
        """
        gpus = tuple(gpus)
        if not gpus:
            raise TopologyError("gpus: empty GPU list")
        bad = [g for g in gpus if not is_int(g)]
        if bad:
            raise TopologyError(f"gpus: GPU id must be an integer, got {bad[0]!r} in {list(gpus)}")
        if len(set(gpus)) != len(gpus):
            dup = sorted({g for g in gpus if gpus.count(g) > 1})
            raise TopologyError(f"gpus: duplicate GPU ids {dup} in {list(gpus)}")
        unknown = [g for g in gpus if g not in self.gpus]
        if unknown:
            raise TopologyError(f"gpus: GPU {unknown[0]} is not on machine {self.name!r} (it has {list(self.gpus)})")
        keep = set(gpus) | set(self.switches)
        links = tuple(l for l in self.links if l.src in keep and l.dst in keep)
        used_switches = {v for l in links for v in (l.src, l.dst) if isinstance(v, str)}
        # A switch only matters if it still joins allocated GPUs.
        switches = tuple(s for s in self.switches if s in used_switches)
        links = tuple(
            l for l in links if (not isinstance(l.src, str) or l.src in switches) and (not isinstance(l.dst, str) or l.dst in switches)
        )
        pcie = None
        if self.pcie is not None:
            groups = tuple(tuple(g for g in grp if g in gpus) for grp in self.pcie.switch_groups)
            pcie = PCIeChannel(self.pcie.bandwidth_gbps, tuple(g for g in groups if g))
        whole = tuple(sorted(gpus)) == tuple(sorted(self.gpus))
        name = self.name if whole else f"{self.name}:{','.join(map(str, gpus))}"
        return Topology(gpus=gpus, links=links, name=name, switches=switches, pcie=pcie, source=self.source)

    # -- I/O -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "name": self.name,
            "gpus": list(self.gpus),
            "links": [l.to_dict() for l in self.links],
        }
        if self.switches:
            out["switches"] = list(self.switches)
        if self.pcie is not None:
            out["pcie"] = self.pcie.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def content_hash(self) -> str:
        """Hash of what planning depends on (not the name): the plan-cache key part."""
        d = self.to_dict()
        d.pop("name", None)
        d["links"] = sorted(
            json.dumps(l, sort_keys=True) for l in d["links"]
        )
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:24]

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> Topology:
        """Parse and validate a ``blink-topology/1`` mapping."""
        if not isinstance(data, Mapping):
            raise TopologyError(f"topology: expected a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise TopologyError(f"format: unknown topology format {fmt!r} (expected {FORMAT!r})")
        unknown = set(data) - {"format", "name", "gpus", "links", "switches", "pcie"}
        # Unknown keys are allowed (formats grow by optional fields) but ignored.
        del unknown
        name = data.get("name", "custom")
        if not isinstance(name, str) or not name:
            raise TopologyError(f"name: expected a non-empty string, got {name!r}")
        gpus = data.get("gpus")
        if not isinstance(gpus, list) or not gpus:
            raise TopologyError(f"gpus: expected a non-empty list of GPU ids, got {gpus!r}")
        for g in gpus:
            if not is_int(g) or g < 0:
                raise TopologyError(f"gpus: GPU id must be a non-negative integer, got {g!r}")
        switches = data.get("switches", [])
        if not isinstance(switches, list):
            raise TopologyError(f"switches: expected a list of switch ids, got {switches!r}")
        for s in switches:
            if not isinstance(s, str) or not s:
                raise TopologyError(f"switches: switch id must be a non-empty string, got {s!r}")
        links_raw = data.get("links", [])
        if not isinstance(links_raw, list):
            raise TopologyError(f"links: expected a list, got {links_raw!r}")
        links = []
        for i, raw in enumerate(links_raw):
            if not isinstance(raw, Mapping):
                raise TopologyError(f"links[{i}]: expected an object, got {raw!r}")
            for key in ("src", "dst"):
                if key not in raw:
                    raise TopologyError(f"links[{i}].{key}: missing")
            count = raw.get("count", 1)
            if not is_int(count) or count <= 0:
                raise TopologyError(f"links[{i}].count: expected a positive integer, got {count!r}")
            bw = raw.get("bandwidth_gbps")
            if bw is None:
                raise TopologyError(f"links[{i}].bandwidth_gbps: missing")
            links.append(
                Link(
                    src=raw["src"],
                    dst=raw["dst"],
                    kind=raw.get("kind", "nvlink"),
                    count=count,
                    bandwidth_gbps=_number(bw, f"links[{i}].bandwidth_gbps"),
                )
            )
        pcie = None
        if data.get("pcie") is not None:
            raw = data["pcie"]
            if not isinstance(raw, Mapping):
                raise TopologyError(f"pcie: expected an object, got {raw!r}")
            if "bandwidth_gbps" not in raw:
                raise TopologyError("pcie.bandwidth_gbps: missing")
            groups = raw.get("switch_groups", [])
            if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
                raise TopologyError(f"pcie.switch_groups: expected a list of GPU lists, got {groups!r}")
            pcie = PCIeChannel(
                _number(raw["bandwidth_gbps"], "pcie.bandwidth_gbps"),
                tuple(tuple(g) for g in groups),
            )
        return cls(
            gpus=tuple(gpus),
            links=tuple(links),
            name=name,
            switches=tuple(switches),
            pcie=pcie,
            source=source,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> Topology:
        data = load_json(text, TopologyError, f"{source}: " if source else "", "a JSON topology")
        return cls.from_dict(data, source=source)


def load_json(text: str, error: type[Exception], where: str, what: str) -> Any:
    """``text`` parsed as JSON (the topology and plan formats); anything else raises ``error``
    naming the place (``where``, e.g. ``"plan: "``) and, where it is not JSON at all, ``what`` it should be."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        # Not UTF-8, an integer of more than 4300 digits, or nesting too deep to parse.
        raise error(f"{where}not {what}: {type(exc).__name__}: {str(exc)[:120]}") from None


def is_int(x: Any) -> bool:
    """An ``int`` that is not a ``bool`` (JSON integers as Python reads them)."""
    return isinstance(x, int) and not isinstance(x, bool)




def _number(x: Any, fieldname: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TopologyError(f"{fieldname}: expected a positive number of GB/s, got {x!r}")
    try:
        x = float(x)
    except OverflowError:  # an integer beyond float range (JSON allows 1000...0)
        x = math.inf
    if not math.isfinite(x) or x <= 0:
        raise TopologyError(f"{fieldname}: bandwidth must be positive and finite, got {x!r}")
    return x


def validate(topo: Topology) -> None:
    """Check every invariant of ``blink-topology/1``; raise :class:`TopologyError`."""
    if not topo.gpus:
        raise TopologyError("gpus: empty GPU list")
    seen: set[int] = set()
    for g in topo.gpus:
        if not is_int(g) or g < 0:
            raise TopologyError(f"gpus: GPU id must be a non-negative integer, got {g!r}")
        if g in seen:
            raise TopologyError(f"gpus: duplicate GPU id {g}")
        seen.add(g)
    if len(set(topo.switches)) != len(topo.switches):
        raise TopologyError(f"switches: duplicate switch ids in {list(topo.switches)}")
    vertices = set(topo.gpus) | set(topo.switches)
    for i, link in enumerate(topo.links):
        for key in ("src", "dst"):
            v = getattr(link, key)
            # Only ints (GPUs) and strs (switches) are vertices: 0.0 == 0 and lists are unhashable.
            if not (is_int(v) or isinstance(v, str)) or v not in vertices or (isinstance(v, str) and v not in topo.switches):
                raise TopologyError(f"links[{i}].{key}: link to unknown vertex {v!r}")
        if link.src == link.dst:
            raise TopologyError(f"links[{i}]: link from {link.src!r} to itself")
        if link.kind not in LINK_KINDS:
            raise TopologyError(f"links[{i}].kind: unknown link kind {link.kind!r} (expected one of {', '.join(LINK_KINDS)})")
        if not is_int(link.count) or link.count <= 0:
            raise TopologyError(f"links[{i}].count: expected a positive integer, got {link.count!r}")
        _number(link.bandwidth_gbps, f"links[{i}].bandwidth_gbps")
        if isinstance(link.src, str) and isinstance(link.dst, str):
            raise TopologyError(f"links[{i}]: switch-to-switch links ({link.src!r}-{link.dst!r}) are not modelled")
    if topo.pcie is not None:
        _number(topo.pcie.bandwidth_gbps, "pcie.bandwidth_gbps")
        placed: set[int] = set()
        for gi, group in enumerate(topo.pcie.switch_groups):
            for g in group:
                if not is_int(g) or g not in seen:
                    raise TopologyError(f"pcie.switch_groups[{gi}]: unknown GPU {g!r}")
                if g in placed:
                    raise TopologyError(f"pcie.switch_groups[{gi}]: GPU {g} is in two groups")
                placed.add(g)


def links_from_pairs(pairs: Iterable[tuple[Vertex, Vertex, int]], per_link_gbps: float, kind: str = "nvlink") -> tuple[Link, ...]:
    """Links from ``(u, v, count)`` triples of identical physical links."""
    return tuple(Link(u, v, kind, c, c * per_link_gbps) for u, v, c in pairs)
