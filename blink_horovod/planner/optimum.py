"""The exact optimum of a tree packing, with a proof: column generation on the packing LP.

The rate of a collective planned as weighted spanning trees is the value of

    max  sum_t x_t   s.t.  sum_t x_t load(t, r) <= c_r  (every resource r),  x >= 0

over *all* spanning trees ``t`` (arborescences from the root for broadcast,
undirected spanning trees for allreduce; :mod:`.network` defines the loads).
There are exponentially many trees, so the LP is solved by column generation
(Dantzig-Wolfe; Gilmore-Gomory): solve it over a few trees, read the duals
``y`` of the capacity rows, and ask the pricer for the tree of least dual
cost ``sum_r load(t, r) y_r``: a minimum spanning tree (Kruskal/Prim) or a
minimum-cost arborescence (Edmonds) under edge weights ``route . y``.  If even
the cheapest tree costs ``>= 1`` the duals are feasible for the full dual LP
and, by LP duality, the restricted optimum is the true optimum.  For any
duals, ``c . y / min_t cost(t)`` bounds the optimum from above, so every
result carries a certified gap (``upper_bound / value - 1``).

Without switches this optimum equals the classical closed forms, which the
tests check independently: broadcast = ``min_v maxflow(root, v)`` (Edmonds'
branching theorem, 1973), allreduce = ``min_P cross(P) / (|P| - 1)`` over
vertex partitions (Nash-Williams 1961 / Tutte 1961, fractional form).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from .lp import PackingLP
from .network import Network, TreeKey
from .spanning import min_arborescence, min_spanning_tree

__all__ = ["STOP_TOL", "Packing", "cheapest_tree", "optimal_packing", "solve_restricted"]

# Stop when the cheapest tree's reduced cost is within this of 1: the optimum is then
# certified to relative accuracy STOP_TOL.
STOP_TOL = 1e-9


@dataclass
class Packing:
    """A packing: trees with rates ``x`` (GB/s), and its optimality certificate.

    Attributes
    ----------
    trees : the trees (keys of :class:`~.network.Network`) with ``x > 0``.
    x : their rates, GB/s.
    value : ``sum(x)``: the rate of the packing.
    upper_bound : a proven upper bound on the optimum (``value`` when exact).
    duals : capacity duals ``y`` (per GB/s of capacity) of the last LP.
    columns : every tree the column generation considered.
    iterations : pricing rounds.
    """

    trees: list[TreeKey]
    x: np.ndarray
    value: float
    upper_bound: float
    duals: np.ndarray
    columns: list[TreeKey]
    iterations: int

    @property
    def gap(self) -> float:
        return self.upper_bound / self.value - 1.0 if self.value > 0 else float("inf")


def cheapest_tree(net: Network, y: np.ndarray, root: int = 0, weights: np.ndarray | None = None) -> TreeKey | None:
    """The spanning tree of least dual cost under resource prices ``y`` (the pricer).

    ``root`` is the broadcast root's vertex index (ignored for allreduce);
    ``weights`` may replace the (n, n) edge-weight matrix (the MWU and the
    tie-breaking samplers pass perturbed ones).
    """
    w = net.edge_weights(y) if weights is None else weights
    if net.directed:
        edges = min_arborescence(w, root)
    else:
        edges = min_spanning_tree(w)
    if edges is None:
        return None
    return net.canonical(edges)


def solve_restricted(net: Network, trees: Sequence[TreeKey]) -> tuple[np.ndarray, np.ndarray, float]:
    """Solve the packing LP over ``trees`` only: returns ``(x, duals, value)``."""
    lp = PackingLP(net.capacity)
    for t in trees:
        lp.add_column(net.tree_load(t))
    return lp.solve()


def optimal_packing(
    net: Network,
    seeds: Iterable[TreeKey] = (),
    root: int = 0,
    *,
    tol: float = STOP_TOL,
    max_iterations: int = 100_000,
) -> Packing:
    """The optimal packing of ``net`` by column generation, seeded with ``seeds``.

    Parameters
    ----------
    net : the channel's resource model.
    seeds : trees to start from (MWU's trees make the generation short).
    root : broadcast root (vertex index).
    tol : stop when the cheapest tree's reduced cost is ``>= 1 - tol``.

    Raises
    ------
    PlanError
        if no spanning tree exists (the channel does not connect the GPUs).
    """
    columns: list[TreeKey] = []
    seen: set[TreeKey] = set()
    for t in seeds:
        if t not in seen:
            seen.add(t)
            columns.append(t)
    if not columns:
        first = cheapest_tree(net, np.ones(net.num_resources) / net.capacity, root)
        if first is None:
            raise PlanError(f"{net.channel} does not connect GPUs {net.components()}")
        columns.append(first)
        seen.add(first)
    lp = PackingLP(net.capacity)
    for t in columns:
        lp.add_column(net.tree_load(t))
    iterations = 0
    while True:
        iterations += 1
        x, y, value = lp.solve()
        t = cheapest_tree(net, y, root)
        if t is None:
            raise PlanError(f"{net.channel} does not connect GPUs {net.components()}")
        load_t = net.tree_load(t)
        cost = float(load_t @ y)
        # Any y >= 0 scaled by 1/cost is dual feasible: c.y/cost bounds the optimum.
        upper = float(net.capacity @ y) / cost if cost > 0 else float("inf")
        if cost >= 1.0 - tol or t in seen or iterations >= max_iterations:
            break
        seen.add(t)
        columns.append(t)
        lp.add_column(load_t)
    keep = x > value * 1e-12
    return Packing(
        trees=[columns[i] for i in np.flatnonzero(keep)],
        x=x[keep],
        value=value,
        upper_bound=max(upper, value),
        duals=y,
        columns=columns,
        iterations=iterations,
    )
