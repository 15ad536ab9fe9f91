"""Hand-built valid plans and exactly checkable data, for the schedule and runtime tests.

The plans stand in for the planner's output only in *shape* (valid
blink-plan/1 trees and fractions, checked by ``validate_plan`` against the
topology): the schedule layer must compile and prove any valid plan, not only
optimal ones.  The data are small integers, exactly representable in every
dtype (nccl-tests' idea), so results compare exactly.
"""

from __future__ import annotations

import random

import numpy as np

from blink_horovod.planner.plan import Plan, Tree, validate_plan
from blink_horovod.runtime.dtypes import numpy_dtype
from blink_horovod.topology.machines import resolve
from blink_horovod.topology.model import Topology

__all__ = [
    "allreduce_plan",
    "broadcast_plan",
    "expected",
    "nvlink_neighbours",
    "random_tree",
    "sample_plans",
    "values",
]


def nvlink_neighbours(topo: Topology) -> dict[int, list[int]]:
    """GPU -> GPUs it reaches by a direct NVLink or through a shared switch."""
    adj: dict[int, set[int]] = {g: set() for g in topo.gpus}
    via: dict[str, set[int]] = {}
    for link in topo.links:
        if link.kind != "nvlink":
            continue
        a, b = link.src, link.dst
        if isinstance(a, int) and isinstance(b, int):
            adj[a].add(b)
            adj[b].add(a)
        else:
            g, s = (a, b) if isinstance(a, int) else (b, a)
            via.setdefault(s, set()).add(g)  # type: ignore[arg-type]
    for members in via.values():
        for g in members:
            adj[g] |= members - {g}
    return {g: sorted(v) for g, v in adj.items()}


def random_tree(topo: Topology, root: int, rng: random.Random, channel: str = "nvlink", shape: str = "random") -> tuple[tuple[int, int], ...]:
    """Edges of a spanning arborescence from ``root``: random growth, a DFS chain or a BFS star-ish tree."""
    gpus = list(topo.gpus)
    adj = {g: [h for h in gpus if h != g] for g in gpus} if channel == "pcie" else nvlink_neighbours(topo)
    seen, edges, frontier = {root}, [], [root]
    while frontier:
        if shape == "chain":
            v = frontier[-1]
        elif shape == "bfs":
            v = frontier[0]
        else:
            v = frontier[rng.randrange(len(frontier))]
        nb = [u for u in adj[v] if u not in seen]
        rng.shuffle(nb)
        if shape == "chain":
            if nb:
                seen.add(nb[0])
                edges.append((v, nb[0]))
                frontier.append(nb[0])
            else:
                frontier.pop()
            continue
        frontier.remove(v)
        for u in nb:
            seen.add(u)
            edges.append((v, u))
            frontier.append(u)
    if len(seen) != len(gpus):
        raise ValueError(f"{topo.name} {gpus}: NVLink does not connect the allocation")
    return tuple(edges)


def allreduce_plan(topo: Topology, per_root: int = 2, seed: int = 0, pcie: bool = False, shape: str = "random") -> Plan:
    """``per_root`` trees per GPU of random weights, each GPU rooting exactly 1/n."""
    rng = random.Random(seed)
    n = topo.n
    trees = []
    for g in topo.gpus:
        ws = [rng.uniform(0.5, 1.5) for _ in range(per_root)]
        for j, w in enumerate(ws):
            ch = "pcie" if pcie and j == per_root - 1 else "nvlink"
            trees.append(Tree(g, w / sum(ws) / n, random_tree(topo, g, rng, ch, shape), ch))
    plan = Plan("allreduce", topo.name, tuple(topo.gpus), None, tuple(trees), 1.0, 1.0, channels=("nvlink", "pcie") if pcie else ("nvlink",))
    validate_plan(plan, topo)
    return plan


def broadcast_plan(topo: Topology, root: int | None = None, k: int = 6, seed: int = 0, pcie: bool = False, shape: str = "random") -> Plan:
    """``k`` trees from ``root`` (default: the first GPU) of random weights."""
    rng = random.Random(seed)
    root = topo.gpus[0] if root is None else root
    ws = [rng.uniform(0.5, 1.5) for _ in range(k)]
    trees = []
    for j, w in enumerate(ws):
        ch = "pcie" if pcie and j == k - 1 else "nvlink"
        trees.append(Tree(root, w / sum(ws), random_tree(topo, root, rng, ch, shape), ch))
    plan = Plan("broadcast", topo.name, tuple(topo.gpus), root, tuple(trees), 1.0, 1.0, channels=("nvlink", "pcie") if pcie else ("nvlink",))
    validate_plan(plan, topo)
    return plan


def sample_plans() -> list[tuple[str, Plan]]:
    """A spread of shapes: DGX-1V/1P allocations, DGX-2 (switch), chains, PCIe trees, n=1, n=2."""
    out = []
    v = resolve("dgx1v")
    out.append(("dgx1v-ar-2perroot", allreduce_plan(v, 2, seed=1)))
    out.append(("dgx1v-ar-chain", allreduce_plan(v, 1, seed=2, shape="chain")))
    out.append(("dgx1v-ar-pcie", allreduce_plan(v, 2, seed=3, pcie=True)))
    out.append(("dgx1v-bc-6", broadcast_plan(v, k=6, seed=4)))
    out.append(("dgx1v-bc-pcie", broadcast_plan(v, root=5, k=3, seed=5, pcie=True)))
    sub = resolve("dgx1v:1,2,5,6")
    out.append(("dgx1v-1256-ar", allreduce_plan(sub, 2, seed=6, shape="bfs")))
    out.append(("dgx1v-1256-bc", broadcast_plan(sub, root=6, k=2, seed=7, shape="chain")))
    out.append(("dgx1p-015-ar", allreduce_plan(resolve("dgx1p:0,1,5"), 1, seed=8)))
    out.append(("dgx2-6-ar", allreduce_plan(resolve("dgx2:0,1,2,3,9,15"), 1, seed=9, shape="bfs")))
    out.append(("two-ar", allreduce_plan(resolve("dgx1v:0,3"), 2, seed=10)))
    out.append(("two-bc", broadcast_plan(resolve("dgx1v:0,3"), root=3, k=1)))
    one = Plan("allreduce", "dgx1v", (4,), None, (Tree(4, 1.0, ()),), 0.0, 0.0)
    out.append(("one-ar", one))
    out.append(("one-bc", Plan("broadcast", "dgx1v", (4,), 4, (Tree(4, 1.0, ()),), 0.0, 0.0)))
    return out


def values(rank: int, count: int, dtype: str, op: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100 + rank)
    if op == "product":
        v = rng.choice([1, 2, 1, 1] if dtype == "uint8" else [1, -1, 2, 1], count)
    elif op == "average":
        v = 4 * rng.integers(0 if dtype == "uint8" else -3, 4, count) + 2
    else:
        v = rng.integers(0 if dtype == "uint8" else -8, 9, count)
    return v.astype(numpy_dtype(dtype)) if dtype != "bfloat16" else v.astype(np.float32).astype(numpy_dtype(dtype))


def expected(n: int, count: int, dtype: str, op: str, seed: int = 0) -> np.ndarray:
    xs = [values(r, count, dtype, op, seed).astype(np.float64) for r in range(n)]
    if op in ("sum", "average"):
        out = np.sum(xs, axis=0)
        return out / n if op == "average" else out
    return {"min": np.minimum, "max": np.maximum, "product": np.multiply}[op].reduce(xs)
