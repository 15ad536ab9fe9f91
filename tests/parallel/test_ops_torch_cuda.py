"""BLINK_ENABLE=1 with CUDA tensors under real Horovod jobs: exact results, nothing handed to stock Horovod.

Skipped where there is no usable GPU (CI); the GPU acceptance (benchmarks/gpu_ops_acceptance.sh)
runs it on the device.  ``-np 2 -H localhost:2`` is one server of two ranks (Blink's tree kernel
alone); ``-np 4 -H localhost:2,127.0.0.1:2 --gloo`` two servers of two, so every allreduce runs the
three stages (the kernel's reduce phase, Horovod across servers, the kernel's broadcast phase).
Ranks sharing one GPU want MPS (the acceptance script starts it).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from support.horovod_jobs import ROOT, WORKERS, job_env, require_horovod, run_job, tail

from blink_horovod.runtime.gpu.device import available

OK, WHY = available()
pytestmark = [pytest.mark.gpu, pytest.mark.parallel, pytest.mark.timeout(900),
              pytest.mark.skipif(not OK, reason=f"no usable CUDA: {WHY}")]


@pytest.mark.parametrize("hosts,servers", [(["-np", "2", "-H", "localhost:2"], 1),
                                           (["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo"], 2)])
def test_cuda_tensors_exact_and_carried(tmp_path, hosts: list[str], servers: int) -> None:
    require_horovod()
    env = job_env({"EXPECT_SERVERS": str(servers)}, tmp=tmp_path)
    p = run_job([*hosts, sys.executable, str(WORKERS / "torch_cuda_exact.py")], env, timeout=600)
    ranks = {int(r): json.loads(s) for r, s in re.findall(r"RANK (\d+) CUDA (\{.*\})", p.stdout)}
    n = int(hosts[1])
    assert len(ranks) == n, tail(p)
    for r, out in sorted(ranks.items()):
        assert out["wrong"] == {}, (r, out["wrong"])
        assert out["stats"]["fallback"] == 0 and out["stats"]["allreduce"] > 100, (r, out["stats"])
    assert p.returncode == 0, tail(p)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_whose_gradients_overlap_the_backward_pass_does_not_stall(tmp_path, dtype: str) -> None:
    """DistributedOptimizer on 103 M parameters (411 MB of float32 gradients, the step-time benchmark's
    model), allreduced while the backward pass still runs on both ranks, in buffers and sizes first seen
    mid-training.  A tree kernel spins on its peer's flags, so a rank that waited for the device between
    agreeing and launching (a kernel's lazy load, a peer's IPC mapping, a free, a work table's upload:
    the last seen on an H100 with this model in float32) stalled here until the timeout; now the steps
    end."""
    require_horovod()
    env = job_env({"BLINK_TIMEOUT_SECONDS": "20"}, tmp=tmp_path)
    p = run_job(["-np", "2", "-H", "localhost:2", sys.executable, str(ROOT / "benchmarks" / "gpu_step_time.py"),
                 "--dtype", dtype, "--steps", "3", "--warmup", "1",
                 "--dump-after", "15"], env, timeout=300)
    step = [json.loads(s) for s in re.findall(r"STEP (\{.*\})", p.stdout)]
    assert step and "error" not in step[0] and step[0]["blink"], tail(p)
    assert p.returncode == 0, tail(p)
