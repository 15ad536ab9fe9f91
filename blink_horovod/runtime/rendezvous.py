"""How the ranks of one server find each other and agree on a job id, with no extra service.

Horovod keeps doing what it does well (docs/architecture.md): its launcher
already knows the ranks, hosts and local ranks.  So:

* :func:`from_horovod` asks Horovod once (``hvd.allgather_object``) who shares
  this server (local rank and size, or ``BLINK_LOCAL_SIZE``) and takes the
  server leader's random job id;
* :func:`from_mpi` does the same with mpi4py (``COMM_TYPE_SHARED`` split, or
  ranks grouped by ``BLINK_LOCAL_SIZE``);
* :class:`FileRendezvous` works in a temporary directory, for tests and tools
  that start ranks themselves.

After that first exchange every rendezvous of the server runs through a
:class:`FileRendezvous` in a directory named by the job id, because files give
what the others cannot: a timeout on every ``allgather``/``barrier``, naming
the ranks that did not arrive, and no traffic off the server.  Round files
are deleted one round later (every rank has read them by then) and the
directory on :meth:`close`.

A job killed whole (every rank SIGKILLed) leaves its folder behind: nobody is
left to close it.  Each rank therefore writes a plain-text ``owner-R`` file
(its pid, host and pid namespace) when it joins, and every new job's
rendezvous sweeps ``blink-rdv-*`` folders of this user in which every owner
is provably dead (:func:`sweep_stale_rendezvous`), the way the shared-memory
transport sweeps ``/dev/shm`` (:func:`blink_horovod.runtime.shm.sweep_stale_segments`).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import socket
import tempfile
import time
from typing import Any

from ..config import BLINK_LOCAL_SIZE, Config, load_config
from ..errors import BlinkInternalError, BlinkTimeoutError, ConfigError
from .transport import pid_alive

__all__ = [
    "RDV_PREFIX",
    "FileRendezvous",
    "Rendezvous",
    "from_horovod",
    "from_mpi",
    "new_job_id",
    "single",
    "sweep_stale_rendezvous",
]

RDV_PREFIX = "blink-rdv-"

log = logging.getLogger("blink_horovod.runtime")


def new_job_id() -> str:
    return secrets.token_hex(8)


class Rendezvous:
    """The server's ranks: ``local_rank``, ``local_size``, ``job_id``, ``allgather``, ``barrier``.

    Also ``rank``/``size`` (global) and ``server``/``servers`` when known.
    """

    local_rank: int
    local_size: int
    rank: int = 0
    size: int = 1
    server: int = 0
    servers: int = 1

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        raise NotImplementedError

    def barrier(self, timeout: float | None = None) -> None:
        self.allgather(None, timeout)

    @property
    def job_id(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Single(Rendezvous):
    def __init__(self) -> None:
        self.local_rank, self.local_size = 0, 1
        self._job = new_job_id()

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        return [obj]

    @property
    def job_id(self) -> str:
        return self._job


def single() -> Rendezvous:
    """A server of one rank (``blink perf`` run alone)."""
    return _Single()


class FileRendezvous(Rendezvous):
    """``size`` ranks meeting through files in ``directory`` (which all of them see).

    Parameters
    ----------
    directory : str
        A directory for this job only (created if missing).
    rank, size : int
        This rank's index among the server's ranks, and their number.
    timeout : float
        Default seconds an ``allgather`` waits before ``BlinkTimeoutError``.
    job_id : str, optional
        Known job id; otherwise rank 0's random one, agreed on first use.
    """

    def __init__(self, directory: str, rank: int, size: int, timeout: float | None = None, job_id: str | None = None,
                 stall: float | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"rendezvous: rank {rank} is not in 0..{size - 1}")
        cfg = load_config()
        self.dir = directory
        self.local_rank = rank
        self.local_size = size
        self.rank, self.size = rank, size
        self.timeout = cfg.timeout_seconds if timeout is None else timeout
        self.stall = cfg.stall_check_seconds if stall is None else stall
        self._round = 0
        self._job = job_id
        self._pids: list[int] | None = None
        os.makedirs(directory, exist_ok=True)
        _write_owner(directory, rank)

    def _file(self, rnd: int, rank: int) -> str:
        return os.path.join(self.dir, f"round{rnd}-rank{rank}.pkl")

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj``, in rank order; BlinkTimeoutError names the missing ranks."""
        self._round += 1
        rnd = self._round
        mine = self._file(rnd, self.local_rank)
        tmp = mine + f".tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            pickle.dump((os.getpid(), obj), fh)
        os.replace(tmp, mine)  # atomic: peers never read a torn file
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        next_warn = start + self.stall
        delay = 0.0002
        out: list[Any] = [None] * self.local_size
        got = [False] * self.local_size
        while True:
            for r in range(self.local_size):
                if got[r]:
                    continue
                try:
                    with open(self._file(rnd, r), "rb") as fh:
                        pid, value = pickle.load(fh)
                except (FileNotFoundError, EOFError):
                    continue
                out[r], got[r] = value, True
                if self._pids is None:
                    self._pids = [0] * self.local_size
                self._pids[r] = pid
            missing = [r for r in range(self.local_size) if not got[r]]
            if not missing:
                break
            now = time.monotonic()
            if self._pids is not None:
                dead = [r for r in missing if self._pids[r] and not pid_alive(self._pids[r])]
                if dead:
                    raise BlinkInternalError(
                        f"rendezvous round {rnd}: rank {dead[0]} (pid {self._pids[dead[0]]}) died; "
                        f"ranks not arrived: {missing}"
                    )
            if now - start >= limit:
                raise BlinkTimeoutError(
                    f"rendezvous round {rnd}: rank {self.local_rank} timed out after {limit:g} s waiting for rank "
                    f"{missing[0]}; ranks not arrived: {missing}"
                )
            if now >= next_warn:
                log.warning("rendezvous round %d: rank %d has waited %.0f s. Missing ranks: %s",
                            rnd, self.local_rank, now - start, ", ".join(map(str, missing)))
                next_warn = now + self.stall
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        # Everyone wrote this round, so everyone has read the previous one.
        if rnd > 1:
            try:
                os.unlink(self._file(rnd - 1, self.local_rank))
            except FileNotFoundError:
                pass
        return out

    @property
    def job_id(self) -> str:
        if self._job is None:
            self._job = self.allgather(new_job_id())[0]
        return self._job

    @property
    def pids(self) -> list[int]:
        """Process ids of the server's ranks (after the first allgather)."""
        if self._pids is None or not all(self._pids):
            self.allgather(None)
        return list(self._pids or [])

    def close(self) -> None:
        """Leave; the last rank out removes the directory.

        The last round's file may still be unread by a slower peer, so it
        stays; each rank drops a ``closed-R`` marker instead, and whoever finds
        every rank either closed or dead (a killed rank cannot clean up after
        itself) removes the whole directory, dead ranks' files included.
        """
        if self._round >= 2:
            try:
                os.unlink(self._file(self._round - 1, self.local_rank))
            except FileNotFoundError:
                pass
        try:
            with open(os.path.join(self.dir, f"closed-{self.local_rank}"), "wb"):
                pass
        except OSError:
            return
        pids = self._pids or []
        for r in range(self.local_size):
            if os.path.exists(os.path.join(self.dir, f"closed-{r}")):
                continue
            pid = pids[r] if r < len(pids) else 0
            if not pid or pid_alive(pid):
                return  # still working (or never seen): it removes the directory when it closes
        shutil.rmtree(self.dir, ignore_errors=True)


def _job_dir(job: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{RDV_PREFIX}{job}")


# -- sweeping folders of jobs killed whole ---------------------------------------------
def _namespace() -> str:
    """This host and pid namespace: pids are only comparable within one (containers share /tmp)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "-"
    return f"{socket.gethostname()} {ns}"


def _write_owner(directory: str, rank: int) -> None:
    """``owner-RANK``: ``PID HOST NAMESPACE``, written atomically (a reader never sees half)."""
    path = os.path.join(directory, f"owner-{rank}")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(f"{os.getpid()} {_namespace()}\n")
        os.replace(tmp, path)
    except OSError:  # pragma: no cover - the folder's allgathers will report a real problem
        pass


def _owners_dead(folder: str, here: str) -> bool:
    """True only if ``folder`` has owner files, all of this namespace, all of dead processes."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith("owner-") and ".tmp" not in n]
    except OSError:
        return False
    if not names:
        return False  # made by a rank that has not written its owner yet (or not ours): leave it
    for name in names:
        try:
            with open(os.path.join(folder, name)) as fh:
                pid_text, _, where = fh.read().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            return False
        if where != here or pid_alive(pid):
            return False
    return True


def sweep_stale_rendezvous(parent: str | None = None, keep: str | None = None) -> list[str]:
    """Remove ``blink-rdv-*`` folders (of this user, in ``parent``) whose owners are all dead.

    Safe by construction: a folder is removed only when it has ``owner-R``
    files and every one names a process of this host and pid namespace that
    no longer runs (a live job's ranks all run; a folder whose ranks have not
    written an owner file yet, or of another container sharing ``/tmp``, is
    left alone).  ``keep``: a folder never to touch (the caller's own).
    Returns the folders removed.
    """
    parent = parent or tempfile.gettempdir()
    here = _namespace()
    removed = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(RDV_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        path = entry.path
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owners_dead(path, here):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
                log.info("rendezvous: removed %s, left by a job whose ranks all died", path)
    return removed


def _group(rank: int, size: int, local_rank: int, local_size: int, cfg: Config) -> tuple[int, int, int]:
    """(local_rank, local_size, server leader's global rank), honouring BLINK_LOCAL_SIZE."""
    if cfg.local_size is not None:
        ls = cfg.local_size
        if size % ls:
            raise ConfigError(f"{BLINK_LOCAL_SIZE}: {ls} does not divide the {size} ranks of the job")
        return rank % ls, ls, rank - rank % ls
    return local_rank, local_size, rank - local_rank


class _Delegating(FileRendezvous):
    """A FileRendezvous for the server, set up from a launcher's view of the job."""

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, job: str, server: int, servers: int,
                 cfg: Config) -> None:
        sweep_stale_rendezvous(keep=_job_dir(job))  # folders of jobs killed whole, before making ours
        super().__init__(_job_dir(job), local_rank, local_size, cfg.timeout_seconds, job, cfg.stall_check_seconds)
        self.rank, self.size = rank, size
        self.server, self.servers = server, servers


def from_horovod(hvd: Any, config: Config | None = None) -> Rendezvous:
    """The server's rendezvous, from an initialised Horovod (``horovod.torch`` or ``.tensorflow``).

    The module is passed in, so the runtime never imports Horovod itself.
    """
    cfg = config or load_config()
    rank, size = hvd.rank(), hvd.size()
    local_rank, local_size, leader = _group(rank, size, hvd.local_rank(), hvd.local_size(), cfg)
    token = new_job_id()
    everyone = hvd.allgather_object((rank, local_rank, local_size, leader, token, socket.gethostname()))
    return _from_table(rank, size, everyone, cfg)


def from_mpi(comm: Any = None, config: Config | None = None) -> Rendezvous:
    """The server's rendezvous from mpi4py (``COMM_WORLD`` by default)."""
    cfg = config or load_config()
    if comm is None:
        from mpi4py import MPI  # lazy: MPI only when asked for

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if cfg.local_size is not None:
        local_rank, local_size, leader = _group(rank, size, 0, 1, cfg)
    else:
        from mpi4py import MPI

        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        members = shared.allgather(rank)
        shared.Free()
        local_rank, local_size, leader = members.index(rank), len(members), min(members)
    everyone = comm.allgather((rank, local_rank, local_size, leader, new_job_id(), socket.gethostname()))
    return _from_table(rank, size, everyone, cfg)


def _from_table(rank: int, size: int, everyone: list, cfg: Config) -> Rendezvous:
    leaders = sorted({e[3] for e in everyone})
    _, local_rank, local_size, leader, _, host = everyone[rank]
    members = sorted((e for e in everyone if e[3] == leader), key=lambda e: e[1])
    if (
        [e[1] for e in members] != list(range(local_size))
        or any(e[2] != local_size or e[5] != host for e in members)
    ):
        raise BlinkInternalError(
            f"rendezvous: the ranks of server {leaders.index(leader)} do not have local ranks 0..{local_size - 1} "
            f"on one host (got rank, local rank, host: {[(e[0], e[1], e[5]) for e in members]}); set {BLINK_LOCAL_SIZE}"
        )
    job = next(e[4] for e in everyone if e[0] == leader) + f"s{leaders.index(leader)}"
    return _Delegating(rank, size, local_rank, local_size, job, leaders.index(leader), len(leaders), cfg)
