"""Lay weighted trees over the bytes of a buffer, and root allreduce pieces at their owners.

docs/formats.md, Plan file: bytes are assigned to a plan's trees in list order, and an
allreduce plan gives the i-th GPU of ``gpus`` exactly the i-th contiguous 1/n
of the bytes as root (the fixed byte-range-to-local-rank map the hierarchical
allreduce's cross-server stage relies on; docs/architecture.md).

A tree that reduces up to its root and broadcasts back down loads each of its
links once in each direction whatever the root, so any tree can be cut into
pieces and each piece re-rooted at no cost in bandwidth.  :func:`multi_root`
lays the trees over ``[0, 1)`` and cuts them at the ``i/n`` boundaries: at
most ``T + n - 1`` pieces for ``T`` trees.  Trees that exactly fill a share
are placed whole in the share whose owner is nearest their centre, so
switch machines' one-hop stars stay one hop deep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FILL_TOL", "Piece", "eccentricity", "multi_root", "orient"]

FILL_TOL = 1e-7  # slivers below this (of the whole buffer) are merged, not split off


@dataclass(frozen=True)
class Piece:
    """One plan entry: input tree number ``index`` rooted at vertex ``root``, carrying ``fraction``."""

    index: int
    tree: tuple[tuple[int, int], ...]
    root: int
    fraction: float


def orient(tree: Sequence[tuple[int, int]], root: int) -> list[tuple[int, int]]:
    """The (parent, child) edges of undirected ``tree`` rooted at ``root``, in BFS order."""
    adj: dict[int, list[int]] = {}
    for u, v in tree:
        adj.setdefault(u, []).append(v)
        adj.setdefault(v, []).append(u)
    out: list[tuple[int, int]] = []
    seen = {root}
    frontier = [root]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(adj.get(u, ())):
                if v not in seen:
                    seen.add(v)
                    out.append((u, v))
                    nxt.append(v)
        frontier = nxt
    return out


def eccentricity(tree: Sequence[tuple[int, int]], root: int) -> int:
    """Depth of undirected ``tree`` when rooted at ``root``."""
    depth = {root: 0}
    for u, v in orient(tree, root):
        depth[v] = depth[u] + 1
    return max(depth.values())


def multi_root(trees: Sequence[tuple[tuple[int, int], ...]], fractions: Sequence[float], n: int) -> list[Piece]:
    """Cut ``trees`` (fractions summing to 1) into pieces so that vertex ``i`` roots exactly ``[i/n, (i+1)/n)``.

    Returns the pieces in byte order; piece fractions sum to 1 and each share's
    pieces sum to exactly ``1/n`` (up to rounding).
    """
    total = sum(fractions)
    remaining = [f / total for f in fractions]
    memo: dict[tuple[int, int], int] = {}

    def ecc(t: int, r: int) -> int:
        if (t, r) not in memo:
            memo[(t, r)] = eccentricity(trees[t], r)
        return memo[(t, r)]

    share = 1.0 / n
    # Whole-share trees first, each in the free share whose owner is its best centre.
    owner_of: dict[int, list[int]] = {}
    free = set(range(n))
    for t, f in sorted(enumerate(remaining), key=lambda p: -p[1]):
        k = round(f / share)
        if k < 1 or abs(f - k * share) > FILL_TOL * max(1.0, k):
            continue
        for _ in range(k):
            if not free:
                break
            i = min(free, key=lambda r: (ecc(t, r), r))
            free.discard(i)
            owner_of.setdefault(i, []).append(t)
            remaining[t] -= share
    pieces: list[Piece] = []
    queue = [t for t in range(len(trees)) if remaining[t] > FILL_TOL]
    for i in range(n):
        if i in owner_of:
            for t in owner_of[i]:
                pieces.append(Piece(t, trees[t], i, share))
            continue
        room = share
        while room > FILL_TOL and queue:
            # The tree shallowest from this owner goes first (each share still splits at
            # most one tree, so there are at most T + n - 1 pieces).
            t = min(queue, key=lambda q: (ecc(q, i), -remaining[q], q))
            take = min(remaining[t], room)
            if remaining[t] - take <= FILL_TOL:
                take = remaining[t]
            pieces.append(Piece(t, trees[t], i, take))
            remaining[t] -= take
            room -= take
            if remaining[t] <= FILL_TOL:
                queue.remove(t)
        if room > FILL_TOL and pieces:  # rounding left a sliver: give it to the last piece
            last = pieces[-1]
            pieces[-1] = Piece(last.index, last.tree, last.root, last.fraction + room)
    # Exact shares: rescale each owner's pieces to sum to exactly 1/n.
    out: list[Piece] = []
    by_owner: dict[int, list[Piece]] = {}
    for p in pieces:
        by_owner.setdefault(p.root, []).append(p)
    for i in range(n):
        group = by_owner.get(i, [])
        s = sum(p.fraction for p in group)
        for p in group:
            if p.fraction / s * share > 0:
                out.append(Piece(p.index, p.tree, i, p.fraction / s * share))
    return out
