"""``blink topology`` as a user runs it (``python3 -m blink_horovod topology ...``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import assert_bad_input, blink

from blink_horovod.topology import Topology, machine
from blink_horovod.topology.nvsmi import parse_topo_matrix

pytestmark = pytest.mark.timeout(120)

FIXTURES = Path(__file__).parent / "fixtures"


def test_builtin_machine_is_printed_as_blink_topology_json(tmp_path: Path) -> None:
    proc = blink("topology", "dgx1v", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    data = json.loads(proc.stdout)
    assert data["format"] == "blink-topology/1" and data == machine("dgx1v").to_dict()


def test_allocation_by_flag_and_by_name_agree(tmp_path: Path) -> None:
    by_flag = json.loads(blink("topology", "dgx1v", "--gpus", "0,1,4,5", cwd=tmp_path).stdout)
    by_name = json.loads(blink("topology", "dgx1v:0,1,4,5", cwd=tmp_path).stdout)
    assert by_flag == by_name == machine("dgx1v").allocate([0, 1, 4, 5]).to_dict()


def test_output_file_is_written_and_stdout_stays_empty(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    proc = blink("topology", "hgx-h200", "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == ""
    assert Topology.from_json(out.read_text()) == machine("hgx-h200")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_topology_file_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "mine.json"
    src.write_text(machine("dgx1p").to_json())
    proc = blink("topology", str(src), cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout) == machine("dgx1p").to_dict()


def test_from_nvidia_smi_file_matches_the_parser(tmp_path: Path) -> None:
    path = FIXTURES / "nvsmi_dgx1v.txt"
    proc = blink("topology", "--from-nvidia-smi", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    topo = Topology.from_json(proc.stdout)
    assert topo.name == "nvsmi_dgx1v"
    assert topo == parse_topo_matrix(path.read_text(), name="nvsmi_dgx1v")
    assert topo.capacities() == machine("dgx1v").capacities()


def test_from_nvidia_smi_stdin_with_link_and_pcie_gbps(tmp_path: Path) -> None:
    text = (FIXTURES / "nvsmi_dgx1p.txt").read_text()
    proc = blink("topology", "--from-nvidia-smi", "-", "--link-gbps", "20", "--pcie-gbps", "10", cwd=tmp_path, stdin=text)
    assert proc.returncode == 0, proc.stderr
    topo = Topology.from_json(proc.stdout)
    assert topo.capacities() == machine("dgx1p").capacities()
    assert topo.pcie is not None and topo.pcie.bandwidth_gbps == 10.0 and topo.name == "nvidia-smi"


def test_from_nvidia_smi_switched_box(tmp_path: Path) -> None:
    proc = blink("topology", "--from-nvidia-smi", str(FIXTURES / "nvsmi_dgxa100.txt"), "--gpus", "0,2,5", cwd=tmp_path)
    topo = Topology.from_json(proc.stdout)
    assert topo.gpus == (0, 2, 5) and topo.switches == ("nvswitch0",)
    assert all(topo.capacities()[(g, "nvswitch0")] == 300.0 for g in topo.gpus)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    texts = {
        "malformed.json": '{"gpus": [0, 1], "links": [',
        "unknown-vertex.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 7, "bandwidth_gbps": 25}]}),
        "zero.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 0}]}),
        "negative.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": -5}]}),
        "nan.json": '{"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": NaN}]}',
        "dup.json": json.dumps({"gpus": [0, 1, 1], "links": []}),
        "empty.json": json.dumps({"gpus": [], "links": []}),
        "bad.txt": "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-7\nGPU1\tNVX\t X \t0-7\n",
    }
    out = {}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        out[name] = tmp_path / name
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    out["binary.json"] = tmp_path / "binary.json"
    return out


BAD = [
    (["nosuch"], ["topology", "'nosuch'"]),
    ([], ["topology", "NAME"]),
    (["dgx1v", "--gpus", "0,0"], ["gpus", "duplicate", "0,0"]),
    (["dgx1v", "--gpus", ""], ["gpus", "empty"]),
    (["dgx1v", "--gpus", "0,12"], ["gpus", "12"]),
    (["dgx1v:0,1,x"], ["topology", "'x'"]),
    (["FILE:malformed.json"], ["malformed JSON", "line 1"]),
    (["FILE:unknown-vertex.json"], ["links[0].dst", "7"]),
    (["FILE:zero.json"], ["links[0].bandwidth_gbps", "0"]),
    (["FILE:negative.json"], ["links[0].bandwidth_gbps", "-5"]),
    (["FILE:nan.json"], ["links[0].bandwidth_gbps", "nan"]),
    (["FILE:dup.json"], ["gpus", "duplicate", "1"]),
    (["FILE:empty.json"], ["gpus", "[]"]),
    (["FILE:binary.json"], ["binary.json"]),
    (["dgx1v", "--output", "/nonexistent-dir/t.json"], ["--output", "/nonexistent-dir/t.json"]),
    (["dgx1v", "--link-gbps", "20"], ["--link-gbps", "--from-nvidia-smi"]),
    (["dgx1v", "--from-nvidia-smi", "FILE:bad.txt"], ["--from-nvidia-smi", "dgx1v"]),
    (["--from-nvidia-smi", "/nonexistent-dir/topo.txt"], ["--from-nvidia-smi", "/nonexistent-dir/topo.txt"]),
    (["--from-nvidia-smi", "FILE:bad.txt"], ["nvidia-smi line 3", "'NVX'"]),
    (["--from-nvidia-smi", "FILE:malformed.json"], ["nvidia-smi", "line 1"]),
    (["--from-nvidia-smi", "FILE:bad.txt", "--link-gbps", "0"], ["--link-gbps", "'0'"]),
    (["--from-nvidia-smi", "FILE:bad.txt", "--link-gbps", "-25"], ["--link-gbps", "'-25'"]),
    (["--from-nvidia-smi", "FILE:bad.txt", "--link-gbps", "nan"], ["--link-gbps", "'nan'"]),
    (["--from-nvidia-smi", "FILE:bad.txt", "--link-gbps", "fast"], ["--link-gbps", "'fast'"]),
    (["--from-nvidia-smi", "FILE:bad.txt", "--pcie-gbps", "inf"], ["--pcie-gbps", "'inf'"]),
]


@pytest.mark.parametrize("argv,needles", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_line_naming_field_and_value_exit_2(argv: list[str], needles: list[str], tmp_path: Path) -> None:
    files = _bad_files(tmp_path)
    argv = [str(files[a[5:]]) if a.startswith("FILE:") else a for a in argv]
    assert_bad_input(blink("topology", *argv, cwd=tmp_path), *needles)
