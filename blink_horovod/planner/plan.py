"""The planner's output: weighted spanning trees, as ``blink-plan/1``.

A :class:`Plan` lists :class:`Tree` s; each is an arborescence out of its
root whose ``edges`` are ``(parent, child)`` pairs and which carries
``fraction`` of the bytes, in list order (docs/formats.md, Plan file).

``validate_plan`` checks the structural invariants against a topology: each
tree spans the allocation exactly once, every nvlink edge is a direct link or a
route through a shared switch, fractions sum to 1, and (allreduce) GPU i roots
exactly the i-th 1/n of the bytes.  Capacity and optimality are checked by
:mod:`blink_horovod.planner.load` and by the tests' own independent checker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from ..errors import PlanError
from ..topology.model import Topology, is_int, load_json

__all__ = ["CHANNELS", "COLLECTIVES", "FORMAT", "Plan", "Tree", "validate_plan"]

FORMAT = "blink-plan/1"
CHANNELS = ("nvlink", "pcie")
COLLECTIVES = ("broadcast", "allreduce")
FRACTION_TOL = 1e-9


@dataclass(frozen=True)
class Tree:
    """One weighted spanning arborescence: ``edges`` are ``(parent, child)``."""

    root: int
    fraction: float
    edges: tuple[tuple[int, int], ...]
    channel: str = "nvlink"

    def children(self) -> dict[int, list[int]]:
        """Parent -> children, in edge order."""
        out: dict[int, list[int]] = {}
        for p, c in self.edges:
            out.setdefault(p, []).append(c)
        return out

    def parent(self) -> dict[int, int]:
        """Child -> parent."""
        return {c: p for p, c in self.edges}

    def depth(self) -> int:
        """Longest root-to-leaf path, in edges."""
        kids = self.children()
        best, stack = 0, [(self.root, 0)]
        while stack:
            v, d = stack.pop()
            best = max(best, d)
            stack.extend((c, d + 1) for c in kids.get(v, ()))
        return best

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "fraction": self.fraction,
            "channel": self.channel,
            "edges": [list(e) for e in self.edges],
        }


@dataclass(frozen=True)
class Plan:
    """What the planner decided for one collective on one allocation."""

    collective: str
    topology: str
    gpus: tuple[int, ...]
    root: int | None
    trees: tuple[Tree, ...]
    rate_gbps: float
    optimum_gbps: float
    nvlink_optimum_gbps: float | None = None
    channels: tuple[str, ...] = ("nvlink",)
    # Optional, informational fields (docs/formats.md allows added optional fields).
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def n(self) -> int:
        return len(self.gpus)

    def trees_on(self, channel: str) -> tuple[Tree, ...]:
        return tuple(t for t in self.trees if t.channel == channel)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "collective": self.collective,
            "topology": self.topology,
            "gpus": list(self.gpus),
            "root": self.root,
            "channels": list(self.channels),
            "rate_gbps": self.rate_gbps,
            "optimum_gbps": self.optimum_gbps,
        }
        if self.nvlink_optimum_gbps is not None:
            out["nvlink_optimum_gbps"] = self.nvlink_optimum_gbps
        out["trees"] = [t.to_dict() for t in self.trees]
        out.update({k: v for k, v in self.extras.items() if k not in out})
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Parse a ``blink-plan/1`` mapping; structural errors raise :class:`PlanError`."""
        if not isinstance(data, Mapping):
            raise PlanError(f"plan: expected a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise PlanError(f"format: unknown plan format {fmt!r} (expected {FORMAT!r})")
        coll = data.get("collective")
        if coll not in COLLECTIVES:
            raise PlanError(f"collective: expected one of {', '.join(COLLECTIVES)}, got {coll!r}")
        gpus = data.get("gpus")
        if not isinstance(gpus, list) or not gpus or not all(is_int(g) for g in gpus):
            raise PlanError(f"gpus: expected a non-empty list of GPU ids, got {gpus!r}")
        root = data.get("root")
        if coll == "broadcast" and not is_int(root):
            raise PlanError(f"root: a broadcast plan needs an integer root, got {root!r}")
        if coll == "allreduce" and root is not None:
            raise PlanError(f"root: an allreduce plan has root null, got {root!r}")
        trees_raw = data.get("trees")
        if not isinstance(trees_raw, list) or not trees_raw:
            raise PlanError(f"trees: expected a non-empty list, got {trees_raw!r}")
        trees = []
        for i, t in enumerate(trees_raw):
            if not isinstance(t, Mapping):
                raise PlanError(f"trees[{i}]: expected an object, got {t!r}")
            if not is_int(t.get("root")):
                raise PlanError(f"trees[{i}].root: expected a GPU id, got {t.get('root')!r}")
            frac = t.get("fraction")
            if _number(frac) is None or frac < 0:
                raise PlanError(f"trees[{i}].fraction: expected a number in [0, 1], got {frac!r}")
            channel = t.get("channel", "nvlink")
            if channel not in CHANNELS:
                raise PlanError(f"trees[{i}].channel: expected one of {', '.join(CHANNELS)}, got {channel!r}")
            edges = t.get("edges")
            if not isinstance(edges, list) or not all(
                isinstance(e, list) and len(e) == 2 and all(is_int(x) for x in e) for e in edges
            ):
                raise PlanError(f"trees[{i}].edges: expected [[parent, child], ...], got {edges!r}")
            trees.append(Tree(t["root"], float(frac), tuple((e[0], e[1]) for e in edges), channel))
        known = {"format", "collective", "topology", "gpus", "root", "channels", "rate_gbps", "optimum_gbps", "nvlink_optimum_gbps", "trees"}
        channels = data.get("channels") or sorted({t.channel for t in trees}, key=CHANNELS.index)
        if not isinstance(channels, list) or not all(isinstance(c, str) and c in CHANNELS for c in channels):
            raise PlanError(f"channels: expected a list of {', '.join(CHANNELS)}, got {channels!r}")
        rates = {}
        for key in ("rate_gbps", "optimum_gbps", "nvlink_optimum_gbps"):
            value = data.get(key, None if key == "nvlink_optimum_gbps" else 0.0)
            if value is not None and (_number(value) is None or value < 0):
                raise PlanError(f"{key}: expected a non-negative number of GB/s, got {value!r}")
            rates[key] = None if value is None else float(value)
        plan = cls(
            collective=coll,
            topology=str(data.get("topology", "custom")),
            gpus=tuple(gpus),
            root=root,
            trees=tuple(trees),
            rate_gbps=rates["rate_gbps"],
            optimum_gbps=rates["optimum_gbps"],
            nvlink_optimum_gbps=rates["nvlink_optimum_gbps"],
            channels=tuple(channels),
            extras={k: v for k, v in data.items() if k not in known},
        )
        validate_plan(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(load_json(text, PlanError, "plan: ", "a JSON plan"))


def _number(x: Any) -> float | None:
    """``x`` as a finite float, or None (bools, non-numbers, inf, nan, ints beyond float range)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        value = float(x)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def validate_plan(plan: Plan, topology: Topology | None = None) -> None:
    """Check the structural invariants of ``plan`` (and its edges against ``topology``).

    Raises
    ------
    PlanError
        naming the tree, the edge or the value that breaks an invariant.
    """
    gpus = list(plan.gpus)
    if len(set(gpus)) != len(gpus):
        raise PlanError(f"gpus: duplicate GPU ids in {gpus}")
    gset = set(gpus)
    if plan.collective == "broadcast" and plan.root not in gset:
        raise PlanError(f"root: {plan.root!r} is not in the allocation {gpus}")
    total = math.fsum(t.fraction for t in plan.trees)
    if abs(total - 1.0) > 1e-6:
        raise PlanError(f"trees: fractions sum to {total!r}, not 1")
    direct: set[frozenset] = set()
    switched: dict[int, set[str]] = {}
    if topology is not None:
        for link in topology.links:
            if link.kind != "nvlink":
                continue
            if isinstance(link.src, int) and isinstance(link.dst, int):
                direct.add(frozenset((link.src, link.dst)))
            else:
                g, s = (link.src, link.dst) if isinstance(link.src, int) else (link.dst, link.src)
                switched.setdefault(g, set()).add(s)  # type: ignore[arg-type]
    for i, tree in enumerate(plan.trees):
        if tree.root not in gset:
            raise PlanError(f"trees[{i}].root: {tree.root} is not in the allocation {gpus}")
        if plan.collective == "broadcast" and tree.root != plan.root:
            raise PlanError(f"trees[{i}].root: broadcast tree rooted at {tree.root}, plan root is {plan.root}")
        children = [c for _, c in tree.edges]
        if len(tree.edges) != len(gpus) - 1 or set(children) != gset - {tree.root} or len(set(children)) != len(children):
            raise PlanError(f"trees[{i}]: not a spanning arborescence of {gpus} from root {tree.root}: edges {list(map(list, tree.edges))}")
        # Every vertex reaches the root by parent pointers: no cycles.
        parent = tree.parent()
        for v in children:
            seen, u = set(), v
            while u != tree.root:
                if u in seen or u not in parent:
                    raise PlanError(f"trees[{i}]: GPU {v} does not reach root {tree.root} (cycle or gap)")
                seen.add(u)
                u = parent[u]
        for p, c in tree.edges:
            if p not in gset:
                raise PlanError(f"trees[{i}].edges: [{p}, {c}] leaves the allocation {gpus}")
            if topology is not None and tree.channel == "nvlink":
                if frozenset((p, c)) not in direct and not (switched.get(p, set()) & switched.get(c, set())):
                    raise PlanError(f"trees[{i}].edges: [{p}, {c}] is not a direct NVLink nor a route through a shared switch")
    if plan.collective == "allreduce":
        _check_root_shares(plan)


def _check_root_shares(plan: Plan) -> None:
    """GPU i roots exactly the i-th contiguous 1/n of the bytes (docs/formats.md, Plan file)."""
    n = len(plan.gpus)
    start = 0.0
    for i, tree in enumerate(plan.trees):
        end = start + tree.fraction
        mid = (start + end) / 2
        owner = plan.gpus[min(int(mid * n), n - 1)]
        if tree.fraction > FRACTION_TOL and tree.root != owner:
            raise PlanError(
                f"trees[{i}].root: bytes [{start:.6f}, {end:.6f}) belong to GPU {owner}'s 1/{n}, tree is rooted at {tree.root}"
            )
        # No tree may straddle a boundary between two roots' shares.
        lo, hi = start * n, end * n
        if tree.fraction > FRACTION_TOL and math.floor(lo + 1e-7) != math.ceil(hi - 1e-7) - 1:
            raise PlanError(f"trees[{i}]: bytes [{start:.6f}, {end:.6f}) straddle two roots' 1/{n} shares")
        start = end
