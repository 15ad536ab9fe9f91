"""Few trees at the optimum: Blink's ILP refinement of the packing (section 3.2.1).

Blink takes the MWU's trees (181 on a DGX-1V broadcast) and solves an ILP
that keeps the rate within a threshold of the optimum with as few trees as
possible (6 there).  Each tree costs the runtime streams, buffers and per-chunk
work, and fewer, evenly weighted trees carry bigger chunks.

Here, in five steps (every effort limit is a count, never seconds, so that
every rank planning the same topology gets the same plan):

1. **Tight candidates.** The pool is every tree any stage produced (MWU,
   column generation, shallow seeds) plus trees sampled from the optimal
   dual ``y*``: by complementary slackness an optimal packing uses only
   *tight* trees, whose dual cost ``sum_r load(t, r) y*_r`` is exactly 1 —
   the minimum spanning trees (arborescences) under the optimal edge prices;
   re-running the pricer with tiny random tie-breaks (seeded) samples many of
   them.  Non-tight trees are dropped, losing no optimal packing.
2. **Shallow first on switch machines** (``shallow=True``): the pool is cut
   to the smallest depth bound that still reaches the optimum (the paper's
   one-hop trees on a DGX-2, for latency).
3. **Equal shares** (an integer program with no big-M): for k = 1, 2, ...,
   can k trees of rate ``keep * optimum / k`` (tree multiplicities allowed)
   fit?  With integral link counts this is Edmonds' integral arborescence
   packing — a DGX-1V broadcast is 6 (or fewer) single-NVLink trees — and
   equal rates keep chunks even (section 3.2.1); small k are proven
   infeasible in milliseconds.
4. **Greedy heaviest-tree decomposition**, when no equal-share packing was
   found: repeatedly fix the pool tree that can carry the most in an optimal
   packing of what is left (an LP ``max x_t`` with the rate held), subtract
   it, and continue until ``keep`` x the optimum is placed.
5. **Count MILP** (HiGHS, node-limited, started from the incumbent) on small
   broadcast pools: binary ``u_t``, ``x_t <= ub_t u_t``, ``A x <= c``,
   ``sum x >= keep * optimum``, minimising the tree count (depth breaks ties).
   On big or allreduce pools its root node alone takes seconds, so it is
   skipped there.

Whatever beats the LP's basic solution (at most one tree per capacity row)
wins; otherwise that basic solution stands.
The chosen trees' rates are finally re-optimised by the LP over them alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .lp import LP, solve_milp
from .network import Network, TreeKey
from .optimum import Packing, cheapest_tree, solve_restricted

__all__ = ["KEEP", "Refined", "fewest_trees", "tight_trees", "tree_depth"]

KEEP = 0.9999  # the refined rate is at least KEEP x the optimum
TIGHT_TOL = 1e-7
# Effort limits are branch-and-bound node counts, not seconds, so that every rank
# planning the same topology gets the same plan.  The time limit is a safety net.
EFFORT_NODES = 200
SAFETY_TIME_S = 5.0
MILP_MAX_POOL = 40  # candidate trees; above this the count MILP is skipped
MAX_POOL = 150
MAX_UNIFORM = 10
_GREEDY_PROBES = 8  # trees whose largest possible weight is probed per greedy step
GREEDY_MAX_LPS = 240


@dataclass
class Refined:
    """The refined packing and how it was found."""

    trees: list[TreeKey]
    x: np.ndarray
    value: float
    candidates: int  # tight candidates chosen among
    method: str  # "greedy", "milp" (proven fewest in the pool), "milp-time-limit", "lp-basis"


def tree_depth(tree: TreeKey, n: int, root: int | None) -> int:
    """Depth of ``tree`` from ``root``; ``root=None`` (allreduce): from its best centre (radius)."""
    adj: dict[int, list[int]] = {v: [] for v in range(n)}
    directed = root is not None
    for u, v in tree:
        adj[u].append(v)
        if not directed:
            adj[v].append(u)
    starts = [root] if directed else range(n)
    best = n
    for s in starts:
        depth = {s: 0}
        frontier = [s]
        while frontier:
            nxt = []
            for u in frontier:
                for v in adj[u]:
                    if v not in depth:
                        depth[v] = depth[u] + 1
                        nxt.append(v)
            frontier = nxt
        best = min(best, max(depth.values()))
    return best


def tight_trees(
    net: Network,
    duals: np.ndarray,
    root: int,
    samples: int,
    rng: np.random.Generator,
) -> list[TreeKey]:
    """Distinct trees of dual cost ~1 under ``duals``, by the pricer with random tie-breaks.

    The tie-breaks lean toward edges of high capacity, so the samples are
    trees that can carry much: good material for few-tree packings.
    """
    w = net.edge_weights(duals)
    finite = np.isfinite(w)
    if not finite.any():
        return []
    scale = float(np.mean(w[finite])) or 1.0
    # Bottleneck capacity of each pair's route: wide routes get smaller tie-breaks.
    width = np.full((net.n, net.n), np.inf)
    caps = np.where(net.route > 0, net.capacity[None, :] / np.where(net.route > 0, net.route, 1.0), np.inf).min(axis=1)
    width[net.pairs[:, 0], net.pairs[:, 1]] = caps
    if not net.directed:
        width[net.pairs[:, 1], net.pairs[:, 0]] = caps
    narrow = np.where(finite, float(np.max(caps)) / np.where(finite, width, 1.0), 0.0)
    out: dict[TreeKey, None] = {}
    misses = 0
    for _ in range(samples):
        noise = rng.random(w.shape) * narrow * (1e-7 * scale)
        if not net.directed:
            noise = np.triu(noise, 1) + np.triu(noise, 1).T
        t = cheapest_tree(net, duals, root, weights=np.where(finite, w + noise, np.inf))
        if t is None:
            break
        if t in out:
            misses += 1
            if misses > max(8, samples // 4):
                break  # the tight set looks exhausted
            continue
        out[t] = None
    return list(out)


class _PoolLP:
    """The packing LP over a fixed pool, in units of the optimum, with a rate row."""

    def __init__(self, a: np.ndarray, cap: np.ndarray) -> None:
        self.R, self.P = a.shape
        self.cap = cap.astype(float).copy()
        lo = np.concatenate([np.full(self.R, -np.inf), [-np.inf]])
        hi = np.concatenate([self.cap, [np.inf]])
        self.lp = LP(lo, hi)
        for j in range(self.P):
            self.lp.add_column(np.concatenate([a[:, j], [1.0]]))
        self.a = a

    def set_capacity(self, cap: np.ndarray) -> None:
        self.cap = cap.copy()
        self.lp.set_row_bounds(np.arange(self.R), np.full(self.R, -np.inf), np.maximum(cap, 0.0))

    def set_rate(self, lo: float) -> None:
        self.lp.set_row_bounds(np.array([self.R]), np.array([lo]), np.array([np.inf]))

    def maximise(self, cost: np.ndarray) -> np.ndarray | None:
        self.lp.set_costs(cost)
        out = self.lp.solve()
        return None if out is None else out[0]

    def drop(self, j: int) -> None:
        self.lp.set_col_upper(j, 0.0)


def _greedy(a: np.ndarray, cap: np.ndarray, keep: float, order: np.ndarray, limit: int) -> list[tuple[int, float]] | None:
    """Heaviest-tree-first decomposition of a packing of rate >= keep (units of the optimum).

    ``order`` breaks ties between equally heavy trees (lower first).  Gives up
    (None) once it has placed ``limit`` trees without reaching ``keep``, or
    after ``GREEDY_MAX_LPS`` LP solves (a deterministic effort cap).
    """
    pool = _PoolLP(a, cap)
    residual = cap.astype(float).copy()
    placed = 0.0
    chosen: list[tuple[int, float]] = []
    alive = np.ones(a.shape[1], dtype=bool)
    probes = _GREEDY_PROBES if limit <= 24 else 2
    if limit * (probes + 1) > GREEDY_MAX_LPS:
        return None
    while placed < keep - 1e-12 and len(chosen) < min(a.shape[1], limit):
        pool.set_rate(-np.inf)
        x = pool.maximise(alive.astype(float))
        if x is None:
            return None
        target = float(x.sum())
        if placed + target < keep - 1e-9:
            return None
        ranked = sorted(np.flatnonzero(alive & (x > 1e-12)), key=lambda j: (-x[j], order[j]))[:probes]
        pool.set_rate(target * (1 - 1e-7))
        best_j, best_w = -1, -1.0
        for j in ranked:
            e = np.zeros(a.shape[1])
            e[j] = 1.0
            xj = pool.maximise(e)
            wj = x[j] if xj is None else max(float(xj[j]), float(x[j]))
            if wj > best_w * (1 + 1e-9) or (abs(wj - best_w) <= best_w * 1e-9 and order[j] < order[best_j]):
                best_j, best_w = j, wj
        if best_j < 0 or best_w <= 1e-12:
            return None
        step = best_w
        chosen.append((best_j, step))
        placed += step
        residual = residual - step * a[:, best_j]
        alive[best_j] = False
        pool.drop(best_j)
        pool.set_capacity(residual)
    return chosen if placed >= keep - 1e-9 else None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr for a while: HiGHS' MIP code may print debug lines
    on the C stdout, and ``blink plan`` writes its JSON there."""
    try:
        sys.stdout.flush()
        fd = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield
        return
    libc = None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        pass
    try:
        os.dup2(2, 1)
        yield
    finally:
        if libc is not None:
            libc.fflush(None)
        os.dup2(fd, 1)
        os.close(fd)


def _milp(
    a: np.ndarray,
    cap: np.ndarray,
    keep: float,
    depth: np.ndarray,
    lam: float,
    max_nodes: int,
    incumbent: list[tuple[int, float]] | None,
) -> tuple[list[int], bool] | None:
    """The few-trees MILP over the pool; returns (chosen pool indices, proven optimal) or None."""
    rdim, ntree = a.shape
    ub = np.minimum(1.0, np.min(np.where(a > 0, cap[:, None] / np.where(a > 0, a, 1.0), np.inf), axis=0))
    nvar = 2 * ntree
    c = np.zeros(nvar)
    c[ntree:] = 1.0 + lam * depth
    nrow = rdim + 1 + ntree
    m = np.zeros((nrow, nvar))
    lo = np.full(nrow, -np.inf)
    hi = np.zeros(nrow)
    m[:rdim, :ntree] = a
    hi[:rdim] = cap
    m[rdim, :ntree] = 1.0
    lo[rdim], hi[rdim] = keep, np.inf
    idx = np.arange(ntree)
    m[rdim + 1 + idx, idx] = 1.0
    m[rdim + 1 + idx, ntree + idx] = -ub
    start = None
    if incumbent:
        start = np.zeros(nvar)
        for j, w in incumbent:
            # slightly inside, so HiGHS' tolerances accept the incumbent
            start[j] = min(w, ub[j]) * (1 - 1e-7)
            start[ntree + j] = 1.0
    integer = np.concatenate([np.zeros(ntree, dtype=bool), np.ones(ntree, dtype=bool)])
    with _stdout_to_stderr():
        got = solve_milp(c, m, lo, hi, np.concatenate([ub, np.ones(ntree)]), integer,
                         max_nodes=max_nodes, time_limit_s=SAFETY_TIME_S, incumbent=start)
    if got is None:
        return None
    x, proven = got
    return [int(j) for j in np.flatnonzero(x[ntree:] > 0.5)], proven


def _uniform(a: np.ndarray, cap: np.ndarray, keep: float, k: int, max_nodes: int) -> list[tuple[int, float]] | None:
    """``k`` equal shares of ``keep`` (units of the optimum) on pool trees: an integer program.

    Integer counts ``n_t`` with ``sum n_t = k`` and ``A n (keep / k) <= c``: at
    most ``k`` distinct trees, all carrying multiples of ``keep / k``.  With
    integral link counts this is Edmonds' integral arborescence packing (a
    DGX-1V broadcast from one GPU is 6 disjoint single-NVLink trees); and
    equal rates keep chunks even (Blink, section 3.2.1).  No big-M, so HiGHS
    proves small ``k`` infeasible in milliseconds.
    """
    rdim, ntree = a.shape
    m = np.vstack([a, np.ones((1, ntree))])
    share = keep / k
    lo = np.concatenate([np.full(rdim, -np.inf), [k]])
    hi = np.concatenate([cap / share, [k]])
    with _stdout_to_stderr():
        got = solve_milp(np.zeros(ntree), m, lo, hi, np.full(ntree, float(k)), np.ones(ntree, dtype=bool),
                         max_nodes=max_nodes, time_limit_s=SAFETY_TIME_S)
    if got is None:
        return None
    counts = np.rint(got[0]).astype(int)
    if counts.sum() != k or np.any(a @ counts * share > cap * (1 + 1e-7)):
        return None
    return [(int(j), float(counts[j] * share)) for j in np.flatnonzero(counts)]


def _uniform_possible(cap: np.ndarray, price: np.ndarray, target: float, k: int) -> bool:
    """Necessary test for :func:`_uniform` with integral loads (units of the optimum).

    On tight trees the rate equals ``sum_r price_r load_r`` (``price`` = the
    optimal duals, scaled so that ``price . cap = 1``), and with integer tree
    counts each load is a multiple of ``target / k`` not above ``cap_r``.
    """
    share = target / k
    best = float(np.sum(price * share * np.floor(cap / share + 1e-9)))
    return best >= target * (1 - 1e-9)


def fewest_trees(
    net: Network,
    candidates: Iterable[TreeKey],
    optimum: Packing,
    root: int,
    *,
    keep: float = KEEP,
    shallow: bool = False,
    effort: int = EFFORT_NODES,
    max_pool: int = MAX_POOL,
    max_uniform: int = MAX_UNIFORM,
) -> Refined:
    """The fewest trees among ``candidates`` that keep ``keep`` x the optimum.

    Parameters
    ----------
    net : the channel's resource model.
    candidates : trees to choose among (the optimum's own trees are always added).
    optimum : the exact packing of :func:`~.optimum.optimal_packing` (its
        duals pick the tight candidates; its trees are the fallback).
    root : broadcast root (vertex index); depth is measured from it.
    shallow : minimise the largest depth first (switch machines).
    effort : branch-and-bound nodes per integer program (0: greedy only).
    max_pool : at most this many tight candidates (the first ones of ``candidates``).
    max_uniform : equal-share programs for k = 1 .. max_uniform only.

    The result is deterministic: it depends on the inputs only, never on time.
    """
    opt = optimum.value
    y = optimum.duals
    pool: dict[TreeKey, None] = dict.fromkeys(optimum.trees)
    for t in candidates:
        pool.setdefault(t, None)
    loads = {t: net.tree_load(t) for t in pool}
    # Candidates in order of promise (the optimum's own, then the caller's order), capped.
    trees = [t for t in pool if t in optimum.trees or float(loads[t] @ y) <= 1.0 + TIGHT_TOL][:max_pool]
    fallback = Refined(list(optimum.trees), optimum.x.copy(), opt, len(trees), "lp-basis")
    if len(optimum.trees) <= 1 or opt <= 0:
        return fallback
    a = np.stack([loads[t] for t in trees], axis=1)
    cap = net.capacity / opt  # rates in units of the optimum
    depth = np.array([tree_depth(t, net.n, root if net.directed else None) for t in trees], dtype=float)
    if shallow:
        for bound in sorted(set(depth)):
            sub = depth <= bound
            xs, _, value = _pool_value(a[:, sub], cap)
            if value >= keep * (1 - 1e-9):
                trees = [t for t, s in zip(trees, sub) if s]
                a, depth = a[:, sub], depth[sub]
                # The fallback is now the LP basis of the shallow pool.
                live = np.flatnonzero(xs > 1e-12)
                fallback = Refined([trees[j] for j in live], xs[live] * opt, float(xs[live].sum() * opt), len(trees), "lp-basis")
                break
    options: list[tuple[list[int], str]] = []
    incumbent: list[tuple[int, float]] | None = None
    proven = False
    target = min(1.0, keep + 1e-5)  # a hair above keep, so nudged incumbents still meet it
    integral = bool(np.all(np.abs(a - np.rint(a)) < 1e-12))
    if effort > 0:
        # Equal shares first: k = 1, 2, ... below the LP basis' tree count.  k = 1
        # infeasible also proves that no single tree reaches the optimum.  For
        # allreduce equal shares rarely fit (every link is saturated), so only
        # k <= 2 and k = n (one tree per root's share) are tried.
        ks = range(1, min(len(fallback.trees), max_uniform + 1))
        if not net.directed:
            ks = [k for k in ks if k <= 2 or k == net.n]
        for k in ks:
            if integral and not _uniform_possible(cap, y * opt, target, k):
                continue
            found = _uniform(a, cap, target, k, effort)
            if found is not None:
                incumbent = found
                options.append(([j for j, _ in found], f"uniform-{k}"))
                proven = k <= 2  # k = 1 was infeasible, so 2 is the fewest
                break
    if incumbent is None:
        found = _greedy(a, cap, target, depth, len(fallback.trees) - 1)
        if found is not None and len(found) < len(fallback.trees):
            incumbent = found
            options.append(([j for j, _ in found], "greedy"))
    best = len(incumbent) if incumbent is not None else len(fallback.trees)
    # The count MILP's root node alone can take seconds on big pools (and on allreduce
    # pools: every link saturated, highly symmetric), so it runs on small broadcast pools.
    if effort > 0 and net.directed and not proven and best > 2 and len(trees) <= MILP_MAX_POOL:
        lam = 1.0 / (max(net.n - 1, 1) * (len(trees) + 2))
        got = _milp(a, cap, min(1.0, keep + 2e-6), depth, lam, effort, incumbent)
        if got is not None and got[0] and len(got[0]) < best:
            options.insert(0, (got[0], "milp" if got[1] else "milp-node-limit"))
    for chosen, method in options:
        picked = [trees[j] for j in chosen]
        x, _, value = solve_restricted(net, picked)
        if value >= keep * opt * (1 - 1e-9):
            live = x > value * 1e-12
            picked = [t for t, k in zip(picked, live) if k]
            return Refined(picked, x[live], float(x[live].sum()), len(trees), method)
    return fallback


def _pool_value(a: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    lp = LP(np.full(len(cap), -np.inf), cap)
    for j in range(a.shape[1]):
        lp.add_column(a[:, j])
    out = lp.solve()
    assert out is not None  # x = 0 is feasible
    return out
