"""Jobs killed whole leave nothing behind for long: ``/tmp/blink-rdv-*`` folders are swept, ``/dev/shm`` is clean.

A job whose every rank is SIGKILLed cannot remove its rendezvous folder
(``runtime.rendezvous``: the last rank out removes it); the next job's
rendezvous sweeps folders whose ``owner-R`` files all name dead processes of
this host and pid namespace, and nothing else.  Cases:

* the sweep's rules, on folders made by hand in a temporary parent;
* a job of ranks started here, meeting through the real per-job folder
  (``/tmp/blink-rdv-<job>``), every rank SIGKILLed; the next job sweeps it;
* ``blink perf`` under ``horovodrun`` with one rank killed by the fault hook
  mid-collective (the launcher then tears the rest down): afterwards no
  ``blink-*`` segment of a dead process is in ``/dev/shm`` and, once the next
  job has started, no folder of the dead job is left in ``/tmp``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import blink_shm_entries
from support.horovod_jobs import child_pythonpath, launcher_path

from blink_horovod.runtime import rendezvous as rdv
from blink_horovod.runtime.transport import pid_alive

pytestmark = pytest.mark.timeout(240)

HOROVODRUN = launcher_path() or Path(sys.executable).parent / "horovodrun"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _folder(parent: Path, name: str, owners: list[tuple[int, str]]) -> Path:
    d = parent / f"{rdv.RDV_PREFIX}{name}"
    d.mkdir()
    (d / "round1-rank0.pkl").write_bytes(b"x")
    for r, (pid, where) in enumerate(owners):
        (d / f"owner-{r}").write_text(f"{pid} {where}\n")
    return d


def test_sweep_removes_only_folders_whose_owners_are_all_provably_dead(tmp_path: Path) -> None:
    here = rdv._namespace()
    dead, dead2 = _dead_pid(), _dead_pid()
    stale = _folder(tmp_path, "stale", [(dead, here), (dead2, here)])
    live = _folder(tmp_path, "live", [(dead, here), (os.getpid(), here)])
    anonymous = _folder(tmp_path, "anonymous", [])  # no owner yet: a job starting up
    foreign = _folder(tmp_path, "foreign", [(dead, "otherhost pid:[1]")])  # another container's pids
    mine = _folder(tmp_path, "mine", [(dead, here)])
    garbled = _folder(tmp_path, "garbled", [(dead, here)])
    (garbled / "owner-1").write_text("not a pid\n")
    plain = tmp_path / f"{rdv.RDV_PREFIX}file"
    plain.write_text("not a folder")
    removed = rdv.sweep_stale_rendezvous(str(tmp_path), keep=str(mine))
    assert removed == [str(stale)]
    assert not stale.exists()
    assert all(p.exists() for p in (live, anonymous, foreign, mine, garbled, plain))


def test_owner_files_name_this_process(tmp_path: Path) -> None:
    r = rdv.FileRendezvous(str(tmp_path / "job"), 0, 1, timeout=10)
    pid, _, where = (tmp_path / "job" / "owner-0").read_text().strip().partition(" ")
    assert int(pid) == os.getpid() and where == rdv._namespace()
    r.allgather(1)
    r.close()
    assert not (tmp_path / "job").exists()  # the last rank out removes the folder, owner files too


RANK = """
import os, sys, time
from blink_horovod.config import load_config
from blink_horovod.runtime import rendezvous as rdv
rank, size, job, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "hold"
r = rdv._Delegating(rank, size, rank, size, job, 0, 1, load_config({{}}))
r.allgather(os.getpid())
print("ready", r.dir, flush=True)
if hold:
    time.sleep(120)
r.allgather(None)
r.close()
"""


def _start(n: int, job: str, hold: bool) -> list[subprocess.Popen]:
    code = RANK.format()
    return [subprocess.Popen([sys.executable, "-c", code, str(r), str(n), job, "hold" if hold else "go"],
                             stdout=subprocess.PIPE, text=True) for r in range(n)]


def test_job_killed_whole_is_swept_by_the_next_job() -> None:
    job = "sweeptest" + secrets.token_hex(4)
    folder = Path(tempfile.gettempdir()) / f"{rdv.RDV_PREFIX}{job}"
    procs = _start(3, job, hold=True)
    try:
        for p in procs:
            assert p.stdout.readline().startswith("ready")
        assert folder.is_dir() and len(list(folder.glob("owner-*"))) == 3
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert folder.is_dir()  # nobody was left to remove it
    nxt = "sweeptest" + secrets.token_hex(4)
    t0 = time.monotonic()
    follow = _start(2, nxt, hold=False)
    for p in follow:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and out.startswith("ready")
    assert not folder.exists(), f"the next job's rendezvous left {folder}"
    assert not (Path(tempfile.gettempdir()) / f"{rdv.RDV_PREFIX}{nxt}").exists()
    assert time.monotonic() - t0 < 60


def _stale_folders() -> list[Path]:
    """rendezvous folders of this user whose owners are all dead (what a sweep would remove)."""
    here = rdv._namespace()
    return [p for p in Path(tempfile.gettempdir()).glob(f"{rdv.RDV_PREFIX}*")
            if p.is_dir() and rdv._owners_dead(str(p), here)]


@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed for this interpreter")
def test_perf_job_with_a_rank_killed_leaves_no_segment_and_its_folder_is_swept(tmp_path: Path) -> None:
    shm_before = set(blink_shm_entries())
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env.update(PYTHONPATH=child_pythonpath(), BLINK_PLAN_CACHE=str(tmp_path / "plans"), OMP_NUM_THREADS="1",
               BLINK_FAULT="kill:after=6:rank=1", BLINK_CHUNK_BYTES="64K", BLINK_TIMEOUT_SECONDS="60")
    p = subprocess.run([str(HOROVODRUN), "-np", "3", "-H", "localhost:3", "--gloo", sys.executable, "-m",
                        "blink_horovod", "perf", "-b", "1M", "-e", "1M", "-n", "3", "-w", "1"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200, check=False)
    assert p.returncode != 0, p.stdout[-2000:]
    time.sleep(1.0)  # horovodrun has reaped its ranks; give the kernel a moment to free their mappings
    leaked = {n: pid for n, pid in blink_shm_entries().items() if n not in shm_before and not pid_alive(pid)}
    assert leaked == {}, leaked
    # Whatever the launcher's teardown left, the next job's rendezvous start removes it.
    nxt = "sweeptest" + secrets.token_hex(4)
    for q in _start(2, nxt, hold=False):
        q.communicate(timeout=60)
        assert q.returncode == 0
    assert _stale_folders() == []
