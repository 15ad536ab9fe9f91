"""The sweep's parts, the Blink side with hand-built plans, the multi-server model, the progress bar."""

from __future__ import annotations

import io
import itertools
import math

import pytest

from blink_horovod.planner.plan import Plan, Tree
from blink_horovod.sim.blink import (
    RUNTIME_SCHEDULE,
    choose_chunk_bytes,
    predict_time,
    simulate_plan,
)
from blink_horovod.sim.multiserver import hierarchical_allreduce
from blink_horovod.sim.params import DEFAULT_PARAMS, SimParams
from blink_horovod.sim.progress import Progress
from blink_horovod.sim.resources import ResourceMap
from blink_horovod.sim.sweep import compare, geomean, gpu_subsets, nvlink_connected
from blink_horovod.topology import resolve

pytestmark = pytest.mark.timeout(120)

GiB = 2**30


def chain_plan(gpus, gbps):
    edges = tuple(itertools.pairwise(gpus))
    return Plan("broadcast", "custom", tuple(gpus), gpus[0], (Tree(gpus[0], 1.0, edges),), gbps, gbps)


def test_gpu_subsets_and_connectivity():
    topo = resolve("dgx1v")
    subsets = gpu_subsets(topo)
    assert len(subsets) == 219 and subsets[0] == (0, 1, 2) and subsets[-1] == tuple(range(8))
    connected = [s for s in subsets if nvlink_connected(topo.allocate(s))]
    assert len(connected) == 181  # the planner acceptance's count of NVLink-connected allocations
    assert not nvlink_connected(topo.allocate([0, 5, 6]))
    assert nvlink_connected(resolve("dgx2"))


def test_geomean():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert math.isnan(geomean([]))


def test_pcie_routes_cross_the_host_between_switch_groups():
    rmap = ResourceMap(resolve("dgx1v"), DEFAULT_PARAMS)
    same = [rmap.names[r] for r in rmap.route(0, 1, "pcie")]
    other = [rmap.names[r] for r in rmap.route(0, 2, "pcie")]
    assert same == ["pcie 0->sw", "pcie sw->1"]
    assert other == ["pcie 0->sw", "pcie group 0->host", "pcie host->group 1", "pcie sw->2"]


def test_chain_broadcast_is_close_to_its_bound_and_the_estimate_tracks_the_simulation():
    topo = resolve("dgx1v:0,1,2")
    plan = chain_plan([0, 1, 2], 25.0)
    chunk = choose_chunk_bytes(plan, topo, GiB)
    est = simulate_plan(plan, topo, GiB, chunk)
    assert est.bound_s == pytest.approx(GiB / 25e9)
    assert 0 <= est.over_bound < 0.05
    assert predict_time(plan, topo, GiB, chunk) == pytest.approx(est.time_s, rel=0.02)
    # The chosen chunk is within 1% of the best power of two, 256 KiB .. 16 MiB, as simulated.
    best = min(simulate_plan(plan, topo, GiB, 2**k).time_s for k in range(18, 25))
    assert est.time_s <= best * 1.01
    # The runtimes' schedule (one lane, fixed chunks) too, with its own estimate.
    chunk = choose_chunk_bytes(plan, topo, GiB, schedule=RUNTIME_SCHEDULE)
    est = simulate_plan(plan, topo, GiB, chunk, schedule=RUNTIME_SCHEDULE)
    assert 0 <= est.over_bound < 0.05
    assert predict_time(plan, topo, GiB, chunk, schedule=RUNTIME_SCHEDULE) == pytest.approx(est.time_s, rel=0.02)


def test_compare_row_against_nccl_fallback():
    topo = resolve("dgx1v:0,1,4")  # no NVLink ring: NCCL goes over PCIe at 12 GB/s
    plan = Plan("broadcast", "dgx1v", (0, 1, 4), 0, (Tree(0, 1.0, ((0, 1), (0, 4))),), 25.0, 25.0)
    row = compare(topo, "broadcast", GiB, plan=plan)
    assert row.nccl_channel == "pcie"
    assert row.speedup == pytest.approx(row.nccl_s / row.blink_s)
    assert 1.8 < row.speedup < 25.0 / 12.0 + 0.01
    assert row.trees == 1 and row.blink_s >= row.bound_s


def test_hierarchical_allreduce_network_bound_and_link_bound():
    topo = resolve("dgx1v:0,1,4")  # the path 1 - 0 - 4; NCCL has no NVLink ring here
    trees = (
        Tree(0, 1 / 3, ((0, 1), (0, 4))),
        Tree(1, 1 / 3, ((1, 0), (0, 4))),
        Tree(4, 1 / 3, ((4, 0), (0, 1))),
    )
    plan = Plan("allreduce", "dgx1v", (0, 1, 4), None, trees, 25.0, 25.0)
    slow = hierarchical_allreduce(topo, 4, 1.25, GiB, plan=plan)
    fast = hierarchical_allreduce(topo, 4, 100.0, GiB, plan=plan)
    # The network stage moves 2 (M - 1) / M of the buffer through each NIC.
    assert slow.network_s == pytest.approx(1.5 * GiB / 1.25e9, rel=0.01)
    assert slow.blink_s > 10 * (slow.blink_reduce_s + slow.blink_broadcast_s)
    assert fast.blink_s < slow.blink_s / 10
    # With a fast network the servers' own links decide, where Blink's tree beats NCCL's PCIe ring.
    assert fast.speedup_vs_hier > 1.3 > slow.speedup_vs_hier > 0.9


def test_progress_bar_lines_when_not_a_terminal():
    buf = io.StringIO()
    with Progress(20, "x", stream=buf) as bar:
        for i in range(20):
            bar.advance(str(i))
    lines = buf.getvalue().splitlines()
    assert 2 <= len(lines) <= 12
    assert lines[-1].startswith("x [") and "20/20" in lines[-1]
    quiet = io.StringIO()
    with Progress(5, stream=quiet, enabled=False) as bar:
        bar.advance()
    assert quiet.getvalue() == ""


def test_zero_cost_params_give_the_bandwidth_bound_for_a_single_tree():
    topo = resolve("dgx1v:0,1,2")
    plan = chain_plan([0, 1, 2], 25.0)
    est = simulate_plan(plan, topo, GiB, 2**20, SimParams.zero_cost(), schedule=RUNTIME_SCHEDULE)
    chunks = GiB // 2**20
    # 0 -> 1 is one NVLink (25 GB/s), 1 -> 2 two (50 GB/s): the last chunk's second hop takes half as long.
    assert est.time_s == pytest.approx(chunks * 2**20 / 25e9 + 2**20 / 50e9)
    # The simulator's schedule: two lanes share 0 -> 1 and end together at the bound with the last full chunk
    # and the half-size last one, which then cross 1 -> 2 together.
    est = simulate_plan(plan, topo, GiB, 2**20, SimParams.zero_cost())
    assert est.time_s == pytest.approx(chunks * 2**20 / 25e9 + (2**20 + 2**19) / 50e9)


def test_miad_on_the_simulator_walks_from_1mb_and_keeps_the_best():
    from blink_horovod.sim.blink import tune_chunk_miad

    topo = resolve("dgx1v:0,1,2")
    plan = chain_plan([0, 1, 2], 25.0)
    # The runtimes' schedule, where the chunk size matters most (one lane: fixed costs in series).
    best, walk = tune_chunk_miad(plan, topo, 256 * 2**20, schedule=RUNTIME_SCHEDULE)
    assert walk[0][0] == 2**20 and walk[1][0] == 2**21  # 1 MB, then 2x
    assert 3 <= len(walk) <= 12
    assert best.chunk_bytes == max(walk, key=lambda w: w[1])[0]
    assert best.time_s == pytest.approx(256 * 2**20 / (max(w[1] for w in walk) * 1e9))
    # Fixed costs make 1 MB chunks slower than MIAD's pick.
    assert best.time_s < simulate_plan(plan, topo, 256 * 2**20, 2**20, schedule=RUNTIME_SCHEDULE).time_s
