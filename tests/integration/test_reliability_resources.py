"""Nothing outlives a job: shared memory, rendezvous files, processes; crashed or not.

Reliability requirement (Resources): "shared-memory segments, IPC handles and temporary files
never outlive a job, crashed or not".  The ``ranks`` fixture checks after
every case that no ``/dev/shm/blink-*`` entry of its ranks remains and that
the job's rendezvous folder is empty; the cases here aim faults at the
moments where something is linked or half made:

* a clean job whose buffers grow through several generations (each growth
  links new names for a moment);
* SIGTERM of one rank mid-collective (Python's default action: no cleanup code);
* SIGKILL of one rank inside the shared-memory setup, after its segment was
  linked and before its peers confirmed mapping it (its name is still in
  ``/dev/shm``: the survivors must unlink it);
* SIGKILL of every rank at once, at several instants, so nobody survives to
  clean up (what the runtime leaves then is all that could ever leak).
"""

from __future__ import annotations

import signal
import time

import pytest

from conftest import SHM_DIR, blink_shm_entries, error_of

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("blink_horovod.runtime.communicator", reason="the CPU runtime is not in this checkout yet")

TIMEOUT_S = 5.0

GROWING = """
import numpy as np

def body():
    comm = make_communicator()
    i = 0
    sizes = PARAMS["sizes"]
    while True:
        for count in sizes:
            arr = np.full(count, RANK + 1, np.float32)
            comm.allreduce(arr)
            assert arr[0] == SIZE * (SIZE + 1) / 2
            comm.broadcast(arr, root=i % SIZE)
        i += 1
        STATE["last_ok"] = time.time()
        if i == 1:
            emit("looping")
        if i >= PARAMS.get("rounds", 10**9):
            break

main(body)
"""


def test_clean_job_with_growing_buffers_leaves_nothing(ranks, record) -> None:
    before = blink_shm_entries()
    t0 = time.monotonic()
    group = ranks.start(4, GROWING, params={"sizes": [256, 1 << 14, 1 << 18, 1 << 21], "rounds": 3}, limit=90)
    results = group.wait()
    for r in results:
        assert r.returncode == 0 and r.event("done"), (r.rank, r.events[-3:], r.tail())
    # (The fixture repeats this after the test, for our ranks only.)
    assert set(blink_shm_entries()) - set(before) == set()
    record(
        case="clean job, buffers growing 1 KiB -> 8 MiB (4 ranks)",
        fault="resources",
        injected="no fault: allreduce + broadcast of growing sizes, close()",
        behaviour="exit 0 on every rank; nothing left in /dev/shm or in the rendezvous folder",
        seconds=None,
        wall_s=time.monotonic() - t0,
    )


def test_sigterm_mid_collective_leaves_nothing(ranks, record) -> None:
    victim = 1
    group = ranks.start(3, GROWING, params={"sizes": [1 << 16, 1 << 20]}, timeout_seconds=TIMEOUT_S, limit=60)
    group.wait_event(victim, "looping")
    time.sleep(0.2)
    sent = group.kill(victim, signal.SIGTERM)
    results = group.wait()
    assert results[victim].returncode == -signal.SIGTERM, results[victim].tail()
    delays = []
    for r in results:
        if r.rank != victim:
            ev = error_of(r)
            assert ev["type"] == "BlinkInternalError" and f"rank {victim}" in ev["message"], ev
            delays.append(ev["t"] - sent)
    record(
        case=f"rank {victim} of 3 SIGTERMed mid-collective",
        fault="resources",
        injected="the test sends SIGTERM (default action: the process ends, no cleanup runs)",
        behaviour=f"survivors raise BlinkInternalError naming rank {victim}; nothing left in /dev/shm or the rendezvous folder",
        seconds=max(delays),
        limits=f"timeout {TIMEOUT_S:g} s",
    )
    assert max(delays) < TIMEOUT_S


IN_SETUP = """
import numpy as np

def body():
    if PARAMS["victim"] in (RANK, "all"):
        # Freeze this rank inside the transport setup: its own segment is created and
        # linked under its final name, its peers' are not yet confirmed mapped.
        from blink_horovod.runtime import shm
        real = shm.ShmTransport._map_peers
        def frozen(self, *args, **kwargs):
            emit("in-setup", segments=sorted(n for n in os.listdir(self.dir) if n.startswith("blink-")))
            time.sleep(600)
        shm.ShmTransport._map_peers = frozen
    comm = make_communicator()
    comm.allreduce(np.ones(1024, np.float32))

main(body)
"""


def test_rank_killed_inside_shared_memory_setup_survivors_unlink_its_segment(ranks, record) -> None:
    victim = 2
    group = ranks.start(3, IN_SETUP, params={"victim": victim}, timeout_seconds=TIMEOUT_S, limit=60)
    ev = group.wait_event(victim, "in-setup")
    linked = [n for n in ev["segments"] if f"-{victim}-g0" in n]
    assert linked, ev  # the victim's name is in /dev/shm now
    killed = group.kill(victim, signal.SIGKILL)
    results = group.wait()
    delays = []
    for r in results:
        if r.rank != victim:
            err = error_of(r)
            assert "BlinkError" in err["mro"] and f"rank {victim}" in err["message"], err
            delays.append(err["t"] - killed)
    for name in linked:
        assert not (SHM_DIR / name).exists(), f"{name} outlived its killed owner"
    record(
        case=f"rank {victim} of 3 SIGKILLed inside the shared-memory setup",
        fault="resources",
        injected="the rank is frozen after linking its segment (before peers confirm mapping it), then SIGKILLed",
        behaviour=f"survivors raise {'/'.join(sorted({error_of(r)['type'] for r in results if r.rank != victim}))} "
                  f"naming rank {victim} and unlink its segment {linked[0]}",
        seconds=max(delays),
        limits=f"timeout {TIMEOUT_S:g} s",
    )
    assert max(delays) < TIMEOUT_S + 1.0


ONE_ALLREDUCE = """
import numpy as np

def body():
    comm = make_communicator()
    arr = np.ones(4096, np.float32)
    comm.allreduce(arr)
    assert arr[0] == SIZE

main(body)
"""


@pytest.mark.parametrize("delay", [0.05, 0.4])
def test_every_rank_killed_at_once_leaves_no_shared_memory(ranks, record, delay: float) -> None:
    before = set(blink_shm_entries())
    group = ranks.start(4, GROWING, params={"sizes": [256, 1 << 15, 1 << 19, 1 << 21, 3 << 20]},
                        limit=60, rendezvous_left_ok=True)
    group.wait_event(0, "start")
    time.sleep(delay + 0.5)  # interpreter start-up, then `delay` into the job
    for r in range(4):
        group.kill(r, signal.SIGKILL)
    results = group.wait()
    assert all(r.returncode == -signal.SIGKILL for r in results)
    ours = set(group.pids)
    left = sorted(n for n, pid in blink_shm_entries().items() if n not in before and pid in ours)
    # Killed inside a window where a name is linked, nobody is left to unlink it:
    # the next job's transport setup sweeps names whose creator is dead.
    t0 = time.monotonic()
    follow = ranks.start(2, ONE_ALLREDUCE, timeout_seconds=TIMEOUT_S, limit=60)
    assert all(r.returncode == 0 for r in follow.wait())
    swept = time.monotonic() - t0
    remaining = [n for n in left if (SHM_DIR / n).exists()]
    phase = "collectives" if any(r.event("looping") for r in results) else "setup or first round"
    record(
        case=f"all 4 ranks SIGKILLed at once, {delay:g} s into the job ({phase})",
        fault="resources",
        injected="SIGKILL of every rank at once (nobody survives to clean up)",
        behaviour=(
            (f"{len(left)} name(s) left linked by a kill inside a buffer-growth window ({', '.join(left)}); "
             f"the next job's setup unlinked them" if left else "nothing left in /dev/shm")
            + "; the rendezvous folder keeps the killed ranks' round files (no process is left to remove them)"
        ),
        seconds=swept if left else None,
    )
    assert remaining == [], remaining


def test_job_killed_whole_inside_setup_is_swept_by_the_next_job(ranks, record) -> None:
    """Deterministic form of the window above: every rank frozen with its segment linked, then killed."""
    group = ranks.start(3, IN_SETUP, params={"victim": "all"}, limit=60, rendezvous_left_ok=True)
    linked = sorted({n for r in range(3) for n in group.wait_event(r, "in-setup")["segments"] if f"-{r}-g0" in n})
    assert len(linked) == 3, linked
    for r in range(3):
        group.kill(r, signal.SIGKILL)
    group.wait()
    assert all((SHM_DIR / n).exists() for n in linked)  # nobody alive could unlink them
    t0 = time.monotonic()
    follow = ranks.start(2, ONE_ALLREDUCE, timeout_seconds=TIMEOUT_S, limit=60)
    assert all(r.returncode == 0 for r in follow.wait())
    seconds = time.monotonic() - t0
    remaining = [n for n in linked if (SHM_DIR / n).exists()]
    record(
        case="all 3 ranks SIGKILLed while their segments are linked (inside setup)",
        fault="resources",
        injected="every rank frozen after linking its segment, then SIGKILLed: 3 names left in /dev/shm",
        behaviour=f"the next job (2 ranks, one allreduce) sweeps the dead job's names at its setup; {len(remaining)} left",
        seconds=seconds,
        limits="time = the whole next job, start-up included",
    )
    assert remaining == [], remaining
