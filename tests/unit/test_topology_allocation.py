"""The topology of the GPUs a server's ranks use (topology/allocation.py), from NVML's facts, without a GPU;
and ``Communicator(device="cuda")``'s probe as its ranks run it, over a file rendezvous, with NVML and the
current device stood in for."""

from __future__ import annotations

import logging
import tempfile

import pytest
from support.nvml import bus, dgx1v_facts, hgx_facts
from support.ranks import run_ranks

from blink_horovod.errors import TopologyError
from blink_horovod.runtime import communicator as cm
from blink_horovod.runtime.rendezvous import FileRendezvous
from blink_horovod.topology import machine
from blink_horovod.topology.allocation import rank_gpus, server_topology
from blink_horovod.topology.probe import NvmlFacts

pytestmark = pytest.mark.timeout(60)


def test_ranks_get_their_gpus_in_local_rank_order() -> None:
    topo, desc = server_topology(hgx_facts(), [bus(5), bus(2), bus(7)])
    assert topo.gpus == (5, 2, 7) and topo.switches
    assert "3 GPUs [5, 2, 7] of 8" in desc and "NVSwitch" in desc


def test_a_dgx1v_allocation_keeps_only_its_links() -> None:
    topo, _ = server_topology(dgx1v_facts(), [bus(g) for g in (0, 1, 2, 3)])
    assert topo.gpus == (0, 1, 2, 3)
    assert topo.capacities("nvlink") == machine("dgx1v").allocate([0, 1, 2, 3]).capacities("nvlink")


def test_bus_ids_in_any_spelling_and_cuda_order_under_visible_devices() -> None:
    facts = hgx_facts()
    spelled = ["0000:15:00.0", "00000000:11:00"]  # NVML's 4- and 8-digit domains, with a function
    assert rank_gpus(facts, spelled) == [5, 1]
    hidden = NvmlFacts(facts.gpus, facts.common_ancestor, facts.p2p_nvlink, visible=(6, 3))
    assert rank_gpus(hidden, [bus(3), bus(6), bus(0)]) == [1, 0, None]


def test_ranks_sharing_a_gpu_get_a_topology_that_says_so() -> None:
    topo, desc = server_topology(hgx_facts(), [bus(0)] * 4)
    assert topo.name == "one-gpu-x4" and topo.n == 4
    assert "4 ranks on 1 GPU" in desc and "share" in desc


def test_without_nvml_or_with_an_unknown_gpu_the_allocation_is_fully_connected() -> None:
    topo, desc = server_topology(None, [bus(0), bus(1)], "no NVIDIA GPU found (NVML: driver not loaded)")
    assert topo.name == "unprobed-x2" and "driver not loaded" in desc
    topo, desc = server_topology(hgx_facts(2), [bus(0), "00000000:99:00"])
    assert topo.name == "unprobed-x2" and "99:00" in desc


@pytest.mark.parametrize("nvml", ["hgx", "none"])
def test_the_communicators_ranks_adopt_rank_0s_probe(monkeypatch, caplog, nvml: str) -> None:
    from blink_horovod.runtime.gpu import device
    from blink_horovod.topology import probe

    n = 3
    rank_bus = {}  # thread -> bus id: each rank's current device

    def current_bus_id() -> str:
        import threading

        return rank_bus[threading.get_ident()]

    def local_facts(visible):
        assert visible is None  # every GPU: ranks may see different CUDA_VISIBLE_DEVICES
        if nvml == "none":
            raise TopologyError("no NVIDIA GPU found (NVML: the pynvml module is not installed)")
        return hgx_facts()

    monkeypatch.setattr(device, "current_bus_id", current_bus_id)
    monkeypatch.setattr(probe, "local_facts", local_facts)
    caplog.set_level(logging.INFO, logger="blink_horovod.runtime")
    with tempfile.TemporaryDirectory() as d:

        def rank(r: int):
            import threading

            rank_bus[threading.get_ident()] = bus((6, 1, 4)[r])
            rdv = FileRendezvous(d, r, n, timeout=30)
            try:
                return cm.probe_server(r, n, rdv)
            finally:
                rdv.close()

        topos = run_ranks(rank, n, timeout=50)
    assert len({t.to_json() for t in topos}) == 1  # every rank adopts rank 0's answer
    if nvml == "hgx":
        assert topos[0].gpus == (6, 1, 4)
        assert any("3 GPUs [6, 1, 4] of 8" in r.message for r in caplog.records)
    else:
        assert topos[0].name == "unprobed-x3"
        assert any(r.levelno == logging.WARNING and "pynvml" in r.message for r in caplog.records)
