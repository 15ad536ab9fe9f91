"""The NCCL baseline: ring search over NVLink, PCIe fallback, cost model."""

from __future__ import annotations

import itertools

import pytest

from blink_horovod.sim.nccl import (
    dbt_depth,
    hamiltonian_cycles,
    nccl_estimate,
    nccl_rings,
    nvlink_rings,
)
from blink_horovod.sim.params import DEFAULT_PARAMS
from blink_horovod.sim.resources import ResourceMap
from blink_horovod.topology import resolve

pytestmark = pytest.mark.timeout(120)

GiB = 2**30


def check_rings(topo, rs):
    """Every ring is a Hamiltonian cycle over NVLink, and no link direction carries more rings than links."""
    rmap = ResourceMap(topo, DEFAULT_PARAMS)
    load: dict[int, int] = {}
    for ring in rs.rings:
        assert sorted(ring) == sorted(topo.gpus)
        for k in range(len(ring)):
            u, v = ring[k], ring[(k + 1) % len(ring)]
            assert rmap.nvlink_connected(u, v)
            for r in rmap.route(u, v, "nvlink"):
                load[r] = load.get(r, 0) + 1
    for r, k in load.items():
        assert k * rs.speed_gbps <= rmap.capacity[r] / 1e9 + 1e-9, rmap.names[r]


def test_hamiltonian_cycles_of_a_triangle_and_a_path():
    assert sorted(hamiltonian_cycles([0, 1, 2], lambda u, v: True)) == [(0, 1, 2), (0, 2, 1)]
    path = {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert hamiltonian_cycles([0, 1, 2], lambda u, v: (u, v) in path) == []


def test_dgx1v_full_machine_gets_six_rings_one_per_nvlink():
    topo = resolve("dgx1v")
    rs = nccl_rings(topo)
    assert rs.channel == "nvlink"
    assert rs.nchannels == 6 and rs.speed_gbps == 25.0 and rs.total_gbps == 150.0
    check_rings(topo, rs)


def test_fully_connected_quad_uses_every_link():
    topo = resolve("dgx1v:0,1,2,3")
    rs = nccl_rings(topo)
    # Each GPU has 4 NVLinks into the quad: 4 rings of 25 GB/s.
    assert (rs.channel, rs.nchannels, rs.total_gbps) == ("nvlink", 4, 100.0)
    check_rings(topo, rs)


def test_ring_drops_links_it_cannot_use():
    # 0-3 and 0-4 and 4-7 are double links, 3-7 single: the square's rings are
    # limited by 3-7 in each direction, so one of each double link is unused.
    topo = resolve("dgx1v:0,3,4,7")
    rs = nccl_rings(topo)
    assert (rs.nchannels, rs.total_gbps) == (2, 50.0)
    check_rings(topo, rs)


def test_no_nvlink_ring_falls_back_to_pcie():
    topo = resolve("dgx1v:0,1,4")  # 1 and 4 share no NVLink: a path, not a ring
    assert nvlink_rings(topo) is None
    rs = nccl_rings(topo)
    assert rs.channel == "pcie" and rs.speed_gbps == 12.0 and rs.rings == ((0, 1, 4),)


def test_dgx1v_ring_counts_over_all_allocations():
    topo = resolve("dgx1v")
    counts = {}
    for k in range(3, 9):
        for g in itertools.combinations(range(8), k):
            a = topo.allocate(g)
            rs = nccl_rings(a)
            if rs.channel == "nvlink":
                check_rings(a, rs)
            counts[rs.channel] = counts.get(rs.channel, 0) + 1
    # Most fragmented allocations have no NVLink ring (Blink, section 1).
    assert counts["pcie"] > counts["nvlink"] > 0


def test_switched_machine_rings_cross_the_switch():
    topo = resolve("dgx2")
    rs = nccl_rings(topo)
    assert rs.channel == "nvlink" and rs.total_gbps == 150.0 and rs.nchannels == 6
    check_rings(topo, rs)


def test_cost_model_large_messages_are_bandwidth_bound():
    topo = resolve("dgx1v")
    est = nccl_estimate(topo, "allreduce", GiB)
    assert est.algorithm == "ring" and est.protocol == "Simple"
    # Ring allreduce: 2 (n - 1) / n of the data over 150 GB/s of rings.
    assert est.algbw_gbps == pytest.approx(150.0 * 8 / 14)
    assert est.time_s == pytest.approx(est.latency_s + GiB / (150e9 * 8 / 14))
    bc = nccl_estimate(topo, "broadcast", GiB)
    assert bc.algbw_gbps == pytest.approx(150.0)


def test_cost_model_small_messages_use_low_latency_protocols():
    topo = resolve("dgx2")
    est = nccl_estimate(topo, "allreduce", 8)
    assert est.protocol == "LL"
    # NCCL's table: ring LL base 3.6 us + 2 (n - 1) x 0.47 us per NVLink hop.
    assert est.latency_s == pytest.approx((3.6 + 30 * 0.47) * 1e-6)


def test_pcie_fallback_is_slower_than_nvlink_rings():
    a = nccl_estimate(resolve("dgx1v:0,1,4"), "allreduce", GiB)
    b = nccl_estimate(resolve("dgx1v:0,1,2"), "allreduce", GiB)
    assert a.time_s > 3 * b.time_s


def test_double_binary_tree_depth():
    assert [dbt_depth(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 1, 2, 2, 3, 3, 4]
