"""The fluid engine and the Program executor: exact times on small cases."""

from __future__ import annotations

import math

import pytest

from blink_horovod.errors import ScheduleError
from blink_horovod.schedule.program import Op, Program
from blink_horovod.sim.engine import TaskGraph, run
from blink_horovod.sim.execute import simulate_program
from blink_horovod.sim.params import SimParams
from blink_horovod.topology.model import Link, PCIeChannel, Topology

pytestmark = pytest.mark.timeout(60)

GB = 1e9
MB = 2**20


def two_gpus(gbps: float = 25.0) -> Topology:
    return Topology(gpus=(0, 1), links=(Link(0, 1, "nvlink", 1, gbps),), name="pair", pcie=PCIeChannel(12.0, ((0, 1),)))


def chain3(gbps: float = 25.0) -> Topology:
    return Topology(
        gpus=(0, 1, 2),
        links=(Link(0, 1, "nvlink", 1, gbps), Link(1, 2, "nvlink", 1, gbps)),
        name="chain3",
        pcie=PCIeChannel(12.0, ((0, 1), (2,))),
    )


def program(kind: str, ranks, count: int) -> Program:
    ranks = tuple(tuple(r) for r in ranks)
    return Program(
        kind=kind,
        nranks=len(ranks),
        count=count,
        chunk_elems=count,
        ranks=ranks,
        nflags=tuple(4 for _ in ranks),
        nstreams=tuple(2 for _ in ranks),
    )


PARAMS = SimParams(launch_s=10e-6, copy_s=2e-6, reduce_extra_s=0.5e-6, post_s=1e-6, pcie_switch_s=40e-6)


def test_single_link_transfer_is_size_over_bandwidth_plus_costs():
    count = 64 * MB // 4
    prog = program(
        "broadcast",
        [[Op("post", flag=0)], [Op("copy", peer=0, flag=0, offset=0, count=count)]],
        count,
    )
    res = simulate_program(prog, two_gpus(25.0), PARAMS)
    expected = PARAMS.launch_s + PARAMS.post_s + PARAMS.copy_s + 64 * MB / (25.0 * GB)
    assert res.time_s == pytest.approx(expected, rel=1e-12)
    # The link direction 0 -> 1 was busy exactly for the transfer.
    assert res.bytes_per_resource == {"nvlink 0->1": 64 * MB}


def test_reduce_pays_its_extra_cost_and_is_bounded_by_the_reduction_rate():
    count = 64 * MB // 4
    prog = program(
        "reduce",
        [[Op("post", flag=0)], [Op("reduce", peer=0, flag=0, offset=0, count=count)]],
        count,
    )
    res = simulate_program(prog, two_gpus(25.0), PARAMS)
    assert res.time_s == pytest.approx(PARAMS.launch_s + PARAMS.post_s + PARAMS.copy_s + PARAMS.reduce_extra_s + 64 * MB / 25e9)
    slow = PARAMS.with_(hbm_gbps=20.0)  # reduces at 10 GB/s: slower than the link
    res = simulate_program(prog, two_gpus(25.0), slow)
    assert res.time_s == pytest.approx(slow.launch_s + slow.post_s + slow.copy_s + slow.reduce_extra_s + 64 * MB / 10e9)


def test_two_flows_sharing_a_link_get_half_each():
    g = TaskGraph()
    g.add(nbytes=100.0, resources=(0,))
    g.add(nbytes=100.0, resources=(0,))
    out = run(g, [10.0])
    assert out.finish == pytest.approx([20.0, 20.0])
    # A short flow leaves at twice its own size over the capacity; the long one then speeds up.
    g = TaskGraph()
    g.add(nbytes=50.0, resources=(0,))
    g.add(nbytes=150.0, resources=(0,))
    out = run(g, [10.0])
    assert out.finish == pytest.approx([10.0, 20.0])


def test_two_copies_on_two_lanes_over_one_link_share_it():
    half = 32 * MB // 4
    prog = program(
        "broadcast",
        [
            [Op("post", flag=0)],
            [
                Op("copy", peer=0, flag=0, offset=0, count=half, stream=0),
                Op("copy", peer=0, flag=0, offset=half, count=half, stream=1),
            ],
        ],
        2 * half,
    )
    zero = SimParams.zero_cost()
    res = simulate_program(prog, two_gpus(25.0), zero)
    assert res.time_s == pytest.approx(64 * MB / 25e9)
    assert res.utilization()["nvlink 0->1"] == pytest.approx(1.0)


def test_flow_is_bounded_by_its_slowest_resource():
    g = TaskGraph()
    g.add(nbytes=100.0, resources=(0, 1))
    g.add(nbytes=100.0, resources=(1,))
    out = run(g, [100.0, 10.0])
    assert out.finish == pytest.approx([20.0, 20.0])


def test_pipeline_fill_over_a_chain():
    """C chunks down a 2-hop chain take (C + 1) chunk times, not 2 C."""
    chunks, elems = 8, MB // 4
    r1, r2 = [], []
    for c in range(chunks):
        r1.append(Op("copy", peer=0, flag=0, offset=c * elems, count=elems, stream=0, step=c + 1))
        r1.append(Op("post", flag=2 + c, stream=0, step=c + 1))
        r2.append(Op("copy", peer=1, flag=2 + c, offset=c * elems, count=elems, stream=0, step=c + 2))
    prog = program("broadcast", [[Op("post", flag=0)], r1, r2], chunks * elems)
    zero = SimParams.zero_cost()
    res = simulate_program(prog, chain3(25.0), zero)
    chunk_t = MB / 25e9
    assert res.time_s == pytest.approx((chunks + 1) * chunk_t)
    # With fixed costs every hop of every chunk on a lane pays copy (and post on rank 1).
    res = simulate_program(prog, chain3(25.0), PARAMS)
    # Rank 1's lane: C x (copy + transfer + post); rank 2 trails by one chunk: copy + transfer.
    lane1 = chunks * (PARAMS.copy_s + chunk_t + PARAMS.post_s)
    expected = PARAMS.launch_s + PARAMS.post_s + lane1 + PARAMS.copy_s + chunk_t
    assert res.time_s == pytest.approx(expected)


def test_compiled_chain_broadcast_matches_the_pipeline_formula():
    from blink_horovod.planner.plan import Plan, Tree
    from blink_horovod.schedule import compile_program

    plan = Plan("broadcast", "chain3", (0, 1, 2), 0, (Tree(0, 1.0, ((0, 1), (1, 2))),), 25.0, 25.0)
    chunks, elems = 16, MB // 4
    prog = compile_program(plan, chunks * elems, elems)
    res = simulate_program(prog, chain3(25.0), SimParams.zero_cost())
    assert res.time_s == pytest.approx((chunks + 1) * MB / 25e9)


def test_switch_route_loads_both_ports():
    topo = Topology(
        gpus=(0, 1, 2),
        links=tuple(Link(g, "sw", "nvlink", 2, 50.0) for g in range(3)),
        switches=("sw",),
        name="switched",
    )
    count = 50 * MB // 4
    # GPUs 1 and 2 both pull from 0: 0's port into the switch is shared.
    prog = program(
        "broadcast",
        [[Op("post", flag=0)], [Op("copy", peer=0, flag=0, count=count)], [Op("copy", peer=0, flag=0, count=count)]],
        count,
    )
    res = simulate_program(prog, topo, SimParams.zero_cost())
    assert res.time_s == pytest.approx(2 * 50 * MB / 50e9)
    assert set(res.bytes_per_resource) == {"nvlink 0->sw", "nvlink sw->1", "nvlink sw->2"}


def test_pcie_ops_pay_the_channel_switch_once_and_move_at_pcie_speed():
    count = 12 * MB // 4
    prog = program(
        "broadcast",
        [[Op("post", flag=0)], [Op("copy", peer=0, flag=0, count=count, channel="pcie")]],
        count,
    )
    res = simulate_program(prog, two_gpus(25.0), PARAMS)
    expected = PARAMS.launch_s + max(PARAMS.post_s, PARAMS.pcie_switch_s) + PARAMS.copy_s + 12 * MB / 12e9
    assert res.time_s == pytest.approx(expected)
    assert set(res.bytes_per_resource) == {"pcie 0->sw", "pcie sw->1"}


def test_deadlock_is_reported_not_hung():
    prog = program(
        "broadcast",
        [[Op("copy", peer=1, flag=3, count=4)], [Op("copy", peer=0, flag=3, count=4)]],
        4,
    )
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate_program(prog, two_gpus(), PARAMS)


def test_transfer_over_a_missing_link_is_an_error():
    prog = program(
        "broadcast",
        [[Op("post", flag=0)], [], [Op("copy", peer=0, flag=0, count=4)]],
        4,
    )
    with pytest.raises(ScheduleError, match="no NVLink between GPU 0 and GPU 2"):
        simulate_program(prog, chain3(), PARAMS)


def test_bad_tasks_are_rejected():
    g = TaskGraph()
    with pytest.raises(ScheduleError):
        g.add(nbytes=5.0)
    with pytest.raises(ScheduleError):
        g.add(latency=-1.0)
    with pytest.raises(ScheduleError):
        g.add(latency=math.nan)


def test_params_are_validated():
    from blink_horovod.errors import ConfigError

    with pytest.raises(ConfigError, match="copy_s"):
        SimParams(copy_s=-1.0)
    with pytest.raises(ConfigError, match="itemsize"):
        SimParams(itemsize=0)


def test_folding_posts_into_their_ops_changes_no_time():
    from blink_horovod.planner.plan import Plan, Tree
    from blink_horovod.schedule import compile_program
    from blink_horovod.topology import resolve

    topo = resolve("dgx1v:0,1,2,3")
    trees = (
        Tree(0, 0.25, ((0, 1), (1, 2), (2, 3))),
        Tree(1, 0.25, ((1, 3), (3, 0), (0, 2))),
        Tree(2, 0.25, ((2, 0), (0, 1), (2, 3))),
        Tree(3, 0.25, ((3, 2), (2, 1), (3, 0))),
    )
    plan = Plan("allreduce", "dgx1v", (0, 1, 2, 3), None, trees, 50.0, 75.0)
    for kind in ("allreduce", "reduce", "broadcast"):
        prog = compile_program(plan, 2**22, 2**16, kind)
        a = simulate_program(prog, topo, PARAMS, fold_posts=True)
        b = simulate_program(prog, topo, PARAMS, fold_posts=False)
        assert a.time_s == pytest.approx(b.time_s, rel=1e-12), kind
        assert a.rank_finish_s == pytest.approx(b.rank_finish_s, rel=1e-12)
