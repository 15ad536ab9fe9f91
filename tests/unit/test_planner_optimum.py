"""The exact optimum (column generation with a duality certificate) and Blink's MWU packing."""

from __future__ import annotations

import numpy as np
import pytest
from support.plan_checker import independent_optimum, random_machine

from blink_horovod.planner.mwu import mwu_packing
from blink_horovod.planner.network import nvlink_network, pcie_network
from blink_horovod.planner.optimum import optimal_packing
from blink_horovod.topology import Topology, machine, resolve

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "name,collective,expected",
    [
        ("dgx1v", "broadcast", 150.0),
        ("dgx1v", "allreduce", 600.0 / 7),
        ("dgx1p", "broadcast", 80.0),
        ("dgx1p", "allreduce", 320.0 / 7),
        ("hgx-h200", "broadcast", 450.0),
        ("hgx-h200", "allreduce", 8 * 450.0 / 14),  # n * port / (2 (n - 1))
        ("hgx-h100", "allreduce", 8 * 450.0 / 14),
        ("dgx2", "broadcast", 150.0),
        ("dgx2", "allreduce", 16 * 150.0 / 30),
    ],
)
def test_known_optima_are_proven(name: str, collective: str, expected: float) -> None:
    net = nvlink_network(machine(name), collective)
    p = optimal_packing(net)
    assert p.value == pytest.approx(expected, rel=1e-9)
    # the certificate: an upper bound from dual-feasible prices meets the value
    assert p.upper_bound == pytest.approx(expected, rel=1e-8)
    assert p.gap <= 1e-8
    # and the packing itself is feasible
    load = net.load_matrix(p.trees) @ p.x
    assert np.all(load <= net.capacity * (1 + 1e-9))


@pytest.mark.parametrize("collective", ["broadcast", "allreduce"])
def test_pcie_channel_optimum_matches_the_checker(collective: str) -> None:
    for name in ("dgx1v", "pcie", "dgx2"):
        topo = machine(name)
        p = optimal_packing(pcie_network(topo, collective))
        ref = independent_optimum(topo.to_dict(), collective, topo.gpus[0] if collective == "broadcast" else None, ["pcie"])
        assert p.value == pytest.approx(ref, rel=1e-7), name


@pytest.mark.parametrize("seed", [0, 3, 4, 9])
def test_optimum_matches_closed_forms_on_random_machines(seed: int) -> None:
    topo = Topology.from_dict(random_machine(seed))
    for collective in ("broadcast", "allreduce"):
        p = optimal_packing(nvlink_network(topo, collective))
        ref = independent_optimum(topo.to_dict(), collective, topo.gpus[0] if collective == "broadcast" else None, ["nvlink"])
        assert p.value == pytest.approx(ref, rel=1e-7)


def test_closed_forms_agree_with_the_checkers_own_lp() -> None:
    # The checker's max-flow and partition formulas against its own column generation.
    for spec in ("dgx1v:0,1,2,5,6", "dgx1p:0,1,4,5,6", "dgx1v"):
        td = resolve(spec).to_dict()
        for collective, root in (("broadcast", td["gpus"][0]), ("allreduce", None)):
            independent_optimum(td, collective, root, ["nvlink"], cross_check=True)


@pytest.mark.parametrize("name,collective", [("dgx1v", "allreduce"), ("dgx1p", "allreduce"), ("dgx1v:0,1,2,3,4", "broadcast")])
def test_mwu_is_a_feasible_one_minus_eps_packing(name: str, collective: str) -> None:
    net = nvlink_network(resolve(name), collective)
    opt = optimal_packing(net).value
    eps = 0.1
    m = mwu_packing(net, eps)
    assert m.complete
    load = net.load_matrix(m.trees) @ m.x
    assert np.all(load <= net.capacity * (1 + 1e-9))
    # Garg-Koenemann: within (1 - eps)^3 of the optimum
    assert (1 - eps) ** 3 * opt <= m.value <= opt * (1 + 1e-9)


def test_mwu_stopped_early_is_still_feasible() -> None:
    net = nvlink_network(machine("dgx1v"), "broadcast")
    m = mwu_packing(net, 0.05, max_iterations=50)
    assert not m.complete and m.iterations == 50
    assert np.all(net.load_matrix(m.trees) @ m.x <= net.capacity * (1 + 1e-9))


def test_mwu_rejects_a_bad_eps() -> None:
    with pytest.raises(ValueError, match="eps"):
        mwu_packing(nvlink_network(machine("dgx1v"), "broadcast"), 1.5)
