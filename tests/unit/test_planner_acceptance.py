"""The planner's acceptance sweep, checked by the independent checker (``support.plan_checker``).

Every NVLink-connected allocation of 3..8 GPUs of DGX-1P and DGX-1V (181
each) and 50 seeded random heterogeneous machines, both collectives
(broadcast from the first GPU): every plan valid (arborescences over direct
links or switch routes, fractions summing to 1, allreduce root shares, no
resource over capacity at ``rate_gbps``) and ``rate_gbps >= 0.999 x`` the
checker's own optimum, which the planner's ``optimum_gbps`` must match.
benchmarks/planner_sweep.py prints the same sweep with tree counts and times.
"""

from __future__ import annotations

import pytest
from support.plan_checker import (
    check_plan,
    connected_subsets,
    independent_optimum,
    random_machine,
)

from blink_horovod.planner import make_plan
from blink_horovod.topology import Topology, machine

pytestmark = pytest.mark.timeout(280)


def _allocations(name: str) -> list[Topology]:
    whole = machine(name)
    return [whole.allocate(sub) for sub in connected_subsets(whole.to_dict(), range(3, 9))]


def _check(topo: Topology, collective: str, channels: list[str]) -> int:
    td = topo.to_dict()
    root = topo.gpus[0] if collective == "broadcast" else None
    plan = make_plan(topo, collective, root=root, channels=channels)
    check_plan(plan.to_dict(), td)
    opt = independent_optimum(td, collective, root, channels)
    assert plan.optimum_gbps == pytest.approx(opt, rel=1e-6), topo.name
    assert plan.rate_gbps >= 0.999 * opt, (topo.name, plan.rate_gbps, opt)
    return len(plan.trees)


@pytest.mark.parametrize("collective", ["broadcast", "allreduce"])
@pytest.mark.parametrize("name", ["dgx1p", "dgx1v"])
def test_every_connected_dgx1_allocation(name: str, collective: str) -> None:
    allocations = _allocations(name)
    assert len(allocations) == 181
    counts = {}
    for topo in allocations:
        counts[topo.name] = _check(topo, collective, ["nvlink"])
    if name == "dgx1v" and collective == "broadcast":
        assert counts["dgx1v"] <= 6


@pytest.mark.parametrize("collective", ["broadcast", "allreduce"])
def test_fifty_random_heterogeneous_machines(collective: str) -> None:
    for seed in range(50):
        _check(Topology.from_dict(random_machine(seed)), collective, ["nvlink"])


@pytest.mark.parametrize("collective", ["broadcast", "allreduce"])
def test_hybrid_plans_on_machines_with_pcie(collective: str) -> None:
    topos = [machine("dgx1p"), machine("dgx1v"), machine("hgx-h200")]
    topos += _allocations("dgx1v")[::12]
    topos += [t for t in (Topology.from_dict(random_machine(s)) for s in range(0, 50, 2)) if t.pcie is not None and t.n <= 9]
    for topo in topos:
        _check(topo, collective, ["nvlink", "pcie"])
