"""The NVML prober: the pure facts -> topology step, and probing this machine.

``topology_from_facts`` is fed what NVML reports on known machines (written
out as data, port by port); ``probe_local`` runs for real: on a machine
without a GPU it must say so plainly, and on a GPU machine (tests marked
``gpu``) it must agree with NVML's device count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.nvml import (
    BLACKWELL,
    HOPPER,
    HOSTBRIDGE,
    MULTIPLE,
    SINGLE,
    VOLTA,
    bus,
    dgx1v_facts,
    hgx_facts,
)

from blink_horovod.errors import TopologyError
from blink_horovod.topology import machine
from blink_horovod.topology.probe import (
    GpuFacts,
    NvLinkFacts,
    NvmlFacts,
    normalize_bus_id,
    probe_local,
    topology_from_facts,
    visible_gpus,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
def test_dgx1v_facts_give_the_builtin_dgx1v() -> None:
    topo = topology_from_facts(dgx1v_facts())
    ref = machine("dgx1v")
    assert topo.gpus == ref.gpus
    assert topo.capacities() == ref.capacities()
    assert topo.pcie == ref.pcie  # PCIe 3.0 x16 = 12 GB/s, switch pairs from the common ancestor
    assert topo.source == "nvml" and topo.name == "local"


def test_links_to_nvswitches_become_one_switch_vertex_of_the_gpus_port_bandwidth() -> None:
    topo = topology_from_facts(hgx_facts())
    ref = machine("hgx-h200")
    assert topo.switches == ("nvswitch0",)
    assert topo.capacities() == ref.capacities()  # 18 x 25 GB/s per GPU
    assert all(topo.link_count(g, "nvswitch0") == 18 for g in range(8))
    assert topo.pcie is not None and topo.pcie.bandwidth_gbps == 50.0


def test_unknown_remote_device_is_the_switch_and_architecture_beats_a_wrong_version() -> None:
    # Older drivers cannot say the remote type; some report NVLink 5.0 (7) on Hopper.
    topo = topology_from_facts(hgx_facts(remote_type="unknown", version=7))
    assert topo.capacities() == machine("hgx-h100").capacities()


def test_blackwell_links_are_50_gbps_and_unknown_arch_falls_back_to_the_version() -> None:
    assert topology_from_facts(hgx_facts(arch=BLACKWELL, version=7)).capacities()[(0, "nvswitch0")] == 900.0
    assert topology_from_facts(hgx_facts(arch=None, version=7)).capacities()[(0, "nvswitch0")] == 900.0
    assert topology_from_facts(hgx_facts(arch=None, version=1)).capacities()[(0, "nvswitch0")] == 360.0
    assert topology_from_facts(hgx_facts(arch=None, version=None)).capacities()[(0, "nvswitch0")] == 450.0


def test_single_gpu_without_nvlink_is_a_one_gpu_topology() -> None:
    # Our H200 device machine: NVML says NotSupported for every NVLink port.
    facts = NvmlFacts((GpuFacts(0, bus(0), "NVIDIA H200", "GPU-1", (), 5, 16, HOPPER),))
    topo = topology_from_facts(facts)
    assert topo.gpus == (0,) and topo.links == () and topo.switches == ()
    assert topo.pcie is not None and topo.pcie.bandwidth_gbps == 50.0 and topo.pcie.switch_groups == ((0,),)


def test_no_gpus_says_so() -> None:
    with pytest.raises(TopologyError, match=r"^no NVIDIA GPU found \(NVML: 0 devices\)"):
        topology_from_facts(NvmlFacts(()))


def test_cuda_visible_devices_picks_and_renumbers_gpus() -> None:
    facts = dgx1v_facts()
    visible = visible_gpus("4,5,7", facts.gpus)
    assert visible == (4, 5, 7)
    topo = topology_from_facts(NvmlFacts(facts.gpus, facts.common_ancestor, {}, visible))
    ref = machine("dgx1v")
    assert topo.gpus == (0, 1, 2)
    # 4-5 single, 4-7 double, 5-7 single, renumbered 0, 1, 2.
    assert topo.capacities() == {(0, 1): ref.capacities()[(4, 5)], (0, 2): 50.0, (1, 2): 25.0}
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1), (2,))


def test_visible_gpus_follows_cuda_rules() -> None:
    gpus = dgx1v_facts().gpus
    assert visible_gpus(None, gpus) == tuple(range(8))
    assert visible_gpus("3,1", gpus) == (3, 1)
    assert visible_gpus("GPU-00000002", gpus) == (2,)
    assert visible_gpus("0,1,-1,2", gpus) == (0, 1)  # CUDA stops at the first invalid entry
    assert visible_gpus("0,9,2", gpus) == (0,)
    assert visible_gpus("", gpus) == ()
    facts = dgx1v_facts()
    with pytest.raises(TopologyError, match="no NVIDIA GPU found .*CUDA_VISIBLE_DEVICES hides all 8"):
        topology_from_facts(NvmlFacts(facts.gpus, {}, {}, ()))


def test_nvlink_pair_without_p2p_is_dropped() -> None:
    topo = topology_from_facts(dgx1v_facts(p2p_nvlink={(0, 3): False, (0, 1): True}))
    caps = topo.capacities()
    assert (0, 3) not in caps and caps[(0, 1)] == 25.0 and len(caps) == 15


def test_asymmetric_port_counts_use_the_smaller(caplog: pytest.LogCaptureFixture) -> None:
    facts = dgx1v_facts()
    g0 = facts.gpus[0]
    # GPU 0 reports only one of its two links to GPU 3 as up.
    drop = next(i for i, nl in enumerate(g0.nvlinks) if nl.remote_bus_id == bus(3))
    g0 = GpuFacts(g0.index, g0.bus_id, g0.name, g0.uuid, g0.nvlinks[:drop] + g0.nvlinks[drop + 1 :], 3, 16, VOLTA)
    topo = topology_from_facts(NvmlFacts((g0,) + facts.gpus[1:], facts.common_ancestor, {}))
    assert topo.link_count(0, 3) == 1 and topo.capacities()[(0, 3)] == 25.0
    assert "GPU 3 sees 2" in caplog.text


def test_links_to_cpus_and_to_hidden_gpus_are_ignored() -> None:
    gpus = (
        GpuFacts(0, bus(0), nvlinks=(NvLinkFacts(0, bus(1), "gpu", 2), NvLinkFacts(1, "00000000:04:00", "npu", 2),
                                     NvLinkFacts(2, bus(7), "gpu", 2)), arch=VOLTA),
        GpuFacts(1, bus(1), nvlinks=(NvLinkFacts(0, bus(0), "gpu", 2),), arch=VOLTA),
    )
    topo = topology_from_facts(NvmlFacts(gpus))
    assert topo.capacities() == {(0, 1): 25.0} and topo.switches == ()


def test_pcie_bandwidth_is_the_slowest_gpus_generation_and_width() -> None:
    facts = dgx1v_facts()
    slow = GpuFacts(**{**facts.gpus[5].__dict__, "pcie_gen": 3, "pcie_width": 8})
    topo = topology_from_facts(NvmlFacts(facts.gpus[:5] + (slow,) + facts.gpus[6:], facts.common_ancestor, {}))
    assert topo.pcie is not None and topo.pcie.bandwidth_gbps == 6.0


def test_pcie_groups_join_gpus_below_a_chain_of_switches() -> None:
    facts = dgx1v_facts(common_ancestor={(0, 1): SINGLE, (1, 2): MULTIPLE, (2, 3): HOSTBRIDGE})
    topo = topology_from_facts(facts)
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1, 2), (3,), (4,), (5,), (6,), (7,))


@pytest.mark.parametrize(
    "raw,want",
    [("00000000:07:00.0", "00000000:07:00"), (b"0000:07:00.0", "00000000:07:00"), ("0000:B3:00.0\x00", "00000000:b3:00")],
)
def test_bus_ids_normalise(raw, want: str) -> None:
    assert normalize_bus_id(raw) == want


def _has_nvml_gpu() -> bool:
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no library, no driver: no GPU to probe
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


HAS_GPU = _has_nvml_gpu()


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_probe_local_without_a_gpu_says_so_plainly() -> None:
    with pytest.raises(TopologyError, match=r"^no NVIDIA GPU found \(NVML: .+\)$"):
        probe_local()


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_blink_topology_local_without_a_gpu_is_one_line_exit_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "blink_horovod", "topology", "local"], check=False, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("blink: error: no NVIDIA GPU found (NVML: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and NVML")
def test_probe_local_on_a_gpu_machine_agrees_with_nvml() -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    topo = probe_local()
    expect = count if "CUDA_VISIBLE_DEVICES" not in os.environ else len(topo.gpus)
    assert topo.gpus == tuple(range(expect))
    assert topo.pcie is not None and topo.pcie.bandwidth_gbps > 0
    for link in topo.links:
        assert link.kind == "nvlink" and link.bandwidth_gbps >= 20.0 * link.count
    if count == 1:
        assert topo.links == ()
