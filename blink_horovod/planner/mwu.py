"""Blink's approximate tree packing: multiplicative weight updates (Garg–Könemann).

Blink (section 3.1) packs spanning trees with the multiplicative-weight-update
method of Garg & Könemann ("Faster and simpler algorithms for multicommodity
flow and other fractional packing problems", FOCS 1998 / SICOMP 2007), which
gives a (1 - eps)-approximate fractional packing in O(m ln m / eps^2) calls
of a minimum-spanning-tree (allreduce) or minimum-arborescence (broadcast)
oracle, m the number of resources:

1. every resource ``r`` starts with length ``l_r = delta / c_r``,
   ``delta = (1 + eps) ((1 + eps) m)^(-1/eps)``;
2. while ``D = sum_r c_r l_r < 1``: take the tree ``t`` of least length
   ``sum_r load(t, r) l_r``; route its bottleneck amount ``f = min_r c_r /
   load(t, r)`` over it; multiply each ``l_r`` by ``1 + eps f load(t, r) / c_r``;
3. scale all rates down by ``log_{1+eps}((1 + eps) / delta)``, which makes the
   packing feasible.

Here it is the *candidate generator*: its trees seed the exact column
generation (:mod:`.optimum`) and the few-tree refinement (:mod:`.refine`),
as Blink's packing seeds its ILP.  The paper's DGX-1V broadcast packing has
181 distinct trees.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .network import Network, TreeKey
from .optimum import cheapest_tree

__all__ = ["MWUPacking", "mwu_packing"]


@dataclass
class MWUPacking:
    """The MWU result: distinct trees, their (feasible) rates, and the work done."""

    trees: list[TreeKey]
    x: np.ndarray
    value: float
    iterations: int
    eps: float
    complete: bool  # False when the iteration or time budget stopped it early


def mwu_packing(
    net: Network,
    eps: float = 0.1,
    root: int = 0,
    *,
    max_iterations: int | None = None,
    time_budget_s: float | None = None,
) -> MWUPacking:
    """A (1 - eps)-approximate fractional tree packing of ``net`` (Garg–Könemann).

    Parameters
    ----------
    net : the channel's resource model.
    eps : the approximation parameter, in (0, 1).
    root : broadcast root (vertex index).
    max_iterations, time_budget_s : stop early (the result is still feasible,
        just further from optimal); ``complete`` says whether it ran to the end.

    Returns
    -------
    MWUPacking
        with ``value >= (1 - eps)^3 * optimum`` when ``complete``.
    """
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps: expected a number in (0, 1), got {eps!r}")
    cap = net.capacity
    m = len(cap)
    delta = (1.0 + eps) * ((1.0 + eps) * m) ** (-1.0 / eps)
    length = delta / cap
    flow: dict[TreeKey, float] = {}
    loads: dict[TreeKey, np.ndarray] = {}
    iterations = 0
    complete = True
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    while float(cap @ length) < 1.0:
        if max_iterations is not None and iterations >= max_iterations:
            complete = False
            break
        if deadline is not None and iterations % 16 == 0 and time.perf_counter() > deadline:
            complete = False
            break
        iterations += 1
        t = cheapest_tree(net, length, root)
        if t is None:  # disconnected: nothing to pack
            return MWUPacking([], np.zeros(0), 0.0, iterations, eps, True)
        load = loads.get(t)
        if load is None:
            load = loads[t] = net.tree_load(t)
        used = load > 0
        f = float(np.min(cap[used] / load[used]))
        flow[t] = flow.get(t, 0.0) + f
        length = length * (1.0 + eps * f * load / cap)
    trees = list(flow)
    x = np.array([flow[t] for t in trees])
    if complete:
        x = x / math.log((1.0 + eps) / delta, 1.0 + eps)
    # Whatever the stopping point, scaling by the worst overload makes it feasible.
    if trees:
        over = float(np.max(net.load_matrix(trees) @ x / cap))
        if over > 1.0:
            x = x / over
    return MWUPacking(trees, x, float(x.sum()), iterations, eps, complete)
