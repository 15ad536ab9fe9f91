"""GPU runtime on a real GPU: N rank processes sharing one device, exact results, O(1) host time, no hangs.

Marked ``gpu``: skipped where CuPy, cuda-bindings or a CUDA device is missing.
Each test starts NRANKS subprocesses of tests/parallel/gpu_rank.py (a real
FileRendezvous, /dev/shm control segments, torch tensors registered for CUDA
IPC, the tree kernel) and checks their JSON lines.  Ranks sharing one GPU need
MPS (spinning kernels of processes are otherwise time-sliced):
benchmarks/gpu_acceptance.sh starts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from blink_horovod.runtime.gpu.device import available

HERE = os.path.dirname(os.path.abspath(__file__))
OK, WHY = available()
pytestmark = [pytest.mark.gpu, pytest.mark.parallel, pytest.mark.skipif(not OK, reason=f"no usable CUDA: {WHY}")]


def run_ranks(n: int, scenario: str, *args: str, timeout: float = 240.0, env: dict | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="blink-gpu-test-") as d:
        e = dict(os.environ, BLINK_TIMEOUT_SECONDS="60")
        e.update(env or {})
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "gpu_rank.py"), d, str(r), str(n), scenario,
                                   *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
                 for r in range(n)]
        outs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"{scenario} on {n} ranks hung (> {timeout} s)")
            line = so.strip().splitlines()[-1] if so.strip() else "{}"
            try:
                outs.append(json.loads(line) | {"rc": p.returncode, "stderr": se[-1500:]})
            except json.JSONDecodeError:
                outs.append({"rc": p.returncode, "stdout": so[-1500:], "stderr": se[-1500:]})
        return outs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 4])
def test_every_dtype_op_and_collective_exact(n: int) -> None:
    for out in run_ranks(n, "dtypes", "1,1031,65537", timeout=500):
        assert out.get("rc") == 0, out
        assert out["wrong"] == {}, out["wrong"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_hierarchical_stages_exact(n: int) -> None:
    for out in run_ranks(n, "stages", "1,1031,65537", timeout=350):
        assert out.get("rc") == 0, out
        assert out["wrong"] == {}, out["wrong"]


@pytest.mark.timeout(400)
def test_back_to_back_mixed_collectives_without_host_sync() -> None:
    for out in run_ranks(4, "loop", "120", timeout=350):
        assert out.get("rc") == 0, out
        assert out["wrong"] == 0


@pytest.mark.timeout(300)
def test_host_time_is_flat_in_the_number_of_chunks() -> None:
    # The acceptance: host time per collective <= 20 us whatever the number of items (chunks) per tree.
    outs = run_ranks(4, "hosttime", "200", timeout=280)
    for out in outs:
        assert out.get("rc") == 0, out
    rows = outs[0]["hosttime"]
    for row in rows:  # one line each, for benchmarks/gpu_summary.py
        phases = "/".join(f"{v:.1f}" for v in row["native_us"]) if row.get("native_us") else "-"
        print(f"HOSTTIME items={row['items']} total_us={row['total_us']:.1f} native_check/post/wait/launch_us={phases}")
    for row in rows:
        assert row["total_us"] <= 20.0, rows


@pytest.mark.timeout(200)
def test_a_killed_rank_fails_the_others_fast_and_leaves_no_shm() -> None:
    before = {f for f in os.listdir("/dev/shm") if f.startswith("blink-")}
    outs = run_ranks(3, "kill", timeout=150, env={"BLINK_TIMEOUT_SECONDS": "30"})
    for out in outs:
        if out.get("rank") == 1 or out.get("rc") == 9:
            continue
        assert out.get("raised") in ("BlinkInternalError", "BlinkTimeoutError"), out
        assert out["seconds"] < 60, out
    time.sleep(0.5)
    after = {f for f in os.listdir("/dev/shm") if f.startswith("blink-")}
    assert after <= before, after - before


@pytest.mark.timeout(200)
def test_a_mismatch_found_on_the_device_names_the_ranks() -> None:
    outs = run_ranks(3, "mismatch", timeout=150, env={"BLINK_TIMEOUT_SECONDS": "30"})
    for out in outs:
        assert out.get("raised") == "MismatchError", out
        assert "name" in out["message"] and "rank 1" in out["message"], out
        assert out["seconds"] < 20, out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("share", ["0.5", "1"])
def test_a_peer_behind_work_that_needs_whole_sms(share: str) -> None:
    # Rank 0's stream holds a kernel that needs a whole SM per block when rank 1 launches.  With half the
    # block slots (what CUDA tensors under Horovod get where ranks share a GPU) the collectives are exact;
    # with the whole grid rank 1's spinning blocks may take every SM first: then the job must end with the
    # device's timeout named on the ranks, never hang.
    outs = run_ranks(2, "behind", timeout=150, env={"BLINK_TIMEOUT_SECONDS": "15", "BLINK_GPU_SM_SHARE": share})
    for out in outs:
        print(f"BEHIND share={share} rank={out.get('rank')} raised={out.get('raised')} "
              f"seconds={out.get('seconds', 0):.2f} wrong={out.get('wrong')} {out.get('message', '')[:200]}")
    for out in outs:
        assert out.get("rc") == 0, out
        if share != "1" or out["raised"] is None:
            assert out["raised"] is None and out["wrong"] == 0, out
        else:
            assert out["raised"] in ("BlinkTimeoutError", "BlinkInternalError"), out
            assert out["seconds"] < 60, out


REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("collective", ["allreduce", "broadcast"])
@pytest.mark.parametrize("n,topology", [(2, "dgx1v:0,1"), (4, "dgx1v:0,1,2,3")])
def test_blink_perf_device_cuda_is_exact(n: int, topology: str, collective: str) -> None:
    """``blink perf --device cuda`` under mpirun (mpi4py ranks, no Horovod): Communicator(device="cuda")
    end to end, plans made by rank 0 (scipy's HiGHS) into a fresh plan cache."""
    import shutil

    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun")
    env = dict(os.environ, BLINK_TOPOLOGY=topology, BLINK_PLAN_CACHE=tempfile.mkdtemp(prefix="blink-plans-"),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", BLINK_TIMEOUT_SECONDS="60")
    forward = [a for v in ("BLINK_TOPOLOGY", "BLINK_PLAN_CACHE", "PYTHONPATH", "BLINK_TIMEOUT_SECONDS",
                           "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY") if v in env for a in ("-x", v)]
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", *forward, "-np", str(n), sys.executable, "-m",
           "blink_horovod", "perf", "--device", "cuda", "--collective", collective, "-b", "4", "-e", "16M", "-f", "4",
           "-c", "1", "-n", "5", "-w", "1", "-d", "float,int32,half,bfloat16"] + (["-o", "all"] if collective == "allreduce" else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=360, check=False)
    print(p.stdout[-6000:])
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "# Out of bounds values : 0 OK" in p.stdout
    assert "[cuda]" in p.stdout
