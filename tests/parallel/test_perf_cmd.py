"""``blink perf``: nccl-tests' columns, exact checking, JSON rows, non-zero exit on wrong results.

Ranks are started by the test (``--rendezvous-dir``), or under ``mpirun``
(mpi4py) and ``horovodrun`` when those are installed; every test has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from blink_horovod.cli.perf_cmd import _impls, busbw_factor, size_list
from blink_horovod.errors import ConfigError

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(300)]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VENV = os.path.join(ROOT, ".venv", "bin")


def _env(tmp_path, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, BLINK_PLAN_CACHE=str(tmp_path / "plans"))
    for k in ("BLINK_FAULT", "BLINK_TOPOLOGY", "BLINK_CHUNK_BYTES"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def run_ranks(tmp_path, n: int, args: list[str], extra: dict | None = None, limit: float = 240):
    rdv = str(tmp_path / "rdv")
    procs = [
        subprocess.Popen([sys.executable, "-m", "blink_horovod", "perf", *args, "--rendezvous-dir", rdv,
                          "--rank", str(r), "--nranks", str(n)], env=_env(tmp_path, extra), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    outs = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=limit)
            outs.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def rows_of(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_sizes_and_factors() -> None:
    assert size_list(1024, 64 << 20, 4, None) == [1024 * 4**k for k in range(9)]
    assert size_list(8, 40, 2, 16) == [8, 24, 40]
    assert busbw_factor("allreduce", 4) == 1.5 and busbw_factor("broadcast", 4) == 1.0
    assert busbw_factor("allreduce", 1) == 1.0


def test_impl_lists_and_defaults(monkeypatch) -> None:
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.delenv("HOROVOD_HOSTNAME", raising=False)
    assert _impls(None, "cpu") == ["raw"]  # no Horovod: the communicator alone
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert _impls(None, "cpu") == ["blink"]  # under Horovod: the call users make
    assert _impls(None, "cuda") == ["raw"]
    assert _impls("both", "cpu") == ["blink", "horovod"]
    assert _impls("raw, both,blink", "cpu") == ["raw", "blink", "horovod"]
    with pytest.raises(ConfigError, match="--impl: expected blink, raw, horovod or both"):
        _impls("blink,nccl", "cpu")


def test_every_dtype_and_op_exact_on_three_ranks(tmp_path) -> None:
    js = tmp_path / "out.json"
    outs = run_ranks(tmp_path, 3, ["-b", "4", "-e", "256K", "-f", "64", "-n", "2", "-w", "1", "-c", "1",
                                   "-d", "all", "-o", "all", "--json", str(js)])
    for rc, so, se in outs:
        assert rc == 0, se
    text = outs[0][1]
    # nccl-tests' header and row layout (src/common.cu), to the character.
    assert "#       size         count      type   redop    root     time   algbw   busbw #wrong" in text
    assert "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       " in text
    rows = rows_of(text)
    assert len(rows) == 9 * 5 * 3 - 2 * 5  # 4-byte messages hold no 8-byte element: double, int64 skip it
    assert all(r[-1] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in text
    data = json.loads(js.read_text())
    keys = {"impl", "collective", "size", "count", "type", "time_us", "algbw", "busbw", "wrong"}
    assert data["rows"] and all(keys <= set(r) and r["wrong"] == 0 and r["impl"] == "raw" for r in data["rows"])
    assert {r["type"] for r in data["rows"]} == {"float", "double", "half", "bfloat16", "int32", "int64", "int8",
                                                 "uint8", "int16"}


def test_broadcast_from_a_non_zero_root(tmp_path) -> None:
    outs = run_ranks(tmp_path, 3, ["--collective", "broadcast", "-r", "2", "-b", "1K", "-e", "1M", "-f", "32",
                                   "-n", "2", "-w", "1", "-d", "float,int8"])
    assert all(rc == 0 for rc, _, _ in outs), outs[0][2]
    rows = rows_of(outs[0][1])
    assert rows and all(r[3] == "none" and r[4] == "2" and r[-1] == "0" for r in rows)


def test_corruption_is_counted_and_exit_is_non_zero(tmp_path) -> None:
    """The fault hook flips one bit of a received chunk on rank 1: -c 1 must count it."""
    outs = run_ranks(tmp_path, 3, ["-b", "1M", "-e", "1M", "-n", "1", "-w", "0", "-c", "1"],
                     {"BLINK_FAULT": "corrupt:after=0:rank=1", "BLINK_CHUNK_BYTES": "64K"})
    assert outs[0][0] == 1
    rows = rows_of(outs[0][1])
    assert int(rows[0][-1]) > 0
    assert "FAILED" in outs[0][1]


@pytest.mark.parametrize(
    "args,text",
    [
        (["--collective", "gather"], "--collective: expected allreduce or broadcast, got 'gather'"),
        (["-d", "quad"], "--dtype: unknown dtype 'quad'"),
        (["-o", "mean"], "op: unknown reduction 'mean'"),
        (["--device", "cuda"], "--device: cuda is not usable here"),
        (["-b", "1M", "-e", "1K"], "-e: maxbytes 1024 is below minbytes 1048576"),
        (["-n", "0"], "-n: expected an integer >= 1, got '0'"),
        (["--impl", "nccl"], "--impl: expected blink, raw, horovod or both, got 'nccl'"),
        (["--impl", "blink", "--rendezvous-dir", "d", "--rank", "0", "--nranks", "1"],
         "--impl: blink and horovod need Horovod"),
        (["-b", "lots"], "-b: not a size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, text) -> None:
    p = subprocess.run([sys.executable, "-m", "blink_horovod", "perf", *args], env=_env(tmp_path), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert text in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def _mpirun() -> str | None:
    return shutil.which("mpirun") if os.path.exists(os.path.join(VENV, "python")) else None


@pytest.mark.skipif(_mpirun() is None, reason="needs mpirun and .venv (mpi4py)")
def test_under_mpirun_with_mpi4py(tmp_path) -> None:
    env = _env(tmp_path, {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                          "OMPI_MCA_btl": "self,vader,tcp"})
    p = subprocess.run([_mpirun(), "--oversubscribe", "-np", "3", os.path.join(VENV, "python"), "-m", "blink_horovod",
                        "perf", "-b", "1K", "-e", "1M", "-f", "32", "-n", "2", "-w", "1"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "launcher mpi" in p.stdout and "3 ranks" in p.stdout
    assert all(r[-1] == "0" for r in rows_of(p.stdout))


def _horovodrun() -> str | None:
    path = os.path.join(VENV, "horovodrun")
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(_horovodrun() is None, reason="needs .venv with horovod")
@pytest.mark.parametrize("hosts", ["localhost:2", "localhost:1,127.0.0.1:1"])
def test_under_horovodrun_both_impls(tmp_path, hosts: str) -> None:
    js = tmp_path / "hvd.json"
    p = subprocess.run([_horovodrun(), "-np", "2", "-H", hosts, "--gloo", os.path.join(VENV, "python"), "-m",
                        "blink_horovod", "perf", "--impl", "both", "-b", "1K", "-e", "256K", "-f", "16", "-n", "2",
                        "-w", "1", "-d", "float,int8", "--json", str(js)],
                       env=_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rows = json.loads(js.read_text())["rows"]
    blink = [r for r in rows if r["impl"] == "blink"]
    hvd = [r for r in rows if r["impl"] == "horovod"]
    assert blink and all(r["wrong"] == 0 for r in blink)
    assert [r["wrong"] for r in hvd if r["type"] == "float"] == [0, 0, 0]
    assert all(r["time_us"] is None for r in hvd if r["type"] == "int8")  # stock Horovod rejects int8 tensors
    assert blink[0]["servers"] == (2 if "," in hosts else 1)
