"""BLINK_ENABLE=1 under real Horovod jobs: exact results on two servers, over Gloo and over MPI.

``-H localhost:2,127.0.0.1:2 --gloo`` gives two "servers" of two ranks (local
size 2, cross size 2), so every allreduce runs all three stages (Blink's trees
in each server, Horovod's ring across).  Under ``--mpi`` on one host Horovod
sees one server of four; ``BLINK_LOCAL_SIZE=2`` makes it two.
"""

from __future__ import annotations

import json
import re

import pytest
from support.horovod_jobs import WORKERS, job_env, require_horovod, run_job, tail

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(900)]


def check_ranks(p, n: int) -> list[dict]:
    oks = re.findall(r"RANK (\d+) OK (\{.*?\})", p.stdout)
    assert p.returncode == 0 and len(oks) == n, tail(p)
    return [json.loads(s) for _, s in oks]


def test_exact_results_two_servers_gloo(tmp_path) -> None:
    require_horovod()
    p = run_job(["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", "python",
                 str(WORKERS / "torch_exact.py")], job_env(tmp=tmp_path))
    for st in check_ranks(p, 4):
        assert st["allreduce"] > 50 and st["fallback"] >= 1  # allgather_object goes to stock Horovod


def test_exact_results_two_servers_mpi_with_blink_local_size(tmp_path) -> None:
    require_horovod()
    env = job_env({"BLINK_LOCAL_SIZE": "2"}, tmp=tmp_path)
    p = run_job(["-np", "4", "-H", "localhost:4", "--mpi", "--mpi-args=--oversubscribe", "python",
                 str(WORKERS / "torch_exact.py")], env)
    check_ranks(p, 4)
