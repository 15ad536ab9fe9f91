"""``blink simulate``: bad input is one stderr line and exit 2; good input gives the table, JSON and PNG."""

from __future__ import annotations

import json

import pytest

from blink_horovod.cli import main

pytestmark = pytest.mark.timeout(300)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse errors
        rc = int(exc.code)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert out == ""
    assert len(lines) == 1, lines
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


BASE = ("simulate", "--topology", "dgx1v", "--collective", "allreduce", "--no-progress")


@pytest.mark.parametrize(
    "extra, needles",
    [
        (("--size", "banana"), ("--size", "banana")),
        (("--size", "0"), ("--size",)),
        (("--size", "1G", "-b", "1K", "-e", "1M"), ("--size", "-b")),
        (("-b", "1M", "-e", "1K"), ("-e", "1K")),
        (("-b", "1K"), ("-e",)),
        (("-b", "1K", "-e", "1M", "-f", "1"), ("-f", "1")),
        (("-b", "1K", "-e", "1M", "-f", "x"), ("-f", "x")),
        (("--allocations", "0,1,99"), ("--allocations", "99")),
        (("--allocations", "0,0,1"), ("--allocations", "duplicate")),
        (("--allocations", "0"), ("--allocations", "at least 2")),
        (("--allocations", ""), ("--allocations",)),
        (("--channels", "infiniband"), ("--channels", "infiniband")),
        (("--chunk", "2"), ("--chunk",)),
        (("--jobs", "0"), ("--jobs",)),
        (("--plot", "out.txt"), ("--plot", "out.txt")),
        (("--json", "/no/such/folder/x.json"), ("--json", "/no/such/folder")),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, extra, needles):
    rc, out, err = run_cli(capsys, *BASE, *extra)
    assert_one_line_error(rc, out, err, *needles)


def test_bad_topology_and_collective(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "simulate", "--topology", "dgx9", "--collective", "allreduce")
    assert_one_line_error(rc, out, err, "dgx9")
    rc, out, err = run_cli(capsys, "simulate", "--topology", "dgx1v", "--collective", "gather")
    assert_one_line_error(rc, out, err, "--collective", "gather")
    bad = tmp_path / "t.json"
    bad.write_text('{"gpus": [0, 1], "links": [{"src": 0, "dst": 7, "bandwidth_gbps": 25}]}')
    rc, out, err = run_cli(capsys, "simulate", "--topology", str(bad), "--collective", "allreduce")
    assert_one_line_error(rc, out, err, "links[0].dst")
    rc, out, err = run_cli(capsys, "simulate", "--topology", "pcie1", "--collective", "allreduce")
    assert_one_line_error(rc, out, err, "--topology")


def test_pcie_channel_on_a_topology_without_pcie(capsys, tmp_path):
    topo = tmp_path / "t.json"
    topo.write_text('{"gpus": [0, 1, 2], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 25}, {"src": 1, "dst": 2, "bandwidth_gbps": 25}]}')
    rc, out, err = run_cli(capsys, "simulate", "--topology", str(topo), "--collective", "broadcast", "--channels", "nvlink,pcie")
    assert_one_line_error(rc, out, err, "--channels", "pcie")


needs_planner = pytest.mark.skipif(
    not hasattr(__import__("blink_horovod.planner", fromlist=["x"]), "make_plan"), reason="make_plan not landed yet"
)


@needs_planner
def test_simulate_writes_table_json_and_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_PLAN_CACHE", str(tmp_path / "cache"))
    js, png = tmp_path / "rows.json", tmp_path / "speedup.png"
    rc, out, err = run_cli(
        capsys, "simulate", "--topology", "dgx1v", "--allocations", "0,1,2;0,1,4,5;0,1,4", "--collective", "both",
        "--size", "64M", "--channels", "nvlink", "--json", str(js), "--plot", str(png),
    )
    assert rc == 0, err
    assert "geomean speedup" in out
    data = json.loads(js.read_text())
    assert set(data) >= {"rows", "geomean_speedup"}
    assert len(data["rows"]) == 6
    for row in data["rows"]:
        assert set(row) >= {"gpus", "collective", "size_bytes", "blink_s", "nccl_s", "speedup", "trees"}
        assert row["size_bytes"] == 64 * 2**20
        assert row["speedup"] == pytest.approx(row["nccl_s"] / row["blink_s"])
        assert row["blink_s"] >= row["bound_s"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_planner
def test_nvlink_only_skips_disconnected_allocations_with_a_note(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BLINK_PLAN_CACHE", str(tmp_path / "cache"))
    rc, out, err = run_cli(
        capsys, "simulate", "--topology", "dgx1v", "--allocations", "0,1,2;0,5,6", "--collective", "broadcast",
        "--size", "16M", "--channels", "nvlink", "--json", "-", "--no-progress",
    )
    assert rc == 0, err
    data = json.loads(out)
    assert [r["gpus"] for r in data["rows"]] == [[0, 1, 2]]
    assert "note" in err and "0,5,6" in err
