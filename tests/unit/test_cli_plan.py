"""``blink plan`` as a user runs it (``python3 -m blink_horovod plan ...``).

Bad input needs no planner (it is refused before planning); the tests that
make plans run the real planner and skip while ``make_plan`` is not in this
checkout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.cli import assert_bad_input, blink

from blink_horovod.planner.plan import Plan, validate_plan
from blink_horovod.topology import machine, resolve

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).parent / "fixtures"

try:
    from blink_horovod.planner import make_plan  # noqa: F401

    HAS_PLANNER = True
except ImportError:
    HAS_PLANNER = False
needs_planner = pytest.mark.skipif(not HAS_PLANNER, reason="blink_horovod.planner.make_plan is not in this checkout yet")


def _files(tmp_path: Path) -> dict[str, Path]:
    texts = {
        "malformed.json": '{"gpus": [0, 1], "links": [{"src": 0,',
        "unknown-vertex.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": "nvswitch9", "bandwidth_gbps": 25}]}),
        "zero.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 0}]}),
        "negative.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": -25.0}]}),
        "nan.json": '{"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": NaN}]}',
        "dup.json": json.dumps({"gpus": [0, 2, 2], "links": []}),
        "empty.json": json.dumps({"gpus": [], "links": []}),
        "pair.json": json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "count": 2, "bandwidth_gbps": 50.0}]}),
    }
    out = {}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        out[name] = tmp_path / name
    return out


BAD = [
    (["--topology", "nosuch", "--collective", "broadcast"], ["topology", "'nosuch'"]),
    (["--topology", "FILE:malformed.json", "--collective", "allreduce"], ["malformed JSON", "malformed.json"]),
    (["--topology", "FILE:unknown-vertex.json", "--collective", "allreduce"], ["links[0].dst", "'nvswitch9'"]),
    (["--topology", "FILE:zero.json", "--collective", "allreduce"], ["links[0].bandwidth_gbps", "0"]),
    (["--topology", "FILE:negative.json", "--collective", "allreduce"], ["links[0].bandwidth_gbps", "-25"]),
    (["--topology", "FILE:nan.json", "--collective", "broadcast"], ["links[0].bandwidth_gbps", "nan"]),
    (["--topology", "FILE:dup.json", "--collective", "broadcast"], ["gpus", "duplicate", "2"]),
    (["--topology", "FILE:empty.json", "--collective", "broadcast"], ["gpus", "[]"]),
    (["--topology", "/nonexistent-dir/t.json", "--collective", "broadcast"], ["topology", "/nonexistent-dir/t.json"]),
    (["--topology", "dgx1v", "--gpus", "0,1,1", "--collective", "broadcast"], ["gpus", "duplicate", "0,1,1"]),
    (["--topology", "dgx1v", "--gpus", "", "--collective", "broadcast"], ["gpus", "empty"]),
    (["--topology", "dgx1v", "--gpus", "0,1,8", "--collective", "allreduce"], ["gpus", "8"]),
    (["--topology", "dgx1v:0,1", "--gpus", "0,2", "--collective", "allreduce"], ["gpus", "disagrees"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--root", "9"], ["--root", "9"]),
    (["--topology", "dgx1v:0,1,2", "--collective", "broadcast", "--root", "4"], ["--root", "4", "[0, 1, 2]"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--root", "-1"], ["--root", "-1"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--root", "x"], ["--root", "'x'"]),
    (["--topology", "dgx1v", "--collective", "allreduce", "--root", "0"], ["--root", "0"]),
    (["--topology", "dgx1v", "--collective", "scatter"], ["--collective", "'scatter'"]),
    (["--topology", "dgx1v"], ["--collective"]),
    (["--collective", "broadcast"], ["--topology"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--channels", "infiniband"], ["--channels", "'infiniband'"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--channels", "nvlink,nvlink"], ["--channels", "'nvlink,nvlink'"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--channels", ""], ["--channels", "''"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--channels", "nvlink,"], ["--channels", "'nvlink,'"]),
    (["--topology", "cpu", "--collective", "allreduce", "--channels", "nvlink,pcie"], ["--channels", "'cpu'", "pcie"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--output", "/nonexistent-dir/p.json"], ["--output", "/nonexistent-dir/p.json"]),
    (["--topology", "dgx1v", "--collective", "broadcast", "--bogus"], ["--bogus"]),
]


@pytest.mark.parametrize("argv,needles", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_line_naming_field_and_value_exit_2(argv: list[str], needles: list[str], tmp_path: Path) -> None:
    files = _files(tmp_path)
    argv = [str(files[a[5:]]) if a.startswith("FILE:") else a for a in argv]
    assert_bad_input(blink("plan", *argv, cwd=tmp_path), *needles)


@needs_planner
def test_dgx1v_broadcast_plan_is_valid_and_at_the_optimum_then_cached(tmp_path: Path) -> None:
    start = time.perf_counter()
    proc = blink("plan", "--topology", "dgx1v", "--collective", "broadcast", cwd=tmp_path)
    cold = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_json(proc.stdout)
    validate_plan(plan, machine("dgx1v"))
    assert plan.collective == "broadcast" and plan.root == 0 and plan.gpus == tuple(range(8))
    assert plan.rate_gbps >= 0.999 * plan.optimum_gbps
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("blink plan: dgx1v broadcast from GPU 0") and "cache" not in lines[0]
    start = time.perf_counter()
    again = blink("plan", "--topology", "dgx1v", "--collective", "broadcast", cwd=tmp_path)
    warm = time.perf_counter() - start
    assert again.returncode == 0 and again.stdout == proc.stdout
    assert "from the plan cache" in again.stderr
    assert list((tmp_path / "plan-cache").glob("*.json"))
    # The acceptance bar is 5 s on an idle machine; this box is shared, so allow slack here.
    assert cold < 30 and warm < 30, (cold, warm)


@needs_planner
def test_allreduce_plan_of_an_allocation_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = blink("plan", "--topology", "dgx1v", "--gpus", "0,1,4,5", "--collective", "allreduce",
                 "--channels", "nvlink", "--output", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    plan = Plan.from_json(out.read_text())
    validate_plan(plan, resolve("dgx1v:0,1,4,5"))
    assert plan.root is None and plan.gpus == (0, 1, 4, 5) and all(t.channel == "nvlink" for t in plan.trees)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@needs_planner
def test_default_root_is_the_first_gpu_of_the_allocation_and_root_flag_is_kept(tmp_path: Path) -> None:
    first = Plan.from_json(blink("plan", "--topology", "dgx1v:4,5,6,7", "--collective", "broadcast", cwd=tmp_path).stdout)
    assert first.root == 4 and all(t.root == 4 for t in first.trees)
    other = Plan.from_json(
        blink("plan", "--topology", "dgx1v:4,5,6,7", "--collective", "broadcast", "--root", "6", cwd=tmp_path).stdout
    )
    assert other.root == 6 and all(t.root == 6 for t in other.trees)


@needs_planner
def test_plan_from_a_topology_file_made_by_blink_topology_from_nvidia_smi(tmp_path: Path) -> None:
    topo_file = tmp_path / "dgx1p.json"
    made = blink("topology", "--from-nvidia-smi", str(FIXTURES / "nvsmi_dgx1p.txt"), "--link-gbps", "20",
                 "--output", str(topo_file), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    proc = blink("plan", "--topology", str(topo_file), "--collective", "broadcast", "--channels", "nvlink", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_json(proc.stdout)
    assert plan.optimum_gbps == pytest.approx(80.0)  # DGX-1P 8-GPU broadcast
    assert plan.rate_gbps >= 0.999 * 80.0


@needs_planner
def test_pair_file_plans(tmp_path: Path) -> None:
    files = _files(tmp_path)
    proc = blink("plan", "--topology", str(files["pair.json"]), "--collective", "allreduce", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Plan.from_json(proc.stdout).gpus == (0, 1)
