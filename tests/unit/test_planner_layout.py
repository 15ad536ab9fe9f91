"""The multi-root layout: owner-rooted pieces, exact 1/n shares, at most T + n - 1 pieces."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_horovod.planner.layout import eccentricity, multi_root, orient

pytestmark = pytest.mark.timeout(60)

PATH = ((0, 1), (1, 2), (2, 3))
STAR = ((0, 1), (0, 2), (0, 3))


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=9),
    weights=st.lists(st.floats(min_value=1e-3, max_value=10.0), min_size=1, max_size=12),
)
def test_shares_are_exact_and_pieces_few(n: int, weights: list[float]) -> None:
    trees = [tuple((i, (i + k + 1) % n) for i in range(n - 1)) for k in range(len(weights))]
    total = sum(weights)
    pieces = multi_root(trees, weights, n)
    assert len(pieces) <= len(trees) + n - 1
    assert math.fsum(p.fraction for p in pieces) == pytest.approx(1.0, abs=1e-12)
    pos = 0.0
    for p in pieces:  # in byte order, owner by owner
        assert p.root == min(int((pos + p.fraction / 2) * n), n - 1)
        pos += p.fraction
    for i in range(n):
        assert math.fsum(p.fraction for p in pieces if p.root == i) == pytest.approx(1 / n, abs=1e-12)
    for t, w in enumerate(weights):  # each tree keeps its weight, up to the sliver merging
        assert math.fsum(p.fraction for p in pieces if p.index == t) == pytest.approx(w / total, abs=1e-6)


def test_whole_share_trees_go_to_their_centre() -> None:
    n = 4
    stars = [tuple((c, v) for v in range(n) if v != c) for c in (2, 0, 3, 1)]
    pieces = multi_root(stars, [1, 1, 1, 1], n)
    assert len(pieces) == n
    assert all(eccentricity(p.tree, p.root) == 1 for p in pieces)


def test_orient_roots_an_undirected_tree() -> None:
    assert orient(PATH, 2) == [(2, 1), (2, 3), (1, 0)]
    assert eccentricity(PATH, 0) == 3 and eccentricity(PATH, 1) == 2 and eccentricity(STAR, 0) == 1
