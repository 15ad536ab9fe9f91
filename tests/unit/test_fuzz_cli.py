"""Fuzzing of the ``blink plan`` and ``blink topology`` command lines.

Reliability requirement ("Bad input") and docs/formats.md, Commands: for bad input the CLI prints
ONE line on stderr naming the field and the value and exits 2, never a
traceback.  Random argument vectors (good and bad values of every flag,
fuzzed topology files, unwritable ``--output`` paths, junk positionals) go
through :func:`blink_horovod.cli.main` in this process, so hypothesis can
shrink a failure; a handful of fixed bad inputs also go through the real
``python3 -m blink_horovod`` to prove no traceback reaches a user's terminal.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blink_horovod.cli import main

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
FUZZ = settings(
    max_examples=int(os.environ.get("BLINK_FUZZ_CLI_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """``blink ARGV`` in this process: (exit code, stdout, stderr); other exceptions propagate."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse errors and explicit exits
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return rc, out.getvalue(), err.getvalue()


def assert_clean_outcome(argv: list[str], rc: int, stdout: str, stderr: str) -> None:
    """Good input: exit 0 and JSON (on stdout or in --output); bad input: exit 2, one stderr line."""
    assert "Traceback" not in stderr and "Traceback" not in stdout, (argv, stderr)
    event(f"exit {rc}")  # --hypothesis-show-statistics: how many inputs were good
    if rc == 0:
        if "--output" not in argv:
            json.loads(stdout)
        return
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, f"blink {argv!r}: exit {rc}, stderr {stderr!r}"
    assert len(lines) == 1, f"blink {argv!r}: expected one stderr line, got {lines!r}"


# -- argument strategies ---------------------------------------------------------------

_tmp = tempfile.mkdtemp(prefix="blink-fuzz-cli-")
atexit.register(shutil.rmtree, _tmp, True)  # fuzzed files and outputs go with the test process

topology_texts = st.one_of(
    st.sampled_from(
        [
            json.dumps({"gpus": [0, 1, 2], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": 25.0},
                                                   {"src": 1, "dst": 2, "bandwidth_gbps": 25.0}]}),
            json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 7, "bandwidth_gbps": 25.0}]}),
            json.dumps({"gpus": [0, 1], "links": [{"src": 0, "dst": 1, "bandwidth_gbps": -1}]}),
            json.dumps({"gpus": [], "links": []}),
            json.dumps({"gpus": [0, 1], "links": []}),  # no NVLink at all: no tree can be planned
            json.dumps({"format": "blink-topology/9", "gpus": [0]}),
            "[" * 50000,
            "{not json",
            "",
        ]
    ),
    st.text(max_size=40),
)


@st.composite
def topology_file(draw: st.DrawFn) -> str:
    content = draw(st.one_of(topology_texts.map(str.encode), st.binary(max_size=40)))
    fd, path = tempfile.mkstemp(dir=_tmp, suffix=".json")
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return path


topology_specs = st.one_of(
    st.sampled_from(["cpu3", "pcie4", "dgx1v:0,1,4,5", "dgx1p", "dgx1v:0,1,9", "dgx1v:0,0", "nosuch", "cpu0",
                     "cpu99999999", "", ":", "dgx1v:", "/nonexistent/t.json", "/", "a" * 300]),
    topology_file(),
    st.text(max_size=20),
)
gpu_lists = st.one_of(
    st.sampled_from(["0,1", "0,1,4,5", "0,1,9", "1,1", "", ",", "x", "-1", "0,", "9" * 5000]),
    st.text(max_size=10),
)
collectives = st.one_of(st.sampled_from(["allreduce", "broadcast", "reduce", "ALLREDUCE", ""]), st.text(max_size=8))
roots = st.one_of(st.sampled_from(["0", "1", "5", "-1", "x", "1.5", "", "9" * 5000]), st.text(max_size=6))
channel_lists = st.one_of(st.sampled_from(["nvlink", "nvlink,pcie", "pcie", "pcie,nvlink", "nvlink,nvlink", "", "infiniband"]), st.text(max_size=10))
outputs = st.sampled_from(["fresh", "/proc/blink-no/x.json", "/nonexistent-dir/plan.json", _tmp])
junk = st.sampled_from(["--bogus", "-z", "extra", "--topology", "--gpus", "--", "=", "--root=", "\x00"])


def _output_path(choice: str) -> str:
    return tempfile.mktemp(dir=_tmp, suffix=".json") if choice == "fresh" else choice


def _perturb(draw: st.DrawFn, flags: dict[str, str | None], bad: dict[str, st.SearchStrategy]) -> list[str]:
    """A valid flag set with 0-2 flags replaced by fuzzed values or dropped, maybe a junk word."""
    for _ in range(draw(st.integers(0, 2))):
        flag = draw(st.sampled_from(sorted(bad)))
        flags[flag] = None if draw(st.integers(0, 4)) == 0 else draw(bad[flag])
    argv = [word for flag, value in flags.items() if value is not None for word in (flag, value)]
    if draw(st.integers(0, 4)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(junk))
    return argv


GOOD_TOPOLOGIES = ["cpu3", "pcie4", "dgx1v:0,1,4,5", "dgx1p"]


@st.composite
def plan_argv(draw: st.DrawFn) -> list[str]:
    collective = draw(st.sampled_from(["allreduce", "broadcast"]))
    flags: dict[str, str | None] = {
        "--topology": draw(st.sampled_from(GOOD_TOPOLOGIES)),
        "--collective": collective,
        "--root": draw(st.sampled_from([None, "0"])) if collective == "broadcast" else None,
        "--channels": draw(st.sampled_from([None, "nvlink", "nvlink,pcie"])),
        "--gpus": None,
        "--output": draw(st.sampled_from([None, None, _output_path("fresh")])),
    }
    bad = {
        "--topology": topology_specs, "--collective": collectives, "--root": roots,
        "--channels": channel_lists, "--gpus": gpu_lists, "--output": outputs.map(_output_path),
    }
    return ["plan", *_perturb(draw, flags, bad)]


@st.composite
def topology_argv(draw: st.DrawFn) -> list[str]:
    if draw(st.integers(0, 3)) == 0:
        flags: dict[str, str | None] = {
            "--from-nvidia-smi": draw(st.one_of(topology_file(), st.sampled_from(["/nonexistent", "/", ""]))),
            "--link-gbps": draw(st.sampled_from([None, "25"])),
            "--gpus": None,
            "--output": None,
        }
        bad = {
            "--link-gbps": st.one_of(st.sampled_from(["25", "0", "-3", "nan", "inf", "x", ""]), st.text(max_size=5)),
            "--gpus": gpu_lists, "--output": outputs.map(_output_path),
        }
        return ["topology", *_perturb(draw, flags, bad)]
    spec = draw(st.one_of(st.sampled_from(GOOD_TOPOLOGIES), topology_specs))
    flags = {"--gpus": None, "--output": draw(st.sampled_from([None, None, _output_path("fresh")]))}
    bad = {"--gpus": gpu_lists, "--output": outputs.map(_output_path)}
    positional = [spec] if not spec.startswith("-") else ["--", spec]
    return ["topology", *_perturb(draw, flags, bad), *positional]


# -- properties ---------------------------------------------------------------------------


@FUZZ
@given(plan_argv())
def test_blink_plan_fuzzed_arguments_exit_0_or_2_with_one_line(argv: list[str]) -> None:
    rc, out, err = run_in_process(argv)
    assert_clean_outcome(argv, rc, out, err)


@FUZZ
@given(topology_argv())
def test_blink_topology_fuzzed_arguments_exit_0_or_2_with_one_line(argv: list[str]) -> None:
    rc, out, err = run_in_process(argv)
    assert_clean_outcome(argv, rc, out, err)


# -- the real command, in a fresh interpreter ----------------------------------------------------

BAD_COMMAND_LINES = [
    ["plan", "--topology", "nosuch", "--collective", "allreduce"],
    ["plan", "--topology", "dgx1v:0,1,9", "--collective", "allreduce"],
    ["plan", "--topology", "dgx1v", "--collective", "scatter"],
    ["plan", "--topology", "dgx1v", "--collective", "broadcast", "--root", "9"],
    ["plan", "--topology", "dgx1v", "--collective", "allreduce", "--channels", "infiniband"],
    ["plan", "--topology", "BINARY_FILE", "--collective", "allreduce"],
    ["plan", "--topology", "dgx1v", "--collective", "allreduce", "--output", "/nonexistent-dir/plan.json"],
    ["topology", "nosuch"],
    ["topology", "dgx1v", "--gpus", "0,0"],
    ["topology", "BINARY_FILE"],
    ["topology", "--from-nvidia-smi", "/nonexistent"],
    # control characters in a quoted value must not break the one-line contract (found by fuzzing)
    ["plan", "--topology", "cpu3", "--collective", "allreduce", "extra", "\r0"],
    ["topology", "no\nsuch\x1b[2J"],
]


@pytest.mark.parametrize("argv", BAD_COMMAND_LINES, ids=lambda a: " ".join(a)[:60])
def test_python_m_blink_horovod_bad_input_is_one_line_exit_2(argv: list[str], tmp_path: Path) -> None:
    binary = tmp_path / "topo.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    argv = [str(binary) if a == "BINARY_FILE" else a for a in argv]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "blink_horovod", *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, lines
    assert proc.stdout == ""
