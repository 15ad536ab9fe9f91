"""The tree kernel's work tables (runtime/gpu/work.py), checked without a GPU: every element of every tree's
range is in exactly one item, items follow the trees, and each rank's tree table is its view of the plan."""

from __future__ import annotations

import pytest

from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.runtime.gpu.tree_executor import ARGS_DTYPE, kernel_source
from blink_horovod.runtime.gpu.work import MAX_ITEMS, MAX_RANKS, chunk_elements, make_work
from blink_horovod.schedule.compile import tree_ranges

pytestmark = pytest.mark.timeout(60)


def star_plan(n: int) -> Plan:
    trees = tuple(Tree(r, 1.0 / n, tuple((r, c) for c in range(n) if c != r)) for r in range(n))
    return Plan("allreduce", f"star{n}", tuple(range(n)), None, trees, 1.0, 1.0)


def chain_plan(n: int) -> Plan:
    """Each rank roots one chain through the others (multi-hop trees)."""
    trees = []
    for r in range(n):
        order = [r] + [c for c in range(n) if c != r]
        trees.append(Tree(r, 1.0 / n, tuple(zip(order, order[1:]))))
    return Plan("allreduce", f"chain{n}", tuple(range(n)), None, tuple(trees), 1.0, 1.0)


@pytest.mark.parametrize("plan", [star_plan(2), star_plan(8), chain_plan(4), chain_plan(8)], ids=lambda p: p.topology)
@pytest.mark.parametrize("count", [1, 2, 7, 1031, 1 << 20, (1 << 28) + 3])
@pytest.mark.parametrize("blocks", [1, 33, 132])
def test_items_cover_every_tree_range_once(plan: Plan, count: int, blocks: int) -> None:
    ranges, _ = tree_ranges(plan, count)
    for rank in range(plan.n):
        w = make_work(plan, count, 4, rank, blocks)
        assert 1 <= w.blocks <= blocks and w.nitems <= MAX_ITEMS
        covered: dict[int, list[tuple[int, int]]] = {}
        for it in w.items:
            assert it["lo"] < it["hi"]
            covered.setdefault(int(it["tree"]), []).append((int(it["lo"]), int(it["hi"])))
        for t, (lo, hi) in enumerate(ranges):
            spans = covered.get(t, [])
            if hi == lo:
                assert not spans
                continue
            assert spans[0][0] == lo and spans[-1][1] == hi
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("plan", [star_plan(8), chain_plan(5)], ids=lambda p: p.topology)
def test_tree_tables_are_each_ranks_view_of_the_plan(plan: Plan) -> None:
    for rank in range(plan.n):
        w = make_work(plan, 4096, 4, rank, 8)
        for t, tree in enumerate(plan.trees):
            row = w.trees[t]
            parent = {c: p for p, c in tree.edges}
            assert row["parent"] == (-1 if rank == tree.root else parent[rank])
            kids = [c for p, c in tree.edges if p == rank]
            assert list(row["child"][: row["nchild"]]) == kids


def test_chunks_are_16_byte_multiples_and_bounded() -> None:
    for itemsize in (1, 2, 4, 8):
        for count in (1, 10**3, 10**6, 10**9 // itemsize):
            c = chunk_elements(count, itemsize, 132, 27)
            assert (c * itemsize) % 16 == 0
            assert -(-count // c) + 27 <= MAX_ITEMS


def test_too_many_ranks_is_a_clear_error() -> None:
    from blink_horovod.errors import ConfigError

    with pytest.raises(ConfigError, match="at most 16"):
        make_work(star_plan(MAX_RANKS + 1), 100, 4, 0, 4)


def test_kernel_parameter_layout_and_source() -> None:
    # struct BlinkArgs in trees.cu: 4 + 2 * 16 + ... 64-bit words, then 10 ints.
    assert ARGS_DTYPE.itemsize == 8 * (1 + 2 * MAX_RANKS + 4) + 4 * 10
    src = kernel_source("bfloat16")
    for op in ("sum", "min", "max", "product"):
        assert f"BLINK_TREES_KERNEL(blink_trees_{op}," in src
    assert "typedef float blink_acc_t;" in src  # half types accumulate in float32
