"""The schedule compiler: byte ranges, chunking, pipelining steps, lanes, posts, and real results.

Results are checked numerically (integer-valued data, exact) by replaying each
program on numpy arrays under several random interleavings of its lanes, and
symbolically by ``check_program``.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.plans import allreduce_plan, broadcast_plan, sample_plans

from blink_horovod.errors import ScheduleError
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.schedule import (
    DONE_FLAG,
    START_FLAG,
    check_program,
    compile_program,
    tree_ranges,
)
from blink_horovod.schedule.replay import replay
from blink_horovod.topology.machines import resolve

pytestmark = pytest.mark.timeout(120)

PLANS = sample_plans()
IDS = [n for n, _ in PLANS]


def kinds_for(plan: Plan) -> tuple[str, ...]:
    return ("allreduce", "reduce", "broadcast")


def expected(plan: Plan, prog, inputs: list[np.ndarray], kind: str) -> list[tuple[int, int, int, np.ndarray]]:
    """(rank, lo, hi, values) that must hold at the end."""
    n = plan.n
    total = np.sum(inputs, axis=0)
    out = []
    if kind == "allreduce":
        out = [(r, 0, prog.count, total) for r in range(n)]
    elif kind == "reduce":
        out = [(r, lo, hi, total) for r, (lo, hi) in enumerate(prog.segments) if hi > lo]
    elif prog.root is not None:
        out = [(r, 0, prog.count, inputs[prog.root]) for r in range(n)]
    else:
        out = [(r, lo, hi, inputs[owner]) for owner, (lo, hi) in enumerate(prog.segments) for r in range(n)]
    return out


@pytest.mark.parametrize("name,plan", PLANS, ids=IDS)
def test_replayed_programs_give_exact_results(name: str, plan: Plan) -> None:
    rng = np.random.default_rng(0)
    for count, chunk in ((37, 4), (8, 100), (3, 1)):
        inputs = [rng.integers(-1000, 1000, count).astype(np.float64) for _ in range(plan.n)]
        for kind in kinds_for(plan):
            prog = compile_program(plan, count, chunk, kind)
            check_program(prog, plan)
            for seed in (None, 1, 2):
                out = replay(prog, inputs, seed=seed)
                for r, lo, hi, want in expected(plan, prog, inputs, kind):
                    np.testing.assert_array_equal(out[r][lo:hi], want[lo:hi], err_msg=f"{name} {kind} rank {r} seed {seed}")


def test_min_max_product_reduce_the_same_way() -> None:
    plan = allreduce_plan(resolve("dgx1v:0,1,2,3"), 2, seed=3)
    rng = np.random.default_rng(1)
    inputs = [rng.integers(1, 4, 50).astype(np.float64) for _ in range(plan.n)]
    prog = compile_program(plan, 50, 7)
    for op, fn in (("min", np.minimum), ("max", np.maximum), ("product", np.multiply)):
        want = inputs[0].copy()
        for x in inputs[1:]:
            want = fn(want, x)
        for out in replay(prog, inputs, op=op, seed=5):
            np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("count", [0, 1, 5, 7, 8, 9, 1000, 1001, 12345])
def test_allreduce_segments_are_exactly_the_ith_nth(count: int) -> None:
    for name, plan in PLANS:
        if plan.collective != "allreduce":
            continue
        n = plan.n
        prog = compile_program(plan, count, 3)
        assert prog.segments == tuple((i * count // n, (i + 1) * count // n) for i in range(n)), name
        ranges, _ = tree_ranges(plan, count)
        rank_of = {g: i for i, g in enumerate(plan.gpus)}
        pos = 0
        for t, ((lo, hi), tree) in enumerate(zip(ranges, plan.trees)):
            assert lo == pos and hi >= lo, (name, t)
            pos = hi
            seg = prog.segments[rank_of[tree.root]]
            assert seg[0] <= lo <= hi <= seg[1], (name, t, (lo, hi), seg)
        assert pos == count


def test_trees_of_a_root_split_its_segment_by_fraction() -> None:
    # Root 0 has trees of 1/8 and 3/8 of the bytes: its half splits 1:3.
    t = lambda root, f: Tree(root, f, ((0, 1),) if root == 0 else ((1, 0),))
    plan = Plan("allreduce", "custom", (0, 1), None, (t(0, 0.125), t(0, 0.375), t(1, 0.5)), 1.0, 1.0)
    ranges, segs = tree_ranges(plan, 1001)
    assert segs == [(0, 500), (500, 1001)]
    assert ranges == [(0, 125), (125, 500), (500, 1001)]


def test_broadcast_ranges_follow_fractions_in_list_order() -> None:
    tr = Tree(0, 0.25, ((0, 1),))
    plan = Plan("broadcast", "custom", (0, 1), 0, (tr, Tree(0, 0.0, ((0, 1),)), Tree(0, 0.75, ((0, 1),))), 1.0, 1.0)
    ranges, segs = tree_ranges(plan, 10)
    assert ranges == [(0, 2), (2, 2), (2, 10)] or ranges == [(0, 3), (3, 3), (3, 10)]
    assert segs == [(0, 10), (0, 0)]
    prog = compile_program(plan, 10, 3)
    assert {op.tree for _, _, op in prog.ops() if op.kind == "copy"} == {0, 2}  # the empty tree is skipped


def test_chunks_cut_each_tree_range_last_one_shorter() -> None:
    plan = broadcast_plan(resolve("dgx1v:0,1,2,3"), k=2, seed=1)
    prog = compile_program(plan, 1000, 64)
    ranges = prog.meta["tree_ranges"]
    for t, (lo, hi) in enumerate(ranges):
        regions = sorted({(op.offset, op.count, op.chunk) for _, _, op in prog.ops() if op.kind == "copy" and op.tree == t})
        want = [(a, min(64, hi - a), c) for c, a in enumerate(range(lo, hi, 64))]
        assert regions == want


def test_pipeline_steps_chunk_plus_height_then_down() -> None:
    # A chain 0 <- 1 <- 2 <- 3 rooted at 0: heights 3, 2, 1, 0.
    chain = Tree(0, 1.0, ((0, 1), (1, 2), (2, 3)))
    plan = Plan("broadcast", "custom", (0, 1, 2, 3), 0, (chain,), 1.0, 1.0)
    prog = compile_program(plan, 40, 10, "allreduce")  # 4 chunks
    steps = {(r, op.kind, op.chunk): op.step for r, _, op in prog.ops() if op.kind != "post"}
    for c in range(4):
        assert steps[(2, "reduce", c)] == c + 1  # height 1
        assert steps[(1, "reduce", c)] == c + 2
        assert steps[(0, "reduce", c)] == c + 3  # the root, height 3
        for depth, r in ((1, 1), (2, 2), (3, 3)):
            assert steps[(r, "copy", c)] == c + 3 + depth
    # Successive chunks overlap: at step 3 the root reduces chunk 0 while rank 1 reduces chunk 1.
    at3 = {(r, op.kind, op.chunk) for r, _, op in prog.ops() if op.step == 3 and op.kind != "post"}
    assert {(0, "reduce", 0), (1, "reduce", 1), (2, "reduce", 2)} <= at3


@pytest.mark.parametrize("name,plan", PLANS, ids=IDS)
def test_ops_sorted_by_step_and_wait_only_for_smaller_steps(name: str, plan: Plan) -> None:
    for kind in kinds_for(plan):
        prog = compile_program(plan, 997, 50, kind)
        post_step = {(r, op.flag): op.step for r, _, op in prog.ops() if op.kind == "post"}
        for r, ops in enumerate(prog.ranks):
            assert [op.step for op in ops] == sorted(op.step for op in ops)
            for i, op in enumerate(ops):
                assert all(j < i for j in op.after)
                if op.kind != "post":
                    assert post_step[(op.peer, op.flag)] < op.step


@pytest.mark.parametrize("policy", ["root", "link", "tree"])
def test_lanes_follow_the_policy_and_trees_reuse_them(policy: str) -> None:
    # Rank 0 reads rank 1 in trees 0 and 3 (up, reduce: 1 is 0's child), and in tree 1 (down:
    # 1 is 0's parent). Trees 0 and 3 have root 0; tree 1 has root 1.
    t0 = Tree(0, 1 / 6, ((0, 1), (0, 2)))
    t3 = Tree(0, 1 / 6, ((0, 2), (0, 1)))
    t1 = Tree(1, 1 / 3, ((1, 0), (1, 2)))
    t2 = Tree(2, 1 / 3, ((2, 1), (2, 0)))
    plan = Plan("allreduce", "custom", (0, 1, 2), None, (t0, t3, t1, t2), 1.0, 1.0)
    prog = compile_program(plan, 3000, 100, lanes=policy)
    check_program(prog, plan)
    assert prog.meta["lane_policy"] == policy
    key = {"link": lambda op: (op.channel, op.peer), "root": lambda op: (op.channel, op.peer, plan.trees[op.tree].root), "tree": lambda op: (op.channel, op.peer, op.tree)}[policy]
    for r, ops in enumerate(prog.ranks):
        lanes_of: dict[tuple, set[int]] = {}
        for op in ops:
            if op.kind != "post":
                lanes_of.setdefault(key(op), set()).add(op.stream)
        assert all(len(v) == 1 for v in lanes_of.values()), (r, lanes_of)  # one lane per key ...
        lanes = [next(iter(v)) for v in lanes_of.values()]
        assert len(set(lanes)) == len(lanes) == prog.nstreams[r]  # ... and one key per lane
    on = {(op.tree, op.kind): op.stream for op in prog.ranks[0] if op.peer == 1}
    assert set(on) == {(0, "reduce"), (1, "reduce"), (2, "copy")}
    if policy == "link":
        assert len(set(on.values())) == 1
    elif policy == "root":  # trees 0 and 1 (root 0) reuse one lane; tree 2 (root 1) has its own
        assert on[(0, "reduce")] == on[(1, "reduce")] != on[(2, "copy")]
    else:
        assert len(set(on.values())) == 3
    with pytest.raises(ScheduleError, match="lanes"):
        compile_program(plan, 10, 2, lanes="per-op")


def test_pcie_trees_move_on_their_own_channel_and_lanes() -> None:
    plan = broadcast_plan(resolve("dgx1v"), root=2, k=3, seed=11, pcie=True)
    prog = compile_program(plan, 5000, 128)
    check_program(prog, plan)
    pcie_tree = next(t for t, tr in enumerate(plan.trees) if tr.channel == "pcie")
    for r, ops in enumerate(prog.ranks):
        nv = {op.stream for op in ops if op.kind != "post" and op.channel == "nvlink"}
        pc = {op.stream for op in ops if op.kind != "post" and op.channel == "pcie"}
        assert not nv & pc
        assert all(op.tree == pcie_tree for op in ops if op.kind != "post" and op.channel == "pcie")


def test_posts_are_few_start_done_and_inner_nodes_only() -> None:
    chain = Tree(0, 1.0, ((0, 1), (0, 2), (1, 3)))  # 0 -> {1, 2}, 1 -> 3; leaves 2, 3
    plan = Plan("broadcast", "custom", (0, 1, 2, 3), 0, (chain,), 1.0, 1.0)
    k = 5
    for kind, per_chunk in (("allreduce", {0: 1, 1: 2, 2: 0, 3: 0}), ("reduce", {0: 0, 1: 1, 2: 0, 3: 0}), ("broadcast", {0: 0, 1: 1, 2: 0, 3: 0})):
        prog = compile_program(plan, 50, 10, kind)  # 5 chunks
        for r, ops in enumerate(prog.ranks):
            flags = Counter(op.flag for op in ops if op.kind == "post")
            chunk_posts = sum(v for f, v in flags.items() if f not in (START_FLAG, DONE_FLAG))
            assert chunk_posts == per_chunk[r] * k, (kind, r)
            reads = any(op.kind != "post" for op in ops)
            assert flags[DONE_FLAG] == int(reads), (kind, r)
            assert ops[-1].flag == DONE_FLAG or not reads
        # START is posted exactly where a peer reads the rank's input.
        starts = {r for r, _, op in prog.ops() if op.kind == "post" and op.flag == START_FLAG}
        wanted = {op.peer for _, _, op in prog.ops() if op.kind != "post" and op.flag == START_FLAG}
        assert starts == wanted
        assert all(op.step == 0 for _, _, op in prog.ops() if op.kind == "post" and op.flag == START_FLAG)


def test_writes_to_one_region_are_serialized_across_lanes() -> None:
    star = Tree(0, 1.0, ((0, 1), (0, 2), (0, 3)))
    plan = Plan("broadcast", "custom", (0, 1, 2, 3), 0, (star,), 1.0, 1.0)
    prog = compile_program(plan, 30, 10, "reduce")
    ops = prog.ranks[0]
    for c in range(3):
        red = [i for i, op in enumerate(ops) if op.kind == "reduce" and op.chunk == c]
        assert len({ops[i].stream for i in red}) == 3
        for a, b in itertools.pairwise(red):
            assert a in ops[b].after  # the next reduce into the chunk waits for the previous one


def test_done_post_covers_every_lane() -> None:
    plan = allreduce_plan(resolve("dgx1v"), 2, seed=4)
    prog = compile_program(plan, 10000, 100)
    for r, ops in enumerate(prog.ranks):
        done = ops[-1]
        assert done.kind == "post" and done.flag == DONE_FLAG
        last = {}
        for i, op in enumerate(ops[:-1]):
            last[op.stream] = i
        assert set(done.after) == {i for s, i in last.items() if s != done.stream}


def test_single_gpu_and_empty_buffer_have_no_transfers() -> None:
    one = Plan("allreduce", "dgx1v", (4,), None, (Tree(4, 1.0, ()),), 0.0, 0.0)
    for count in (0, 10):
        prog = compile_program(one, count, 3)
        assert prog.num_ops() == 0 and prog.segments == ((0, count),)
        check_program(prog, one)
    plan = allreduce_plan(resolve("dgx1v:0,1,2,3"), 1)
    prog = compile_program(plan, 0, 8)
    assert prog.num_ops() == 0
    check_program(prog, plan)


def test_fewer_elements_than_ranks() -> None:
    plan = allreduce_plan(resolve("dgx1v"), 2, seed=5)
    for count in (1, 3, 7):
        prog = compile_program(plan, count, 1)
        check_program(prog, plan)
        assert sum(hi - lo for lo, hi in prog.segments) == count
        out = replay(prog, [np.full(count, float(r + 1)) for r in range(8)], seed=3)
        for o in out:
            np.testing.assert_array_equal(o, np.full(count, 36.0))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"count": -1}, "count"),
        ({"count": 2.5}, "count"),
        ({"chunk_elems": 0}, "chunk_elems"),
        ({"chunk_elems": True}, "chunk_elems"),
        ({"kind": "gather"}, "kind"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    plan = allreduce_plan(resolve("dgx1v:0,3"), 1)
    args = {"count": 10, "chunk_elems": 4, "kind": None} | kwargs
    with pytest.raises(ScheduleError, match=field):
        compile_program(plan, args["count"], args["chunk_elems"], args["kind"])


def test_allreduce_plan_with_a_root_out_of_order_is_rejected() -> None:
    plan = Plan("allreduce", "custom", (0, 1), None, (Tree(1, 0.5, ((1, 0),)), Tree(0, 0.5, ((0, 1),))), 1.0, 1.0)
    with pytest.raises(ScheduleError, match=r"trees\[1\]"):
        compile_program(plan, 10, 2)
    plan = Plan("allreduce", "custom", (0, 1), None, (Tree(0, 1.0, ((0, 1),)),), 1.0, 1.0)
    with pytest.raises(ScheduleError, match="GPU 1 .* roots no tree"):
        compile_program(plan, 10, 2)


def test_compile_is_fast_and_linear_in_ops() -> None:
    """1 GB of float32 in 1 MB chunks on 8 DGX-1V GPUs with 16 trees: ~20k ops."""
    plan = allreduce_plan(resolve("dgx1v"), 2, seed=6)
    count, chunk = (1 << 30) // 4, (1 << 20) // 4
    t0 = time.perf_counter()
    prog = compile_program(plan, count, chunk)
    dt = time.perf_counter() - t0
    chunks = sum(-(-(hi - lo) // chunk) for lo, hi in prog.meta["tree_ranges"] if hi > lo)
    # Per chunk of a tree on n ranks: n-1 reduces, n-1 copies and < 2n posts.
    assert 2 * 7 * chunks <= prog.num_ops() <= (2 * 7 + 16) * chunks + 16
    assert dt < 5.0, f"compile took {dt:.2f} s"


# -- property: any valid plan, any size, any chunk: the checker passes and the numbers agree --------



@st.composite
def random_plans(draw):
    n = draw(st.integers(1, 6))
    gpus = tuple(draw(st.permutations(range(8)))[:n])
    collective = draw(st.sampled_from(["allreduce", "broadcast"]))

    def tree(root):
        order = [root] + [g for g in draw(st.permutations(gpus)) if g != root]
        edges = tuple((order[draw(st.integers(0, i - 1))], order[i]) for i in range(1, n))
        return edges

    channel = lambda: draw(st.sampled_from(["nvlink", "nvlink", "pcie"]))
    trees = []
    if collective == "allreduce":
        for g in gpus:
            k = draw(st.integers(1, 3))
            ws = [draw(st.floats(0.1, 1.0)) for _ in range(k)]
            trees += [Tree(g, w / sum(ws) / n, tree(g), channel()) for w in ws]
        root = None
    else:
        root = draw(st.sampled_from(gpus))
        k = draw(st.integers(1, 4))
        ws = [draw(st.floats(0.0, 1.0)) for _ in range(k - 1)] + [1.0]
        trees = [Tree(root, w / sum(ws), tree(root), channel()) for w in ws]
    return Plan(collective, "custom", gpus, root, tuple(trees), 1.0, 1.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=random_plans(), count=st.integers(0, 300), chunk=st.integers(1, 64), kind=st.sampled_from(["allreduce", "reduce", "broadcast", None]), seed=st.integers(0, 99), lanes=st.sampled_from(["root", "link", "tree"]))
def test_property_any_plan_checks_and_replays_exactly(plan: Plan, count: int, chunk: int, kind, seed: int, lanes: str) -> None:
    prog = compile_program(plan, count, chunk, kind, lanes=lanes)
    check_program(prog, plan)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-50, 50, count).astype(np.float64) for _ in range(plan.n)]
    out = replay(prog, inputs, seed=seed)
    for r, lo, hi, want in expected(plan, prog, inputs, prog.kind):
        np.testing.assert_array_equal(out[r][lo:hi], want[lo:hi])


def test_meta_lanes_name_the_link_of_every_lane() -> None:
    plan = broadcast_plan(resolve("dgx1v"), root=2, k=3, seed=11, pcie=True)
    prog = compile_program(plan, 5000, 128)
    for r, ops in enumerate(prog.ranks):
        lanes = prog.meta["lanes"][r]
        for op in ops:
            if op.kind != "post":
                assert lanes[op.stream] == (op.channel, op.peer)


# -- the simulator's schedule options: chunking="even", pace, streams, fanin --------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=random_plans(), count=st.integers(0, 300), chunk=st.integers(1, 64), kind=st.sampled_from(["allreduce", "reduce", "broadcast", None]),
       seed=st.integers(0, 99), lanes=st.sampled_from(["root", "link", "tree"]), pace=st.sampled_from([None, 1, 2, 4]),
       streams=st.integers(1, 3), fanin=st.booleans())
def test_property_schedule_options_check_and_replay_exactly(plan: Plan, count: int, chunk: int, kind, seed: int, lanes: str,
                                                             pace, streams: int, fanin: bool) -> None:
    prog = compile_program(plan, count, chunk, kind, lanes=lanes, chunking="even", pace=pace, streams=streams, fanin=fanin)
    check_program(prog, plan)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-50, 50, count).astype(np.float64) for _ in range(plan.n)]
    out = replay(prog, inputs, seed=seed)
    for r, lo, hi, want in expected(plan, prog, inputs, prog.kind):
        np.testing.assert_array_equal(out[r][lo:hi], want[lo:hi])


def test_even_chunking_gives_every_tree_the_same_chunk_count_in_proportion() -> None:
    trees = (Tree(0, 0.75, ((0, 1), (1, 2))), Tree(0, 0.25, ((0, 2), (2, 1))))
    plan = Plan("broadcast", "custom", (0, 1, 2), 0, trees, 1.0, 1.0)
    prog = compile_program(plan, 4000, 300, chunking="even")
    sizes: dict[int, list[int]] = {}
    for op in prog.ranks[1]:
        if op.kind == "copy":
            sizes.setdefault(op.tree, []).append(op.count)
    k = -(-3000 // 300)  # the largest tree's range in chunks of 300
    assert [len(sizes[0]), len(sizes[1])] == [k, k]
    assert sum(sizes[0]) == 3000 and sum(sizes[1]) == 1000
    assert max(sizes[0]) == 300 and max(sizes[1]) == 100
    # streams=2: two lanes per tree and link, the first and last chunk half size.
    prog = compile_program(plan, 4000, 300, chunking="even", streams=2)
    copies = [op for op in prog.ranks[1] if op.kind == "copy" and op.tree == 0]
    assert len(copies) == k + 1 and copies[0].count == copies[-1].count == 150
    assert len({op.stream for op in copies}) == 2
    assert [op.stream for op in copies[:4]] == [copies[0].stream, copies[1].stream] * 2


def test_pace_keeps_trees_sharing_a_link_within_pace_steps() -> None:
    # Two trees over the link 0 -> 1; with pace 2 a transfer of step s waits for
    # the other tree's latest transfer over that link of step <= s - 2.
    trees = (Tree(0, 0.5, ((0, 1), (1, 2))), Tree(0, 0.5, ((0, 1), (0, 2))))
    plan = Plan("broadcast", "custom", (0, 1, 2), 0, trees, 1.0, 1.0)
    prog = compile_program(plan, 1000, 50, lanes="tree", chunking="even", pace=2)
    check_program(prog, plan)
    ops = prog.ranks[1]
    link = [i for i, op in enumerate(ops) if op.kind == "copy" and op.peer == 0]
    waited = 0
    for i in link:
        op = ops[i]
        for j in op.after:
            other = ops[j]
            if other.kind == "copy" and other.peer == 0:
                assert other.tree != op.tree and other.step <= op.step - 2
                waited += 1
    assert waited >= len(link) - 4
    with pytest.raises(ScheduleError, match="pace"):
        compile_program(plan, 10, 2, pace=0)
    with pytest.raises(ScheduleError, match="chunking"):
        compile_program(plan, 10, 2, chunking="odd")
    with pytest.raises(ScheduleError, match="streams"):
        compile_program(plan, 10, 2, streams=0)


def test_fanin_reduces_every_child_in_one_op_and_the_checker_catches_a_missing_one() -> None:
    star = tuple(Tree(g, 0.25, tuple((g, c) for c in range(4) if c != g)) for g in range(4))
    plan = Plan("allreduce", "custom", (0, 1, 2, 3), None, star, 1.0, 1.0)
    prog = compile_program(plan, 64, 16, fanin=True)
    check_program(prog, plan)
    fan = [op for op in prog.ranks[0] if op.kind == "fanin"]
    assert len(fan) == 1 and sorted(q for q, _ in fan[0].peers) == [1, 2, 3]
    assert not any(op.kind == "reduce" for op in prog.ranks[0])
    assert prog.readers()[3] == frozenset({0, 1, 2})
    # Drop one source of the root's fan-in: the checker names the wrong result.
    import dataclasses

    ranks = [list(ops) for ops in prog.ranks]
    i = ranks[0].index(fan[0])
    ranks[0][i] = dataclasses.replace(fan[0], peers=fan[0].peers[:2])
    broken = dataclasses.replace(prog, ranks=tuple(tuple(o) for o in ranks))
    with pytest.raises(ScheduleError, match="wrong result"):
        check_program(broken)
