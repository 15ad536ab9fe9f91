"""Harness of the fault tests: ranks as real processes the test starts, kills and times.

In the manner of PyTorch's ``MultiProcessTestCase``
(``torch/testing/_internal/common_distributed.py``): every rank runs the same
worker script, its output comes back to the test, and nothing can hang: each
group of ranks has a hard wall-clock limit after which every rank is
SIGKILLed and the test fails naming the ranks that were still running.

No launcher stands between the test and its ranks (ranks the test
starts itself, so that no launcher kills them first): the ranks
meet through the runtime's file rendezvous in the test's temporary folder.

What the harness gives a test
-----------------------------
``ranks`` (fixture)
    :class:`RankLauncher`: ``ranks.start(n, body, env=...)`` writes
    ``WORKER_PRELUDE + body`` to a file and starts ``n`` processes of it,
    each in its own session (so a kill reaches its children too), with stdout
    and stderr in files (no pipe can fill up and block a rank).
Worker events
    A worker calls ``emit(kind, **fields)``; the line
    ``@@reliability {"kind": ..., "rank": r, "t": time.time(), ...}`` comes
    back as :attr:`RankResult.events`.  Times are wall-clock ``time.time()``
    of this host, so a test can subtract the instant it killed a rank.
``/dev/shm`` and rendezvous check
    After every test that used ``ranks``, no ``blink-*`` segment created by
    one of its ranks may remain (a reliability requirement), crashed or not, and the
    job's rendezvous folder must be empty or gone (unless every rank was
    killed: then nobody is left to remove the files).  Workers close their
    communicator and rendezvous on the way out, as a careful program does.
``record`` (fixture)
    ``record(case=..., fault=..., injected=..., behaviour=..., seconds=...)``
    adds a row to the reliability report: when ``RELIABILITY_JSON`` names a
    file, the session writes every row with its test's outcome there, and
    ``benchmarks/reliability_report.py`` renders ``docs/reliability.md`` from it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

import pytest
from support.horovod_jobs import child_pythonpath

REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
EVENT_MARK = "@@reliability "
REPORT_ENV = "RELIABILITY_JSON"

# Exit codes of the worker (see WORKER_PRELUDE).
EXIT_OK = 0
EXIT_BLINK_ERROR = 1  # the body raised a BlinkError: the expected way to fail
EXIT_OTHER_ERROR = 3  # anything else: a bug, its traceback is on stderr


# -- /dev/shm ------------------------------------------------------------------------


def blink_shm_entries() -> dict[str, int]:
    """``blink-*`` names in ``/dev/shm`` -> owner pid from the segment header (0 if unreadable).

    The shared-memory transport writes its creator's pid in control word 2
    (``runtime.transport.W_PID``) before the name is linked under its final
    name; temporary names may not have it yet.
    """
    out: dict[str, int] = {}
    if not SHM_DIR.is_dir():
        return out
    for entry in SHM_DIR.iterdir():
        if not entry.name.startswith("blink"):
            continue
        pid = 0
        try:
            with open(entry, "rb") as fh:
                head = fh.read(12)
            if len(head) == 12:
                pid = int.from_bytes(head[8:12], sys.byteorder)
        except OSError:
            pass
        out[entry.name] = pid
    return out


def rendezvous_leftovers(pids: set[int]) -> list[str]:
    """Files in ``/tmp/blink-rdv-*`` (the runtime's per-job rendezvous folders) written by ``pids``."""
    import pickle
    import tempfile

    left = []
    for folder in Path(tempfile.gettempdir()).glob("blink-rdv-*"):
        for f in folder.glob("*.pkl"):
            try:
                with open(f, "rb") as fh:
                    pid = pickle.load(fh)[0]  # (pid, value): our own ranks' files
            except Exception:
                continue
            if pid in pids:
                left.append(str(f))
    return sorted(left)


# -- ranks as processes ------------------------------------------------------------------

WORKER_PRELUDE = textwrap.dedent(
    '''
    """Reliability test worker (written by tests/integration/conftest.py)."""
    import json, os, sys, time, traceback

    RANK = int(os.environ["RELIABILITY_RANK"])
    SIZE = int(os.environ["RELIABILITY_SIZE"])
    RDV_DIR = os.environ["RELIABILITY_RDV_DIR"]
    PARAMS = json.loads(os.environ.get("RELIABILITY_PARAMS", "{}"))
    # What the body wants reported with its error (e.g. when its last collective finished).
    STATE = {}

    def emit(kind, **fields):
        """One event line back to the test (flushed at once: the rank may be killed next)."""
        fields = {"kind": kind, "rank": RANK, "t": time.time(), **fields}
        sys.stdout.write("@@reliability " + json.dumps(fields, default=str) + "\\n")
        sys.stdout.flush()

    import logging

    class _WarningEvents(logging.Handler):
        """Blink's warnings (the stall inspector's "Missing ranks") as timed events, and on stderr."""

        def emit(self, record):
            message = record.getMessage()
            sys.stderr.write("%s %s: %s\\n" % (record.levelname, record.name, message))
            globals()["emit"]("warning", message=message, logger=record.name)

    logging.getLogger("blink_horovod").addHandler(_WarningEvents(logging.WARNING))

    def rss_bytes():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def make_communicator(topology=None, config=None):
        """This rank's Communicator over the runtime's FileRendezvous in RDV_DIR.

        Plans come from the real planner, through the plan cache (BLINK_PLAN_CACHE,
        one folder for the test session).
        """
        from blink_horovod.runtime.communicator import Communicator
        from blink_horovod.runtime.rendezvous import FileRendezvous
        from blink_horovod.config import load_config

        config = config or load_config()
        rendezvous = FileRendezvous(RDV_DIR, RANK, SIZE, timeout=config.timeout_seconds)
        _OWNED.append(rendezvous)
        topo = None
        if topology is not None:
            from blink_horovod.topology.machines import resolve
            topo = resolve(topology)
        comm = Communicator(RANK, SIZE, topo, rendezvous, config=config, device="cpu")
        _OWNED.append(comm)
        return comm

    # What this rank made and closes on the way out, as a careful program does
    # (``with`` / ``finally``): communicators first, then their rendezvous.
    _OWNED = []

    def _close_owned():
        for obj in reversed(_OWNED):
            try:
                obj.close()
            except BaseException as exc:
                emit("close-error", type=type(exc).__name__, message=str(exc), what=type(obj).__name__)
        del _OWNED[:]

    def main(body):
        """Run body(); a BlinkError becomes an 'error' event and exit 1, anything else exit 3."""
        from blink_horovod.errors import BlinkError
        emit("start", pid=os.getpid())
        try:
            body()
        except BlinkError as exc:
            emit("error", type=type(exc).__name__, message=str(exc),
                 mro=[c.__name__ for c in type(exc).__mro__], **STATE)
            _close_owned()
            sys.exit(1)
        except BaseException as exc:
            emit("crash", type=type(exc).__name__, message=str(exc), **STATE)
            traceback.print_exc()
            _close_owned()
            sys.exit(3)
        _close_owned()
        emit("done")
        sys.exit(0)
    '''
)


@dataclass
class RankResult:
    """What one rank did: exit status, output and its ``emit`` events."""

    rank: int
    pid: int
    returncode: int | None
    stdout: str
    stderr: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str) -> dict[str, Any] | None:
        """The first event of ``kind`` (None if the rank never emitted one)."""
        return next((e for e in self.events if e["kind"] == kind), None)

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.stderr.splitlines()[-n:])


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith(EVENT_MARK):
            try:
                out.append(json.loads(line[len(EVENT_MARK):]))
            except json.JSONDecodeError:
                pass  # a line cut short by a kill
    return out


class RankGroup:
    """``n`` running ranks; every wait is bounded by ``limit`` seconds from the start."""

    rendezvous_left_ok = False

    def __init__(self, procs: list[subprocess.Popen], folder: Path, limit: float) -> None:
        self.procs = procs
        self.folder = folder
        self.started = time.monotonic()
        self.limit = limit

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _out(self, rank: int) -> str:
        return (self.folder / f"rank{rank}.out").read_text(errors="replace")

    def _err(self, rank: int) -> str:
        return (self.folder / f"rank{rank}.err").read_text(errors="replace")

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to rank ``rank``'s process group; the wall-clock instant it was sent."""
        t = time.time()
        try:
            os.killpg(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass
        return t

    def wait_event(self, rank: int, kind: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until rank ``rank`` emitted ``kind`` (fail on its exit or at the limit)."""
        deadline = self.started + self.limit if timeout is None else min(self.started + self.limit, time.monotonic() + timeout)
        while True:
            for ev in _events(self._out(rank)):
                if ev["kind"] == kind:
                    return ev
            if self.procs[rank].poll() is not None:
                # One last read: the event may have landed just before the exit.
                for ev in _events(self._out(rank)):
                    if ev["kind"] == kind:
                        return ev
                self._fail(f"rank {rank} exited with {self.procs[rank].returncode} before emitting {kind!r}")
            if time.monotonic() >= deadline:
                self._fail(f"rank {rank} did not emit {kind!r} in time")
            time.sleep(0.02)

    def wait_exit(self, rank: int, timeout: float | None = None) -> float:
        """Block until rank ``rank`` exits; the wall-clock instant it was seen gone (5 ms polls)."""
        deadline = self.started + self.limit if timeout is None else min(self.started + self.limit, time.monotonic() + timeout)
        while self.procs[rank].poll() is None:
            if time.monotonic() >= deadline:
                self._fail(f"rank {rank} did not exit in time")
            time.sleep(0.005)
        return time.time()

    def wait(self, timeout: float | None = None) -> list[RankResult]:
        """Every rank's result once all have exited; past the limit, kill all and fail (a hang)."""
        deadline = self.started + self.limit if timeout is None else min(self.started + self.limit, time.monotonic() + timeout)
        for p in self.procs:
            left = deadline - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.0))
            except subprocess.TimeoutExpired:
                running = [r for r, q in enumerate(self.procs) if q.poll() is None]
                self._fail(f"ranks {running} still running after {self.limit:g} s: a hang")
        return self.results()

    def results(self) -> list[RankResult]:
        return [
            RankResult(r, p.pid, p.poll(), self._out(r), self._err(r), _events(self._out(r)))
            for r, p in enumerate(self.procs)
        ]

    def kill_all(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(r)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                pass

    def _fail(self, why: str) -> None:
        self.kill_all()
        detail = "\n".join(
            f"--- rank {r.rank} (rc {r.returncode}) stderr tail:\n{r.tail()}" for r in self.results()
        )
        pytest.fail(f"{why}\n{detail}", pytrace=False)


class RankLauncher:
    """Starts groups of ranks for one test and cleans up after it."""

    def __init__(self, folder: Path, plan_cache: Path | None = None) -> None:
        self.folder = folder
        self.plan_cache = plan_cache or folder / "plan-cache"
        self.groups: list[RankGroup] = []
        self.shm_before = blink_shm_entries()

    def start(
        self,
        n: int,
        body: str,
        *,
        env: Mapping[str, str] | None = None,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
        limit: float = 60.0,
        timeout_seconds: float = 5.0,
        stall_seconds: float = 1.0,
        python: str | None = None,
        params: Mapping[str, Any] | None = None,
        rendezvous_left_ok: bool = False,
    ) -> RankGroup:
        """Start ``n`` ranks running ``WORKER_PRELUDE + body``.

        ``BLINK_TIMEOUT_SECONDS`` / ``BLINK_STALL_CHECK_SECONDS`` default to
        small values so faults surface in seconds; ``env`` adds or overrides
        variables for every rank, ``rank_env[r]`` for rank ``r`` only (e.g. a
        ``BLINK_FAULT`` on one rank).  ``limit`` is the hard wall-clock bound.
        ``params`` reaches the worker as the dict ``PARAMS``.  After the test the
        rendezvous folder must be empty or gone (its files are the job's temporary
        files) unless ``rendezvous_left_ok`` (every rank killed: nobody is left to
        remove them).
        """
        index = len(self.groups)
        folder = self.folder / f"group{index}"
        folder.mkdir(parents=True)
        (folder / "rdv").mkdir()
        script = folder / "worker.py"
        script.write_text(WORKER_PRELUDE + "\n" + textwrap.dedent(body))
        base = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
        base.update(
            PYTHONPATH=child_pythonpath(),
            PYTHONUNBUFFERED="1",
            RELIABILITY_SIZE=str(n),
            RELIABILITY_RDV_DIR=str(folder / "rdv"),
            RELIABILITY_PARAMS=json.dumps(params or {}),
            BLINK_TIMEOUT_SECONDS=f"{timeout_seconds:g}",
            BLINK_STALL_CHECK_SECONDS=f"{stall_seconds:g}",
            BLINK_PLAN_CACHE=str(self.plan_cache),
            # ranks outnumber cores here; keep numpy/BLAS from spawning threads per rank
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
        )
        base.update(env or {})
        procs = []
        for r in range(n):
            env_r = dict(base, RELIABILITY_RANK=str(r))
            env_r.update((rank_env or {}).get(r, {}))
            with open(folder / f"rank{r}.out", "wb") as out, open(folder / f"rank{r}.err", "wb") as err:
                procs.append(
                    subprocess.Popen(
                        [python or sys.executable, str(script)],
                        stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                        env=env_r, cwd=folder, start_new_session=True,
                    )
                )
        group = RankGroup(procs, folder, limit)
        group.rendezvous_left_ok = rendezvous_left_ok
        self.groups.append(group)
        return group

    def our_pids(self) -> set[int]:
        return {pid for g in self.groups for pid in g.pids}

    def close(self) -> tuple[list[str], list[str]]:
        """Kill what still runs; the ``blink-*`` names our ranks left in ``/dev/shm``, and
        the files left in rendezvous folders that should be clean."""
        for g in self.groups:
            g.kill_all()
        ours = self.our_pids()
        leaked = [
            name for name, pid in blink_shm_entries().items()
            if name not in self.shm_before and (pid in ours or pid == 0)
        ]
        left = [
            str(p.relative_to(self.folder))
            for g in self.groups if not g.rendezvous_left_ok and (g.folder / "rdv").is_dir()
            for p in sorted((g.folder / "rdv").iterdir())
        ]
        return sorted(leaked), left


@pytest.fixture(scope="session")
def plan_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One plan cache for the session: each cpuN plan is made once, as in a real job's cache."""
    return tmp_path_factory.mktemp("plan-cache")


@pytest.fixture
def ranks(tmp_path: Path, plan_cache_dir: Path) -> Iterator[RankLauncher]:
    launcher = RankLauncher(tmp_path, plan_cache_dir)
    yield launcher
    leaked, left = launcher.close()
    for name in leaked:  # do not let one leak fail the next tests too
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            pass
    if leaked:
        pytest.fail(f"/dev/shm entries outlived the job: {leaked}", pytrace=False)
    if left:
        pytest.fail(f"rendezvous files outlived the job: {left}", pytrace=False)


# -- results, errors ------------------------------------------------------------------------------


def error_of(result: RankResult) -> dict[str, Any]:
    """The rank's 'error' event (it raised a BlinkError), failing the test otherwise."""
    ev = result.event("error")
    if ev is None:
        pytest.fail(
            f"rank {result.rank} (rc {result.returncode}) raised no BlinkError; events {result.events}\n{result.tail()}",
            pytrace=False,
        )
    return ev


# -- the reliability report -------------------------------------------------------------------------

_RECORDS: list[dict[str, Any]] = []
_OUTCOMES: dict[str, str] = {}


@pytest.fixture
def record(request: pytest.FixtureRequest):
    """``record(case=..., fault=..., injected=..., behaviour=..., seconds=..., limit_s=...)``."""

    def add(**fields: Any) -> None:
        _RECORDS.append({"test": request.node.nodeid, **fields})

    return add


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _OUTCOMES[item.nodeid] = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    elif report.when == "teardown" and report.outcome == "failed":
        _OUTCOMES[item.nodeid] = "failed"  # e.g. a /dev/shm leak found after the test


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or not _RECORDS:
        return
    doc = {
        "format": "blink-reliability-run/1",
        "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "records": [dict(r, outcome=_OUTCOMES.get(r["test"], "unknown")) for r in _RECORDS],
        "outcomes": dict(sorted(_OUTCOMES.items())),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, target)
