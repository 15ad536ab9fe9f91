"""The pricers: Prim and Chu-Liu/Edmonds on dense matrices agree with networkx."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from blink_horovod.planner import spanning
from blink_horovod.planner.spanning import min_arborescence, min_spanning_tree

pytestmark = pytest.mark.timeout(60)


def _random_weights(rng: np.random.Generator, n: int, density: float, integer: bool) -> np.ndarray:
    w = rng.integers(1, 6, size=(n, n)).astype(float) if integer else rng.random((n, n))
    w[rng.random((n, n)) > density] = np.inf
    np.fill_diagonal(w, np.inf)
    return w


@pytest.mark.parametrize("small", [True, False], ids=["lists", "numpy"])
def test_min_arborescence_matches_networkx(small: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spanning, "_SMALL", 10_000 if small else 0)
    rng = np.random.default_rng(7)
    for _ in range(150):
        n = int(rng.integers(2, 14))
        w = _random_weights(rng, n, rng.uniform(0.2, 1.0), integer=bool(rng.integers(2)))
        root = int(rng.integers(n))
        g = nx.DiGraph()
        g.add_nodes_from(range(n))
        g.add_weighted_edges_from((u, v, w[u, v]) for u in range(n) for v in range(n) if np.isfinite(w[u, v]) and v != root)
        got = min_arborescence(w, root)
        try:
            ref = nx.minimum_spanning_arborescence(g).size(weight="weight")
        except nx.NetworkXException:
            assert got is None
            continue
        assert got is not None
        assert sorted(c for _, c in got) == sorted(set(range(n)) - {root})
        assert sum(w[u, v] for u, v in got) == pytest.approx(ref, abs=1e-9)
        # and it is an arborescence: every vertex reaches the root
        parent = {c: p for p, c in got}
        for start in list(parent):
            seen, v = set(), start
            while v != root:
                assert v not in seen
                seen.add(v)
                v = parent[v]


def test_min_spanning_tree_matches_networkx() -> None:
    rng = np.random.default_rng(11)
    for _ in range(150):
        n = int(rng.integers(2, 16))
        w = _random_weights(rng, n, rng.uniform(0.2, 1.0), integer=bool(rng.integers(2)))
        w = np.minimum(w, w.T)
        g = nx.Graph()
        g.add_nodes_from(range(n))
        g.add_weighted_edges_from((u, v, w[u, v]) for u in range(n) for v in range(u + 1, n) if np.isfinite(w[u, v]))
        got = min_spanning_tree(w)
        if not nx.is_connected(g):
            assert got is None
            continue
        assert got is not None and len(got) == n - 1
        assert sum(w[u, v] for u, v in got) == pytest.approx(nx.minimum_spanning_tree(g).size(weight="weight"), abs=1e-9)


def test_uniform_weights_give_a_star_the_shallowest_tree() -> None:
    w = np.ones((6, 6))
    np.fill_diagonal(w, np.inf)
    assert min_spanning_tree(w) == [(0, v) for v in range(1, 6)]
    assert sorted(min_arborescence(w, 2)) == [(2, v) for v in range(6) if v != 2]
