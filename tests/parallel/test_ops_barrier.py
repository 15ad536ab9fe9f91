"""``hvd.barrier()`` under BLINK_ENABLE=1: no rank leaves before every rank has seen the barrier's round.

Regression test of Horovod 0.28.1's test_global_barrier_op, which failed
under Blink at -np 4 on a loaded machine (stock passed): Blink's barrier
let each rank go as soon as it saw the round that decided the barrier, so a
peer slow to wake could still be inside it -- and, slow to leave the
allreduce before it as well, time the barrier short.  The worker makes one
rank slow to wake on purpose (its engine sleeps 1 s in the barrier's round)
and checks that every rank leaves the barrier after that rank got there;
one server of four ranks, and two servers of two (the cross-server part of
the barrier stage).
"""

from __future__ import annotations

import json
import re

import pytest
from support.horovod_jobs import WORKERS, job_env, require_horovod, run_job, tail

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(600)]


def check_ranks(p, n: int) -> list[dict]:
    oks = re.findall(r"RANK (\d+) OK (\{.*?\})", p.stdout)
    assert p.returncode == 0 and len(oks) == n, tail(p)
    return [json.loads(s) for _, s in oks]


@pytest.mark.parametrize("hosts,servers", [("localhost:4", 1), ("localhost:2,127.0.0.1:2", 2)])
def test_barrier_waits_for_a_rank_slow_to_wake(tmp_path, hosts: str, servers: int) -> None:
    require_horovod()
    env = job_env({"EXPECT_SERVERS": str(servers)}, tmp=tmp_path)
    p = run_job(["-np", "4", "-H", hosts, "--gloo", "python", str(WORKERS / "torch_barrier.py")], env, timeout=300)
    for st in check_ranks(p, 4):
        assert st["barrier_seconds"] >= 2.0, st
