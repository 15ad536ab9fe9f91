"""The ``nvidia-smi topo -m`` parser on fixture texts of real machines, and on bad text."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from blink_horovod.errors import TopologyError
from blink_horovod.topology import machine, nvsmi
from blink_horovod.topology.nvsmi import parse_topo_matrix

pytestmark = pytest.mark.timeout(60)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / f"nvsmi_{name}.txt").read_text()


def test_module_doctests_pass() -> None:
    assert doctest.testmod(nvsmi).failed == 0


def test_dgx1v_matrix_gives_the_builtin_dgx1v_links_and_pcie_switch_pairs() -> None:
    topo = parse_topo_matrix(fixture("dgx1v"))
    ref = machine("dgx1v")
    assert topo.gpus == tuple(range(8)) and topo.switches == ()
    assert topo.capacities() == ref.capacities()
    assert topo.link_count(0, 3) == 2 and topo.link_count(0, 1) == 1 and topo.link_count(0, 5) == 0
    # The switch pairs are visible only through the NIC columns (NV# hides PIX).
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.pcie.bandwidth_gbps == 12.0


def test_dgx1p_matrix_with_old_soc_cells_and_20_gbps_links_is_the_builtin_dgx1p() -> None:
    topo = parse_topo_matrix(fixture("dgx1p"), link_gbps=20.0)
    ref = machine("dgx1p")
    assert topo.capacities() == ref.capacities()
    assert topo.pcie == ref.pcie


def test_link_gbps_scales_every_nvlink() -> None:
    topo = parse_topo_matrix(fixture("dgx1v"), link_gbps=30.0)
    assert topo.capacities()[(0, 3)] == 60.0 and topo.capacities()[(0, 1)] == 30.0


def test_dgx_a100_nv12_between_all_pairs_is_one_nvswitch_of_12_links_per_gpu() -> None:
    topo = parse_topo_matrix(fixture("dgxa100"))
    assert topo.switches == ("nvswitch0",)
    assert len(topo.links) == 8
    for g in range(8):
        assert topo.link_count(g, "nvswitch0") == 12
        assert topo.capacities()[(g, "nvswitch0")] == 300.0
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_hgx_h100_nv18_with_ansi_header_and_nic_legend_matches_builtin_hgx_h100() -> None:
    topo = parse_topo_matrix(fixture("hgxh100"), pcie_gbps=50.0)
    ref = machine("hgx-h100")
    assert topo.switches == ref.switches
    assert topo.capacities() == ref.capacities()  # 18 x 25 = 450 GB/s per GPU to the switch
    # Every GPU has its own PCIe switch (with its NIC) on an HGX H100 board.
    assert topo.pcie is not None and topo.pcie.switch_groups == tuple((g,) for g in range(8))
    assert topo.pcie.bandwidth_gbps == 50.0


def test_single_h200_box_is_one_gpu_without_links() -> None:
    topo = parse_topo_matrix(fixture("h200_single"))
    assert topo.gpus == (0,) and topo.links == () and topo.switches == ()
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0,),)


def test_pcie_only_box_groups_pix_pairs() -> None:
    topo = parse_topo_matrix(fixture("pcie4"))
    assert topo.gpus == (0, 1, 2, 3) and topo.links == ()
    assert topo.pcie is not None and topo.pcie.switch_groups == ((0, 1), (2, 3))


def _matrix(n: int, cell) -> str:
    head = "\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\tCPU Affinity\tNUMA Affinity"
    rows = [
        f"GPU{i}\t" + "\t".join(" X " if i == j else cell(i, j) for j in range(n)) + "\t0-7\t0" for i in range(n)
    ]
    return "\n".join([head, *rows]) + "\n"


@pytest.mark.parametrize(
    "n,k,switched",
    [
        (16, 6, True),  # DGX-2: 6 x 15 = 90 > 18
        (8, 12, True),  # DGX A100
        (3, 18, True),  # three GPUs of an HGX H100: 36 > 18
        (4, 6, False),  # 4-GPU HGX H100 board with direct links: 18, not > 18
        (4, 4, False),  # 4-GPU A100 board: 12
        (2, 12, False),  # two bridged GPUs
        (2, 18, False),
    ],
)
def test_switched_fabric_rule(n: int, k: int, switched: bool) -> None:
    topo = parse_topo_matrix(_matrix(n, lambda i, j: f"NV{k}"))
    if switched:
        assert topo.switches == ("nvswitch0",)
        assert all(topo.link_count(g, "nvswitch0") == k for g in range(n))
        assert len(topo.links) == n
    else:
        assert topo.switches == ()
        assert len(topo.links) == n * (n - 1) // 2
        assert all(link.count == k and link.bandwidth_gbps == 25.0 * k for link in topo.links)


def test_unequal_counts_stay_direct_even_when_complete() -> None:
    topo = parse_topo_matrix(_matrix(8, lambda i, j: "NV12" if (i, j) != (0, 1) and (i, j) != (1, 0) else "NV6"))
    assert topo.switches == ()


def test_spaces_crlf_and_missing_legend_are_fine() -> None:
    text = fixture("dgx1v").split("Legend")[0].replace("\n", "\r\n")
    assert parse_topo_matrix(text).capacities() == machine("dgx1v").capacities()


def test_gpu_labels_give_the_ids() -> None:
    text = "\tGPU2\tGPU5\tCPU Affinity\nGPU2\t X \tNV4\t0-3\nGPU5\tNV4\t X \t0-3\n"
    topo = parse_topo_matrix(text)
    assert topo.gpus == (2, 5) and topo.capacities() == {(2, 5): 100.0}


GOOD = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-7\nGPU1\tNV2\t X \t0-7\n"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "no header row"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "line 1"),
        (GOOD.replace("GPU1\tNV2\t X \t0-7", "GPU1\tNV2"), "line 3: expected 2 cells"),
        (GOOD.replace("GPU1\tNV2\t X", "GPU1\tNVX\t X"), "line 3: unknown cell 'NVX'"),
        (GOOD.replace("GPU1\tNV2\t X", "GPU1\tNV3\t X"), "line 3"),  # asymmetric
        (GOOD.replace("GPU1\tNV2\t X", "GPU1\tNV2\tPIX"), "line 3: the diagonal must be X"),
        (GOOD.replace("GPU0\t X \tNV2", "GPU0\t X \tX"), "line 2: X off the diagonal"),
        (GOOD.replace("NV2", "NV0"), "line 2: NVLink count must be positive"),
        (GOOD + "GPU1\tNV2\t X \t0-7\n", "line 4: a second row 'GPU1'"),
        (GOOD.replace("GPU1\tNV2\t X \t0-7\n", ""), "no row GPU1"),
        (GOOD + "junk here\n", "line 4: row 'junk'"),
        ("\tGPU0\tGPU0\tCPU Affinity\nGPU0\t X \t X \t0-7\n", "line 1: duplicate columns"),
    ],
)
def test_bad_text_raises_naming_the_line(text: str, needle: str) -> None:
    with pytest.raises(TopologyError, match="nvidia-smi") as info:
        parse_topo_matrix(text)
    assert needle in str(info.value)


def test_nvlink_to_a_nic_is_rejected() -> None:
    text = "\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\nGPU0\t X \tNV2\tNV1\t0-7\nGPU1\tNV2\t X \tPIX\t0-7\n"
    with pytest.raises(TopologyError, match="line 2: NVLink to NIC column 'mlx5_0'"):
        parse_topo_matrix(text)


@pytest.mark.parametrize("bad", [0.0, -25.0, float("nan"), float("inf")])
def test_bad_link_bandwidth_is_rejected(bad: float) -> None:
    with pytest.raises(TopologyError, match="link_gbps"):
        parse_topo_matrix(GOOD, link_gbps=bad)
