"""Cheapest spanning trees on dense weight matrices: the pricer of every packing stage.

* :func:`min_spanning_tree` — Prim's algorithm on a dense symmetric matrix,
  O(n^2) (Prim 1957); the allreduce pricer.
* :func:`min_arborescence` — Chu-Liu/Edmonds' minimum-cost arborescence
  (Chu & Liu 1965; Edmonds, "Optimum branchings", 1967) out of a fixed root;
  the broadcast pricer.  Small graphs use the classic level-by-level
  contraction on lists; bigger ones contract each cycle as it is found on a
  dense matrix (the order of Tarjan, "Finding optimum branchings", 1977),
  O(n^2) array work per call, where a switch's uniform weights would drive
  the level-by-level recursion n levels deep.

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

__all__ = ["min_arborescence", "min_spanning_tree"]


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
        par = _edmonds_contracting(np.asarray(w, dtype=float), root)
    if par is None:
        return None
    return [(int(par[v]), v) for v in range(n) if v != root]


# Below this many vertices plain lists beat numpy: each numpy call costs ~1 us,
# more than a whole row of Python float compares.
_SMALL = 20
_INF = float("inf")


def _edmonds_lists(w: list[list[float]], root: int) -> list[int] | None:
    """Parent list of a min-cost arborescence from ``root``: contract all cycles, recurse."""
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


def _edmonds_contracting(w: np.ndarray, root: int) -> np.ndarray | None:
    """Chu-Liu/Edmonds with cycles contracted as they are found (Tarjan's dense O(n^2) order).

    Super-vertices live in a ``2n x 2n`` matrix ``cost[x, y]`` (cheapest edge
    from super-vertex ``x`` into ``y``, with the entered cycle edge's cost
    subtracted) and ``edge[x, y]`` (that edge, as ``u * n + v``).  A path is
    grown backwards along cheapest entering edges until it reaches a finished
    super-vertex (one that leads to the root) or closes a cycle, which is then
    contracted in O(n) vectorised work; at most n - 1 contractions happen, so a
    call is O(n^2) array work instead of the O(n^3) of contracting level by
    level (which a switch's uniform weights drive to n levels).
    """
    n = w.shape[0]
    size = 2 * n
    cost = np.full((size, size), np.inf)
    cost[:n, :n] = w
    np.fill_diagonal(cost, np.inf)
    cost[:, root] = np.inf
    edge = np.full((size, size), -1, dtype=np.int64)
    edge[:n, :n] = np.arange(n)[:, None] * n + np.arange(n)[None, :]
    in_edge = np.full(size, -1, dtype=np.int64)
    in_cost = np.zeros(size)
    members: dict[int, list[int]] = {}
    up = np.full(size, -1, dtype=np.int64)  # contraction forest: super-vertex -> the one it joined
    done = np.zeros(size, dtype=bool)
    done[root] = True
    nxt = n
    for start in range(n):
        if done[start] or up[start] >= 0:
            continue
        path = [start]
        on_path = {start}
        while True:
            y = path[-1]
            col = cost[:, y]
            x = int(np.argmin(col))
            if not np.isfinite(col[x]):
                return None
            if col[root] <= col[x]:  # ties go to the root: shallow trees
                x = root
            in_edge[y], in_cost[y] = edge[x, y], col[x]
            if done[x]:
                done[path] = True
                break
            if x not in on_path:
                path.append(x)
                on_path.add(x)
                continue
            # A cycle path[i:], closed by x -> y: contract it into super-vertex c.
            i = path.index(x)
            cyc = np.asarray(path[i:], dtype=np.int64)
            c = nxt
            nxt += 1
            members[c] = list(cyc)
            up[cyc] = c
            entering = cost[:, cyc] - in_cost[cyc][None, :]
            j = np.argmin(entering, axis=1)
            rows = np.arange(size)
            cost[:, c] = entering[rows, j]
            edge[:, c] = edge[rows, cyc[j]]
            k = np.argmin(cost[cyc, :], axis=0)
            cost[c, :] = cost[cyc[k], np.arange(size)]
            edge[c, :] = edge[cyc[k], np.arange(size)]
            cost[cyc, :] = np.inf
            cost[:, cyc] = np.inf
            cost[c, c] = np.inf
            for v in path[i:]:
                on_path.discard(v)
            path = path[:i] + [c]
            on_path.add(c)
    # Expand: each super-vertex's entering edge overrides the cycle edge into the
    # member that contains its head; the other members keep their own.
    parent = np.full(n, root, dtype=np.int64)

    def expand(sv: int, entering: int) -> None:
        stack = [(sv, entering)]
        while stack:
            s, e = stack.pop()
            if s < n:
                if s != root:
                    parent[s] = e // n
                continue
            m = e % n  # the head of e; climb to the member of s that holds it
            while up[m] != s:
                m = up[m]
            for member in members[s]:
                stack.append((member, e if member == m else int(in_edge[member])))

    for sv in range(nxt):
        if up[sv] < 0 and sv != root:  # the top-level super-vertices
            expand(sv, int(in_edge[sv]))
    return parent
