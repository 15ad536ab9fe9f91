"""An independent checker of ``blink-plan/1`` plans: loads, capacities and the optimum.

It shares no code with ``blink_horovod.planner``: it reads the plan and the
topology as the JSON dicts of docs/formats.md (``to_dict()``) and
recomputes everything from the format's own words:

* structure: each tree an arborescence out of its root over the allocation,
  every nvlink edge a direct link or a route through a switch both GPUs
  reach, fractions summing to 1, broadcast trees rooted at the root,
  allreduce GPU i rooting exactly the i-th 1/n of the bytes;
* loads: broadcast shares flow parent -> child; allreduce shares load both
  directions of each edge once; a switch route loads ``u -> s`` and
  ``s -> v`` (spread over several shared switches in proportion to the
  narrower port); a pcie edge climbs from the GPU's port through its group's
  uplink to the host and down (each of ``pcie.bandwidth_gbps``); every
  resource must carry ``rate_gbps * load`` within its capacity;
* the optimum, by means the planner does not use: broadcast without switches
  = min over v of maxflow(root, v) (Edmonds' branching theorem, via
  networkx' max-flow); allreduce without switches = min over vertex
  partitions P of cross(P) / (|P| - 1) (Nash-Williams / Tutte, enumerated
  for n <= 8); everything else (switches, PCIe, bigger n) by a column
  generation of its own (scipy ``linprog`` solved cold, its own Kruskal with
  union-find, networkx' Edmonds arborescence).

``random_machine(seed)`` makes the seeded heterogeneous machines of the
acceptance sweep (4-12 GPUs, mixed link counts and speeds, some with a
switch and a PCIe channel).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import networkx as nx
import numpy as np
from scipy.optimize import linprog

__all__ = [
    "CheckError",
    "check_plan",
    "connected_subsets",
    "independent_optimum",
    "random_machine",
    "resource_model",
]

CAP_TOL = 1e-6


class CheckError(AssertionError):
    """A plan breaks an invariant."""


# --------------------------------------------------------------------------- model
def _is_gpu(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resource_model(topo: dict, collective: str, channel: str) -> tuple[dict, dict]:
    """``(capacity, routes)``: resources (string keys) and, per GPU pair, ``{resource: bytes per byte}``.

    Broadcast resources are link directions ``"a>b"``; allreduce resources are
    links ``"a~b"`` (both directions loaded once, capacity min of the two).
    Routes are keyed by ordered GPU pairs (both orders for allreduce).
    """
    gpus = topo["gpus"]
    directed = collective == "broadcast"
    cap: dict[str, float] = {}
    routes: dict[tuple[int, int], dict[str, float]] = {}

    def key(a: Any, b: Any) -> str:
        if directed:
            return f"{a!r}>{b!r}"
        x, y = sorted((repr(a), repr(b)))
        return f"{x}~{y}"

    if channel == "nvlink":
        bundle: dict[frozenset, float] = {}
        for link in topo["links"]:
            if link.get("kind", "nvlink") != "nvlink":
                continue
            pair = frozenset((link["src"], link["dst"]))
            bundle[pair] = bundle.get(pair, 0.0) + float(link["bandwidth_gbps"])
        for pair, bw in bundle.items():
            a, b = tuple(pair)
            for k in {key(a, b), key(b, a)}:
                cap[k] = bw
        port: dict[int, dict[str, float]] = {}
        for pair, bw in bundle.items():
            a, b = tuple(pair)
            if _is_gpu(a) and not _is_gpu(b):
                port.setdefault(a, {})[b] = bw
            elif _is_gpu(b) and not _is_gpu(a):
                port.setdefault(b, {})[a] = bw
        for u in gpus:
            for v in gpus:
                if u == v:
                    continue
                if frozenset((u, v)) in bundle:
                    routes[(u, v)] = {key(u, v): 1.0}
                    continue
                shared = set(port.get(u, {})) & set(port.get(v, {}))
                if not shared:
                    continue
                width = {s: min(port[u][s], port[v][s]) for s in shared}
                tot = sum(width.values())
                r: dict[str, float] = {}
                for s in shared:
                    for k in (key(u, s), key(s, v)):
                        r[k] = r.get(k, 0.0) + width[s] / tot
                routes[(u, v)] = r
    elif channel == "pcie":
        pc = topo.get("pcie")
        if pc is None:
            raise CheckError("plan uses pcie but the topology has no pcie channel")
        bw = float(pc["bandwidth_gbps"])
        up = {g: "host" for g in gpus}
        for i, grp in enumerate(pc.get("switch_groups", [])):
            for g in grp:
                up[g] = f"sw{i}"
        for g in gpus:
            for k in {key(g, up[g]), key(up[g], g)}:
                cap[k] = bw
        for s in set(up.values()) - {"host"}:
            for k in {key(s, "host"), key("host", s)}:
                cap[k] = bw
        for u in gpus:
            for v in gpus:
                if u == v:
                    continue
                hops = [(u, up[u])]
                if up[u] != up[v]:
                    if up[u] != "host":
                        hops.append((up[u], "host"))
                    if up[v] != "host":
                        hops.append(("host", up[v]))
                hops.append((up[v], v))
                r = {}
                for a, b in hops:
                    r[key(a, b)] = r.get(key(a, b), 0.0) + 1.0
                routes[(u, v)] = r
    else:
        raise CheckError(f"unknown channel {channel!r}")
    return cap, routes


# --------------------------------------------------------------------------- plans
def _check_tree(i: int, tree: dict, gpus: list[int]) -> None:
    root, edges = tree["root"], [tuple(e) for e in tree["edges"]]
    if root not in gpus:
        raise CheckError(f"trees[{i}]: root {root} not in {gpus}")
    children = [c for _, c in edges]
    if sorted(children) != sorted(set(gpus) - {root}):
        raise CheckError(f"trees[{i}]: children {children} are not every GPU but the root once")
    parent = {c: p for p, c in edges}
    for v in children:
        seen, u = set(), v
        while u != root:
            if u in seen or u not in parent:
                raise CheckError(f"trees[{i}]: {v} does not reach root {root}")
            seen.add(u)
            u = parent[u]


def plan_loads(plan: dict, topo: dict) -> dict[str, tuple[dict, dict]]:
    """Per channel: ``(capacity, load)`` with load in bytes per byte of the buffer."""
    out: dict[str, tuple[dict, dict]] = {}
    for i, tree in enumerate(plan["trees"]):
        ch = tree.get("channel", "nvlink")
        if ch not in out:
            cap, routes = resource_model(topo, plan["collective"], ch)
            out[ch] = (cap, {}, routes)  # type: ignore[assignment]
        cap, load, routes = out[ch]  # type: ignore[misc]
        for p, c in tree["edges"]:
            r = routes.get((p, c))
            if r is None:
                raise CheckError(f"trees[{i}]: edge [{p}, {c}] is not a {ch} route")
            for k, coef in r.items():
                load[k] = load.get(k, 0.0) + tree["fraction"] * coef
    return {ch: (cap, load) for ch, (cap, load, _) in out.items()}  # type: ignore[misc]


def check_plan(plan: dict, topo: dict) -> float:
    """Check every invariant of ``plan`` on ``topo``; returns the rate its loads allow (GB/s).

    Raises
    ------
    CheckError
        naming the broken invariant.
    """
    gpus = list(topo["gpus"])
    if sorted(plan["gpus"]) != sorted(gpus):
        raise CheckError(f"plan gpus {plan['gpus']} != topology gpus {gpus}")
    order = list(plan["gpus"])
    n = len(order)
    total = math.fsum(t["fraction"] for t in plan["trees"])
    if abs(total - 1.0) > 1e-9:
        raise CheckError(f"fractions sum to {total}")
    if any(t["fraction"] < 0 for t in plan["trees"]):
        raise CheckError("negative fraction")
    for i, t in enumerate(plan["trees"]):
        _check_tree(i, t, gpus)
        if plan["collective"] == "broadcast" and t["root"] != plan["root"]:
            raise CheckError(f"trees[{i}]: broadcast tree rooted at {t['root']}, not {plan['root']}")
    if plan["collective"] == "allreduce" and n > 1:
        owned = {g: 0.0 for g in order}
        pos = 0.0
        for i, t in enumerate(plan["trees"]):
            lo, hi = pos, pos + t["fraction"]
            pos = hi
            if t["fraction"] <= 1e-12:
                continue
            k = order.index(t["root"])
            if lo < k / n - 1e-9 or hi > (k + 1) / n + 1e-9:
                raise CheckError(f"trees[{i}]: bytes [{lo}, {hi}) outside GPU {t['root']}'s share [{k}/{n}, {k + 1}/{n})")
            owned[t["root"]] += t["fraction"]
        for g, f in owned.items():
            if abs(f - 1.0 / n) > 1e-9:
                raise CheckError(f"GPU {g} roots {f} of the bytes, not 1/{n}")
    worst = 0.0
    for ch, (cap, load) in plan_loads(plan, topo).items():
        for k, l in load.items():
            if k not in cap:
                raise CheckError(f"{ch}: load on unknown resource {k}")
            worst = max(worst, l / cap[k])
    rate = 1.0 / worst if worst > 0 else 0.0
    if plan["rate_gbps"] > rate * (1 + CAP_TOL):
        raise CheckError(f"rate_gbps {plan['rate_gbps']} overloads a link: the loads allow only {rate}")
    return rate


# --------------------------------------------------------------------------- optima
def _kruskal(n: int, weight: dict[tuple[int, int], float]) -> list[tuple[int, int]] | None:
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    out = []
    for (u, v), _ in sorted(weight.items(), key=lambda kv: (kv[1], kv[0])):
        ru, rv = find(u), find(v)
        if ru != rv:
            parent[ru] = rv
            out.append((u, v))
    return out if len(out) == n - 1 else None


def _column_generation(topo: dict, collective: str, root: int | None, channel: str) -> float:
    """Max tree packing by column generation with cold ``linprog`` solves."""
    cap, routes = resource_model(topo, collective, channel)
    gpus = list(topo["gpus"])
    n = len(gpus)
    names = sorted(cap)
    idx = {k: i for i, k in enumerate(names)}
    c = np.array([cap[k] for k in names])
    scale = c.max()

    def load_of(edges: list[tuple[int, int]]) -> np.ndarray:
        v = np.zeros(len(names))
        for p, q in edges:
            for k, coef in routes[(p, q)].items():
                v[idx[k]] += coef
        return v

    def cheapest(y: np.ndarray) -> list[tuple[int, int]] | None:
        if collective == "allreduce":
            w = {}
            for a in range(n):
                for b in range(a + 1, n):
                    r = routes.get((gpus[a], gpus[b]))
                    if r is not None:
                        w[(a, b)] = sum(coef * y[idx[k]] for k, coef in r.items())
            t = _kruskal(n, w)
            return None if t is None else [(gpus[a], gpus[b]) for a, b in t]
        g = nx.DiGraph()
        g.add_nodes_from(gpus)
        for (u, v), r in routes.items():
            if v != root:
                g.add_edge(u, v, weight=sum(coef * y[idx[k]] for k, coef in r.items()))
        try:
            arb = nx.minimum_spanning_arborescence(g, attr="weight", preserve_attrs=False)
        except nx.NetworkXException:
            return None
        return list(arb.edges())

    first = cheapest(1.0 / c)
    if first is None:
        return 0.0
    cols = [load_of(first)]
    best = 0.0
    for _ in range(5000):
        a = np.stack(cols, axis=1)
        res = linprog(-np.ones(a.shape[1]), A_ub=a, b_ub=c / scale, bounds=(0, None), method="highs")
        assert res.status == 0, res.message
        value = -res.fun * scale
        y = -res.ineqlin.marginals
        t = cheapest(y)
        lt = load_of(t)
        cost = float(lt @ y)
        best = value
        if cost >= 1 - 1e-9:
            break
        if any(np.allclose(lt, col) for col in cols):
            break
        cols.append(lt)
    return best


def _maxflow_broadcast(topo: dict, root: int) -> float:
    g = nx.DiGraph()
    for link in topo["links"]:
        if link.get("kind", "nvlink") != "nvlink":
            continue
        for a, b in ((link["src"], link["dst"]), (link["dst"], link["src"])):
            prev = g.get_edge_data(a, b, {"capacity": 0.0})["capacity"]
            g.add_edge(a, b, capacity=prev + float(link["bandwidth_gbps"]))
    best = math.inf
    for v in topo["gpus"]:
        if v != root:
            if v not in g or root not in g:
                return 0.0
            best = min(best, nx.maximum_flow_value(g, root, v))
    return best


def _set_partitions(items: list[int]):
    if len(items) == 1:
        yield [items]
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


def _partition_allreduce(topo: dict) -> float:
    caps: dict[frozenset, float] = {}
    for link in topo["links"]:
        if link.get("kind", "nvlink") == "nvlink":
            pair = frozenset((link["src"], link["dst"]))
            caps[pair] = caps.get(pair, 0.0) + float(link["bandwidth_gbps"])
    best = math.inf
    for part in _set_partitions(list(topo["gpus"])):
        if len(part) < 2:
            continue
        where = {v: i for i, blk in enumerate(part) for v in blk}
        cross = sum(c for pair, c in caps.items() if len({where[v] for v in pair}) == 2)
        best = min(best, cross / (len(part) - 1))
    return best


def independent_optimum(topo: dict, collective: str, root: int | None, channels: list[str], *, cross_check: bool = False) -> float:
    """The best rate over ``channels`` (channels are separate hardware, so their optima add)."""
    total = 0.0
    switched = bool(topo.get("switches"))
    for ch in channels:
        if ch == "nvlink" and not any(l.get("kind", "nvlink") == "nvlink" for l in topo["links"]):
            continue
        if ch == "nvlink" and not switched and collective == "broadcast":
            value = _maxflow_broadcast(topo, root)
            if cross_check:
                other = _column_generation(topo, collective, root, ch)
                assert abs(other - value) <= 1e-6 * max(value, 1.0), (other, value)
        elif ch == "nvlink" and not switched and len(topo["gpus"]) <= 8:
            value = _partition_allreduce(topo)
            if cross_check:
                other = _column_generation(topo, collective, root, ch)
                assert abs(other - value) <= 1e-6 * max(value, 1.0), (other, value)
        else:
            value = _column_generation(topo, collective, root, ch)
        total += value
    return total


# --------------------------------------------------------------------------- machines
def random_machine(seed: int, n: int | None = None) -> dict:
    """A seeded heterogeneous machine (a ``blink-topology/1`` dict), NVLink-connected.

    4-12 GPUs (or ``n``); a random spanning tree plus extra links; each link 1-4 NVLinks of
    20, 25, 40 or 50 GB/s; every fifth machine adds a switch joining a subset
    of the GPUs; every other one has a PCIe channel with random groups.
    """
    rnd = random.Random(seed)
    n = rnd.randint(4, 12) if n is None else n
    gpus = list(range(n))
    order = gpus[:]
    rnd.shuffle(order)
    pairs = set()
    for i in range(1, n):
        pairs.add(tuple(sorted((order[i], order[rnd.randrange(i)]))))
    density = rnd.uniform(0.1, 0.6)
    for a, b in itertools.combinations(gpus, 2):
        if rnd.random() < density:
            pairs.add((a, b))
    links = []
    for a, b in sorted(pairs):
        count = rnd.randint(1, 4)
        speed = rnd.choice([20.0, 25.0, 40.0, 50.0])
        links.append({"src": a, "dst": b, "kind": "nvlink", "count": count, "bandwidth_gbps": count * speed})
    topo: dict[str, Any] = {"format": "blink-topology/1", "name": f"random{seed}", "gpus": gpus, "links": links}
    if seed % 5 == 4:
        members = sorted(rnd.sample(gpus, rnd.randint(2, n)))
        for g in members:
            c = rnd.randint(2, 6)
            links.append({"src": g, "dst": "nvsw", "kind": "nvlink", "count": c, "bandwidth_gbps": 25.0 * c})
        topo["switches"] = ["nvsw"]
    if seed % 2 == 0:
        shuffled = gpus[:]
        rnd.shuffle(shuffled)
        groups, i = [], 0
        while i < n:
            k = rnd.randint(1, 3)
            groups.append(sorted(shuffled[i:i + k]))
            i += k
        if rnd.random() < 0.3:
            groups = groups[:-1]  # some GPUs hang off the host directly
        topo["pcie"] = {"bandwidth_gbps": rnd.choice([8.0, 12.0, 24.0]), "switch_groups": groups}
    return topo


def connected_subsets(topo: dict, sizes: range) -> list[list[int]]:
    """Every GPU subset of the given sizes whose direct NVLinks connect it."""
    g = nx.Graph()
    g.add_nodes_from(topo["gpus"])
    for link in topo["links"]:
        if link.get("kind", "nvlink") == "nvlink" and _is_gpu(link["src"]) and _is_gpu(link["dst"]):
            g.add_edge(link["src"], link["dst"])
    out = []
    for k in sizes:
        for sub in itertools.combinations(topo["gpus"], k):
            if nx.is_connected(g.subgraph(sub)):
                out.append(list(sub))
    return out
