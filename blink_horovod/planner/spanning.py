"""Cheapest spanning trees on dense weight matrices: the pricer of every packing stage.

* :func:`min_spanning_tree` — Prim's algorithm on a dense symmetric matrix,
  O(n^2) (Prim 1957); the allreduce pricer.
* :func:`min_arborescence` — Chu-Liu/Edmonds' minimum-cost arborescence
  (Chu & Liu 1965; Edmonds, "Optimum branchings", 1967) out of a fixed root,
  by the classic cycle-contraction recursion on a dense matrix; the broadcast
  pricer.

Both take ``w[u, v]`` (``inf`` where no edge exists) and return the tree as
``(parent, child)`` index pairs, or ``None`` when no spanning tree exists.
The planner calls them thousands of times on small graphs (the MWU loop), so
they work on numpy matrices instead of networkx graphs; the tests cross-check
them against ``networkx.minimum_spanning_arborescence`` and
``networkx.minimum_spanning_tree``.

Ties are broken toward the root (Edmonds) or the vertex reached first (Prim),
then toward low vertex indices, so uniform weights (a switch) give a star:
the shallowest tree.
"""

from __future__ import annotations

import numpy as np

__all__ = ["min_spanning_tree", "min_arborescence"]


def min_spanning_tree(w: np.ndarray, start: int = 0) -> list[tuple[int, int]] | None:
    """A minimum spanning tree of the symmetric weight matrix ``w`` (Prim).

    Parameters
    ----------
    w : (n, n) array, symmetric; ``inf`` marks a missing edge.
    start : the vertex Prim grows from; edges come out oriented away from it.

    Returns
    -------
    list of (parent, child) or None
        ``n - 1`` edges oriented away from ``start``; None if ``w`` is disconnected.

    Examples
    --------
    >>> import numpy as np
    >>> inf = np.inf
    >>> min_spanning_tree(np.array([[inf, 1, 5], [1, inf, 2], [5, 2, inf]]))
    [(0, 1), (1, 2)]
    """
    n = w.shape[0]
    if n <= 1:
        return []
    in_tree = np.zeros(n, dtype=bool)
    in_tree[start] = True
    dist = w[start].astype(float).copy()
    par = np.full(n, start, dtype=np.int64)
    edges: list[tuple[int, int]] = []
    for _ in range(n - 1):
        d = np.where(in_tree, np.inf, dist)
        v = int(np.argmin(d))
        if not np.isfinite(d[v]):
            return None
        edges.append((int(par[v]), v))
        in_tree[v] = True
        closer = (w[v] < dist) & ~in_tree
        dist[closer] = w[v][closer]
        par[closer] = v
    return edges


def min_arborescence(w: np.ndarray, root: int) -> list[tuple[int, int]] | None:
    """A minimum-cost spanning arborescence out of ``root`` (Chu-Liu/Edmonds).

    Parameters
    ----------
    w : (n, n) array; ``w[u, v]`` is the cost of the edge ``u -> v``, ``inf`` if absent.
    root : the vertex every path starts from.

    Returns
    -------
    list of (parent, child) or None
        ``n - 1`` edges, one into every vertex but ``root``; None if some vertex
        cannot be reached from ``root``.

    Examples
    --------
    >>> import numpy as np
    >>> inf = np.inf
    >>> w = np.array([[inf, 5, 1], [inf, inf, 1], [inf, 1, inf]])
    >>> sorted(min_arborescence(w, 0))
    [(0, 2), (2, 1)]
    """
    n = w.shape[0]
    if n <= 1:
        return []
    if n <= _SMALL:
        par = _edmonds_lists(np.asarray(w, dtype=float).tolist(), root)
    else:
        par = _edmonds(np.asarray(w, dtype=float), root)
    if par is None:
        return None
    return [(int(par[v]), v) for v in range(n) if v != root]


# Below this many vertices plain lists beat numpy: each numpy call costs ~1 us,
# more than a whole row of Python float compares.
_SMALL = 48
_INF = float("inf")


def _edmonds_lists(w: list[list[float]], root: int) -> list[int] | None:
    """:func:`_edmonds` on nested lists (same algorithm, for small graphs)."""
    n = len(w)
    par = [root] * n
    best = [0.0] * n
    for v in range(n):
        if v == root:
            continue
        # Ties go to the root first, then to low indices: shallow trees.
        bu, bw = (root, w[root][v]) if w[root][v] < _INF else (-1, _INF)
        for u in range(n):
            if u != v and w[u][v] < bw:
                bu, bw = u, w[u][v]
        if bu < 0:
            return None
        par[v], best[v] = bu, bw
    cycles = _cycles(par, root)
    if not cycles:
        return par
    label = [-1] * n
    m = 0
    for cyc in cycles:
        for v in cyc:
            label[v] = m
        m += 1
    for v in range(n):
        if label[v] < 0:
            label[v] = m
            m += 1
    in_cycle = [label[v] < len(cycles) for v in range(n)]
    w2 = [[_INF] * m for _ in range(m)]
    src: dict[tuple[int, int], tuple[int, int]] = {}
    for u in range(n):
        a = label[u]
        row = w[u]
        w2a = w2[a]
        for v in range(n):
            b = label[v]
            if a == b or v == root:
                continue
            c = row[v]
            if c == _INF:
                continue
            if in_cycle[v]:
                c -= best[v]
            if c < w2a[b]:
                w2a[b] = c
                src[(a, b)] = (u, v)
    root2 = label[root]
    par2 = _edmonds_lists(w2, root2)
    if par2 is None:
        return None
    out = list(par)
    for b in range(m):
        if b != root2:
            u, v = src[(par2[b], b)]
            out[v] = u
    return out


def _edmonds(w: np.ndarray, root: int) -> np.ndarray | None:
    """Parent array of a min-cost arborescence of ``w`` from ``root`` (recursive contraction)."""
    n = w.shape[0]
    w = w.copy()
    np.fill_diagonal(w, np.inf)
    w[:, root] = np.inf
    par = np.argmin(w, axis=0)
    best = w[par, np.arange(n)]
    # Ties go to the root first, then to low indices: shallow trees.
    par = np.where(w[root] <= best, root, par)
    best[root] = 0.0
    par[root] = root
    if not np.all(np.isfinite(best)):
        return None
    cycles = _cycles(par, root)
    if not cycles:
        return par
    # Contract every cycle to one vertex; entering a cycle at v costs
    # w[u, v] - best[v] (the cycle edge into v is dropped).
    label = np.full(n, -1, dtype=np.int64)
    m = 0
    in_cycle = np.zeros(n, dtype=bool)
    for cyc in cycles:
        label[cyc] = m
        in_cycle[cyc] = True
        m += 1
    for v in range(n):
        if label[v] < 0:
            label[v] = m
            m += 1
    reduced = w - np.where(in_cycle, best, 0.0)[None, :]
    members = [np.flatnonzero(label == a) for a in range(m)]
    # Row-group minima: for every group a and original target v, the cheapest u in a.
    row_min = np.empty((m, n))
    row_arg = np.empty((m, n), dtype=np.int64)
    for a, rows in enumerate(members):
        sub = reduced[rows]
        j = np.argmin(sub, axis=0)
        row_min[a] = sub[j, np.arange(n)]
        row_arg[a] = rows[j]
    w2 = np.full((m, m), np.inf)
    src = np.zeros((m, m, 2), dtype=np.int64)
    for b, cols in enumerate(members):
        sub = row_min[:, cols]
        j = np.argmin(sub, axis=1)
        w2[:, b] = sub[np.arange(m), j]
        src[:, b, 1] = cols[j]
        src[:, b, 0] = row_arg[np.arange(m), cols[j]]
    np.fill_diagonal(w2, np.inf)
    root2 = int(label[root])
    par2 = _edmonds(w2, root2)
    if par2 is None:
        return None
    out = par.copy()
    for b in range(m):
        if b == root2:
            continue
        u, v = src[par2[b], b]
        out[v] = u
    return out


def _cycles(par, root: int) -> list[list[int]]:
    """The cycles of the functional graph ``v -> par[v]`` that avoid ``root``."""
    n = len(par)
    state = [0] * n  # 0 new, >0 on the walk started at state-1, -1 done
    cycles = []
    for start in range(n):
        if state[start] != 0 or start == root:
            continue
        walk = []
        v = start
        while v != root and state[v] == 0:
            state[v] = start + 1
            walk.append(v)
            v = int(par[v])
        if v != root and state[v] == start + 1:
            cycles.append(walk[walk.index(v):])
        for u in walk:
            state[u] = -1
    return cycles
