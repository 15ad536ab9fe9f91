"""The symbolic checker: passes compiled programs, fails broken ones naming the rank and op."""

from __future__ import annotations

import dataclasses
import time

import pytest
from support.plans import allreduce_plan, broadcast_plan, sample_plans

from blink_horovod.errors import ScheduleError
from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.schedule import (
    DONE_FLAG,
    START_FLAG,
    Op,
    Program,
    check_program,
    clear_check_cache,
    compile_program,
)
from blink_horovod.topology.machines import resolve

pytestmark = pytest.mark.timeout(120)

PLANS = sample_plans()


@pytest.mark.parametrize("name,plan", PLANS, ids=[n for n, _ in PLANS])
@pytest.mark.parametrize("count,chunk", [(0, 1), (1, 1), (1000, 64), (4097, 1000), (33, 100)])
def test_compiled_programs_pass(name: str, plan: Plan, count: int, chunk: int) -> None:
    for kind in ("allreduce", "reduce", "broadcast"):
        prog = compile_program(plan, count, chunk, kind)
        check_program(prog)
        check_program(prog, plan)


# -- ways to break a program --------------------------------------------------


def replace_rank(prog: Program, r: int, ops: list[Op]) -> Program:
    ranks = list(prog.ranks)
    ranks[r] = tuple(ops)
    return dataclasses.replace(prog, ranks=tuple(ranks))


def drop(prog: Program, r: int, k: int) -> Program:
    """Rank r without op k (later indices and `after` fixed up)."""
    ops = []
    for i, op in enumerate(prog.ranks[r]):
        if i == k:
            continue
        after = tuple(j - (j > k) for j in op.after if j != k)
        ops.append(dataclasses.replace(op, after=after))
    return replace_rank(prog, r, ops)


def duplicate(prog: Program, r: int, k: int) -> Program:
    """Rank r with op k repeated right after itself, on the same lane."""
    ops = []
    for i, op in enumerate(prog.ranks[r]):
        ops.append(dataclasses.replace(op, after=tuple(j + (j > k) for j in op.after)))
        if i == k:
            ops.append(dataclasses.replace(op, after=()))
    return replace_rank(prog, r, ops)


def edit(prog: Program, r: int, k: int, **changes) -> Program:
    ops = list(prog.ranks[r])
    ops[k] = dataclasses.replace(ops[k], **changes)
    return replace_rank(prog, r, ops)


def find(prog: Program, pred) -> tuple[int, int]:
    for r, i, op in prog.ops():
        if pred(r, i, op):
            return r, i
    raise AssertionError("no such op")


@pytest.fixture(scope="module")
def star_plan() -> Plan:
    # Allreduce over dgx1v:0,1,2,3 (0-1, 0-2, 0-3, 1-2, 1-3, 2-3 all linked).
    # Trees rooted at each rank; tree of root 0 is a star (one node with three children),
    # tree of root 1 a chain 1 -> 2 -> 3 -> 0 (inner nodes with two posts per chunk).
    trees = (
        Tree(0, 0.25, ((0, 1), (0, 2), (0, 3))),
        Tree(1, 0.25, ((1, 2), (2, 3), (3, 0))),
        Tree(2, 0.25, ((2, 0), (0, 1), (0, 3))),
        Tree(3, 0.25, ((3, 1), (1, 0), (1, 2))),
    )
    return Plan("allreduce", "dgx1v", (0, 1, 2, 3), None, trees, 1.0, 1.0)


@pytest.fixture(scope="module")
def prog(star_plan: Plan) -> Program:
    p = compile_program(star_plan, 400, 25)  # 100 elements per tree, 4 chunks each
    check_program(p, star_plan)
    return p


def rank_op(msg: str) -> bool:
    import re

    return re.search(r"rank \d+ op \d+", msg) is not None


def test_dropped_op_is_a_wrong_result(prog: Program) -> None:
    # Rank 0 reduces tree 0's chunks from 1, then 2, then 3 (chained by `after`); drop the first.
    r, k = find(prog, lambda r, i, op: op.kind == "reduce" and op.tree == 0 and op.chunk == 2 and op.peer == 1)
    with pytest.raises(ScheduleError, match=r"wrong result: rank 0 elements \[50, 75\) \(tree 0 chunk 2\) holds the inputs of ranks \[0, 2, 3\], missing \[1\]"):
        check_program(drop(prog, r, k))
    # A dropped copy of the down phase too.
    r, k = find(prog, lambda r, i, op: op.kind == "copy" and op.tree == 1 and op.chunk == 0 and r == 0)
    with pytest.raises(ScheduleError, match=r"wrong result: rank 0 elements \[100, 125\) \(tree 1 chunk 0\)"):
        check_program(drop(prog, r, k))
    # Dropping the last reduce of the chain also leaves the chunk's post (on that lane)
    # without the writes it covered: the parent's read is then caught as too early.
    r, k = find(prog, lambda r, i, op: op.kind == "reduce" and op.tree == 0 and op.chunk == 2 and op.peer == 3)
    with pytest.raises(ScheduleError, match=r"read before post: rank \d op \d+ \(copy tree 0 chunk 2"):
        check_program(drop(prog, r, k))


def test_wrong_peer_is_caught(prog: Program, star_plan: Plan) -> None:
    # Rank 3 copies tree 1's chunk from rank 1 instead of its parent, rank 2 (same flag index).
    r, k = find(prog, lambda r, i, op: op.kind == "copy" and op.tree == 1 and op.chunk == 1 and r == 3)
    assert prog.ranks[r][k].peer == 2
    bad = edit(prog, r, k, peer=1)
    with pytest.raises(ScheduleError) as e:
        check_program(bad)
    assert rank_op(str(e.value)) and "rank 3 op" in str(e.value)
    with pytest.raises(ScheduleError, match=r"rank 3 op \d+ .*rank 1 \(GPU 1\) is not the parent of rank 3 \(GPU 3\) in tree 1"):
        check_program(bad, star_plan)


def test_read_before_post_is_caught(prog: Program) -> None:
    # Rank 3 copies tree 1 chunk 2 from rank 2 but waits for rank 2's *up* post
    # (chunk reduced) instead of its final post: the read comes before the data.
    up_flag = next(op.flag for op in prog.ranks[2] if op.kind == "post" and op.tree == 1 and op.chunk == 2)
    r, k = find(prog, lambda r, i, op: op.kind == "copy" and op.tree == 1 and op.chunk == 2 and r == 3)
    assert prog.ranks[r][k].flag != up_flag
    bad = edit(prog, r, k, flag=up_flag)
    with pytest.raises(ScheduleError, match=rf"read before post: rank 3 op {k} \(copy tree 1 chunk 2.*reads rank 2's elements \[150, 175\).*does not cover that write"):
        check_program(bad)


def test_write_race_is_caught(prog: Program) -> None:
    # Rank 0 reduces tree 0's chunk from children 1, 2, 3 on three lanes; drop the
    # `after` that orders the second reduce after the first.
    r, k = find(prog, lambda r, i, op: op.kind == "reduce" and op.tree == 0 and op.chunk == 1 and op.after)
    bad = edit(prog, r, k, after=())
    with pytest.raises(ScheduleError, match=rf"write race: .*rank 0 op {k}.*both write rank 0's elements \[25, 50\)|write race: .*rank 0 op {k}"):
        check_program(bad)


def test_overwrite_while_a_peer_reads_is_a_write_race() -> None:
    # Rank 1 overwrites its buffer (copy from 2) right after posting it, without waiting for
    # rank 0 to finish reading: hand-built, three ranks.
    ops0 = (Op("reduce", peer=1, flag=START_FLAG, offset=0, count=4, step=1), Op("post", flag=DONE_FLAG, step=1))
    ops1 = (
        Op("post", flag=START_FLAG, step=0),
        Op("copy", peer=2, flag=START_FLAG, offset=0, count=4, step=1),
        Op("post", flag=DONE_FLAG, step=1),
    )
    ops2 = (Op("post", flag=START_FLAG, step=0),)
    prog = Program("reduce", 3, 4, 4, (ops0, ops1, ops2), (2, 2, 2), (1, 1, 1), ((0, 4), (0, 0), (0, 0)))
    with pytest.raises(ScheduleError, match=r"(write race: rank 1 op 1 .* overwrites rank 1's elements \[0, 4\) while rank 0 op 0)|(read before post: rank 0 op 0)"):
        check_program(prog)


def test_missing_post_is_a_deadlock_naming_the_waits(prog: Program) -> None:
    # Rank 2 (inner node of tree 1) never posts chunk 0 reduced.
    r, k = find(prog, lambda r, i, op: r == 2 and op.kind == "post" and op.tree == 1 and op.chunk == 0)
    flag = prog.ranks[r][k].flag
    bad = drop(prog, r, k)
    with pytest.raises(ScheduleError, match=rf"deadlock: .*rank 1 op \d+ \(reduce tree 1 chunk 0.*waits for rank 2 flag {flag}, which rank 2 never posts"):
        check_program(bad)


def test_double_reduction_is_caught(prog: Program) -> None:
    r, k = find(prog, lambda r, i, op: op.kind == "reduce" and op.tree == 2 and op.chunk == 3 and r == 0)
    bad = duplicate(prog, r, k)
    with pytest.raises(ScheduleError, match=rf"double reduction: rank 0 op {k + 1} \(reduce tree 2 chunk 3.*adds the inputs of ranks \[\d.*already hold them"):
        check_program(bad)


def test_waiting_for_a_post_of_the_same_step_breaks_the_step_contract(prog: Program) -> None:
    ranks = tuple(tuple(dataclasses.replace(op, step=0) for op in ops) for ops in prog.ranks)
    with pytest.raises(ScheduleError, match=r"rank \d+ op \d+ .* waits for rank \d+ op \d+ .*of step 0 >= 0"):
        check_program(dataclasses.replace(prog, ranks=ranks))


def test_missing_done_post(prog: Program) -> None:
    r = 2
    k = len(prog.ranks[r]) - 1
    assert prog.ranks[r][k].flag == DONE_FLAG
    with pytest.raises(ScheduleError, match="rank 2 reads peers but never posts DONE_FLAG"):
        check_program(drop(prog, r, k))
    # DONE on lane 0 without waiting for the other lanes
    with pytest.raises(ScheduleError, match=r"rank 2 op \d+ \(post.*\(DONE\) does not come after"):
        check_program(edit(prog, r, k, after=()))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"peer": 7}, "peer 7 is not another rank"),
        ({"flag": 999}, "flag 999 outside rank"),
        ({"stream": 9}, "stream 9 outside"),
        ({"offset": 390, "count": 20}, r"region \[390, 410\)"),
        ({"after": (50,)}, "after index 50"),
        ({"channel": "smoke"}, "channel 'smoke'"),
    ],
)
def test_malformed_ops(prog: Program, change: dict, match: str) -> None:
    r, k = find(prog, lambda r, i, op: op.kind == "copy" and r == 3 and i > 3)
    with pytest.raises(ScheduleError, match=match):
        check_program(edit(prog, r, k, **change))


def test_flag_posted_twice(prog: Program) -> None:
    r, k = find(prog, lambda r, i, op: op.kind == "post" and op.tree == 1 and r == 2)
    last = len(prog.ranks[r]) - 1
    with pytest.raises(ScheduleError, match=rf"rank 2 op {last} .*flag {prog.ranks[r][k].flag} already posted by op {k}"):
        check_program(edit(prog, r, last, flag=prog.ranks[r][k].flag))


def test_plan_mismatch_on_channel_and_segments(prog: Program, star_plan: Plan) -> None:
    r, k = find(prog, lambda r, i, op: op.kind == "copy")
    with pytest.raises(ScheduleError, match="moves on pcie, tree .* is on nvlink"):
        check_program(edit(prog, r, k, channel="pcie"), star_plan)
    shifted = dataclasses.replace(prog, segments=((0, 101), (101, 200), (200, 300), (300, 400)))
    with pytest.raises(ScheduleError, match=r"segments\[0\]: \(0, 101\), the cross-server stage needs exactly \(0, 100\)"):
        check_program(shifted, star_plan)


def test_broadcast_from_the_wrong_root_is_a_wrong_result() -> None:
    plan = broadcast_plan(resolve("dgx1v:0,1,2,3"), root=0, k=2, seed=1)
    prog = compile_program(plan, 100, 10)
    check_program(prog)
    with pytest.raises(ScheduleError, match=r"wrong result: rank 0 elements .*holds the inputs of ranks \[0\].*expected root rank 1's input"):
        check_program(dataclasses.replace(prog, root=1))


def test_cache_remembers_passes_only() -> None:
    clear_check_cache()
    plan = allreduce_plan(resolve("dgx1v"), 2, seed=12)
    prog = compile_program(plan, (64 << 20) // 4, (256 << 10) // 4)
    t0 = time.perf_counter()
    check_program(prog)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        check_program(prog)
    again = (time.perf_counter() - t0) / 100
    assert again < first / 50, (first, again)
    # an equal program (recompiled) hits the value cache
    check_program(compile_program(plan, (64 << 20) // 4, (256 << 10) // 4))
    # a broken program is never remembered as passing
    r, k = find(prog, lambda r, i, op: op.kind == "reduce")
    bad = drop(prog, r, k)
    for _ in range(2):
        with pytest.raises(ScheduleError):
            check_program(bad)
