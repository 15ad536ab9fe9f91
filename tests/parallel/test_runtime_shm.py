"""The shared-memory runtime with real processes: results, faults, and nothing left in /dev/shm.

Each test starts its ranks itself (runtime_rank.py as subprocesses that
meet through a FileRendezvous), so no launcher kills them first: the ranks'
own detection is what is tested.  Every test runs under a timeout, and a test
that kills ranks says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from blink_horovod.runtime.shm import shm_dir

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(180)]

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "runtime_rank.py")
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


@dataclass
class Rank:
    rc: int | None
    lines: list[dict]
    stderr: str

    @property
    def result(self) -> dict:
        return self.lines[-1] if self.lines else {}

    @property
    def job(self) -> str | None:
        return next((ln["job"] for ln in self.lines if "job" in ln), None)


class Group:
    def __init__(self, tmp_path, n: int, scenario: str, *args: str, env: dict | None = None) -> None:
        self.n = n
        rdv = str(tmp_path / "rdv")
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), BLINK_PLAN_CACHE=str(tmp_path / "plans"))
        full_env.pop("BLINK_FAULT", None)
        full_env.update(env or {})
        self.out = [tmp_path / f"rank{r}.out" for r in range(n)]
        self.err = [tmp_path / f"rank{r}.err" for r in range(n)]
        self.procs = []
        for r in range(n):
            with open(self.out[r], "w") as so, open(self.err[r], "w") as se:
                self.procs.append(subprocess.Popen([sys.executable, RANK, rdv, str(r), str(n), scenario, *args],
                                                   env=full_env, stdout=so, stderr=se, text=True))

    def lines(self, r: int) -> list[dict]:
        out = []
        for ln in self.out[r].read_text().splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
        return out

    def wait_for_line(self, r: int, key: str, limit: float = 60.0) -> dict:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for ln in self.lines(r):
                if key in ln:
                    return ln
            time.sleep(0.1)
        raise AssertionError(f"rank {r} printed no {key!r} within {limit} s")

    def wait(self, limit: float = 120.0) -> list[Rank]:
        deadline = time.monotonic() + limit
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                    q.wait()
                raise AssertionError(f"ranks still running after {limit} s")
        return [Rank(p.returncode, self.lines(r), self.err[r].read_text()) for r, p in enumerate(self.procs)]


def leftovers(job: str | None) -> list[str]:
    if job is None:
        return []
    return [f for f in os.listdir(shm_dir()) if f.startswith(f"blink-{job}-")]


def assert_clean(ranks: list[Rank]) -> None:
    jobs = {r.job for r in ranks if r.job}
    assert len(jobs) == 1, jobs
    job = jobs.pop()
    for _ in range(20):  # a dying process's mappings go a moment after it
        if not leftovers(job):
            break
        time.sleep(0.1)
    assert leftovers(job) == [], f"/dev/shm not clean: {leftovers(job)}"


def test_every_dtype_over_shared_memory(tmp_path) -> None:
    ranks = Group(tmp_path, 4, "allreduce", "100003", "float32,float64,float16,bfloat16,int32,int64,int8,uint8,int16",
                  env={"BLINK_CHUNK_BYTES": "64K"}).wait()
    for r in ranks:
        assert r.rc == 0, r.stderr
        assert all(v == 0 for k, v in r.result.items() if k != "rank"), r.result
    assert_clean(ranks)


@pytest.mark.parametrize("eager", ["1", "0"])
def test_mixed_sizes_back_to_back_grow_buffers(tmp_path, eager: str) -> None:
    ranks = Group(tmp_path, 3, "loop", "40", env={"BLINK_TEST_EAGER": eager}).wait()
    for r in ranks:
        assert r.rc == 0, r.stderr
        assert r.result["wrong"] == 0
    assert_clean(ranks)


def test_mismatch_raises_everywhere_over_shared_memory(tmp_path) -> None:
    ranks = Group(tmp_path, 4, "mismatch", env={"BLINK_TIMEOUT_SECONDS": "30"}).wait(60)
    for r in ranks:
        assert r.rc == 3 and r.result["error"] == "MismatchError", r.result
        assert "rank 1 sent shape [4097], rank 0 sent [4096]" in r.result["message"]
    assert_clean(ranks)


def test_rank_killed_mid_collective_is_named_and_nothing_leaks(tmp_path) -> None:
    """Kills rank 1 (SIGKILL from the fault hook) in the middle of a 4 MB allreduce."""
    env = {"BLINK_FAULT": "kill:after=5:rank=1", "BLINK_CHUNK_BYTES": "64K", "BLINK_TIMEOUT_SECONDS": "60",
           "BLINK_TEST_EAGER": "0"}
    start = time.monotonic()
    ranks = Group(tmp_path, 4, "big", str(1 << 20), env=env).wait(90)
    assert time.monotonic() - start < 45  # far below the 60 s timeout
    assert ranks[1].rc == -signal.SIGKILL
    for r in (0, 2, 3):
        res = ranks[r].result
        assert ranks[r].rc == 3 and res["error"] == "BlinkInternalError", res
        assert "rank 1" in res["message"] and ("died" in res["message"] or "failed" in res["message"]), res
    assert_clean(ranks)


def test_rank_killed_from_outside_while_peers_wait(tmp_path) -> None:
    """SIGKILLs rank 0 from the test while it sleeps; the others wait for it in an allreduce."""
    group = Group(tmp_path, 3, "hang_after", "2", "0", env={"BLINK_TIMEOUT_SECONDS": "60"})
    for r in range(3):
        group.wait_for_line(r, "job")  # every rank joined: its pid is known to the others
    time.sleep(3.0)  # the peers are past their two allreduces, waiting for rank 0
    assert all(p.poll() is None for p in group.procs)
    killed_at = time.monotonic()
    group.procs[0].send_signal(signal.SIGKILL)
    ranks = group.wait(60)
    assert time.monotonic() - killed_at < 20
    for r in (1, 2):
        res = ranks[r].result
        assert res.get("error") == "BlinkInternalError" and "rank 0" in res["message"] and "died" in res["message"], res
    assert_clean(ranks)


def test_stalled_rank_warns_then_times_out_everywhere(tmp_path) -> None:
    env = {"BLINK_FAULT": "stall:after=2:rank=2", "BLINK_TIMEOUT_SECONDS": "4", "BLINK_STALL_CHECK_SECONDS": "1",
           "BLINK_CHUNK_BYTES": "64K", "BLINK_TEST_EAGER": "0"}
    start = time.monotonic()
    ranks = Group(tmp_path, 3, "big", str(1 << 18), env=env).wait(60)
    assert time.monotonic() - start < 30
    waiting = [r for i, r in enumerate(ranks) if i != 2]
    assert any(r.result.get("error") == "BlinkTimeoutError" and "rank 2" in r.result["message"] for r in waiting), \
        [r.result for r in ranks]
    assert all(r.rc != 0 for r in ranks)  # the stalled rank ends in its peers' failure, not a hang
    assert any("Missing ranks: 2" in r.stderr for r in waiting)
    assert_clean(ranks)


def test_rank_killed_inside_shared_memory_setup_leaves_nothing(tmp_path) -> None:
    """Rank 1 SIGKILLs itself while its segment name is still linked; survivors unlink it."""
    ranks = Group(tmp_path, 3, "die_in_setup", "1", env={"BLINK_TIMEOUT_SECONDS": "20"}).wait(60)
    assert ranks[1].rc == -signal.SIGKILL
    for r in (0, 2):
        assert ranks[r].rc == 3 and "rank 1" in ranks[r].result["message"], ranks[r].result
    assert_clean(ranks)


def test_real_planner_on_a_dgx1v_allocation(tmp_path) -> None:
    env = {"BLINK_TOPOLOGY": "dgx1v:0,1,4,5", "BLINK_TEST_PLANNER": "real", "BLINK_CHUNK_BYTES": "16K"}
    ranks = Group(tmp_path, 4, "allreduce", "50001", "float32,bfloat16,int8", env=env).wait()
    for r in ranks:
        assert r.rc == 0, r.stderr
        assert r.result["float32"] == 0 and r.result["bfloat16"] == 0 and r.result["int8"] == 0
    assert_clean(ranks)
