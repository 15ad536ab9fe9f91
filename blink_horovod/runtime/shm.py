"""The shared-memory transport: each rank's segment in POSIX shared memory, mapped by its peers.

A rank's segment (a file of ``/dev/shm``, what ``shm_open`` creates) holds::

    control words | program flags | metadata slot 0 | slot 1 | abort reason | eager 0 | eager 1 | data buffer
    (uint32: state, pid, metadata sequence, done epoch, generation, ...)  (page aligned)

The owner maps it read-write, every peer read-only, so a rank can only ever
write its own memory, as the pull model of
:mod:`blink_horovod.schedule.program` requires.  Waiting on a peer's word is a
shared futex (:mod:`blink_horovod.runtime.futex`) after a brief spin.
On x86-64 (total store order) a rank's data writes are seen by its peers
before the flag store that follows them, which is what makes a flag a valid
"the region is ready".

Nothing outlives the job.  A segment is created under a temporary name,
initialised, and renamed into place (peers never see a half-made one); once
every peer has mapped it (each says so in its own control words) its owner
unlinks the name, so from then on the memory lives only in the mappings and
the kernel frees it when the last process holding one exits, killed or not.
During the short window before that, ``atexit`` and a temporary SIGTERM/SIGINT
handler unlink the names, and surviving peers unlink the names of a peer they
find dead.  Buffers grow by *generations*: when a collective needs more room
every rank makes a bigger segment the same way and drops the old one.

Segment names are ``blink-<job>-<rank>-g<generation>``; the job id comes from
the rendezvous, unique per job and server.
"""

from __future__ import annotations

import atexit
import mmap
import os
import signal
import tempfile
import threading
import time
from collections.abc import Sequence

import numpy as np

from ..errors import BlinkInternalError, BlinkTimeoutError
from .futex import futex_wait, futex_wake
from .transport import (
    CONTROL_WORDS,
    EAGER_BYTES,
    MAGIC,
    META_BYTES,
    REASON_BYTES,
    STATE_OPEN,
    W_DATA_PAGES,
    W_GEN,
    W_MAGIC,
    W_MAPPED,
    W_NFLAGS,
    W_PID,
    W_READY_GEN,
    W_SLEEP,
    W_SLEEP_SEEN,
    W_STATE,
    Transport,
    WaitContext,
    pid_alive,
    sleep_token,
)

__all__ = ["ShmTransport", "linked_segments", "segment_name", "shm_dir", "sweep_stale_segments"]

_PAGE = 4096
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: an uncontended lock is a locked instruction on x86-64.

    Between a poster's store of a flag and its load of the peers' sleep words
    (and a sleeper's store of its sleep word and its load of the flag), the
    CPU may otherwise let the load pass the store, and both sides would miss
    each other (Dekker's problem): the sleeper would sleep through the post.
    """
    _fence_lock.acquire()
    _fence_lock.release()


def shm_dir() -> str:
    """Where POSIX shared memory lives (``/dev/shm``; a temp dir elsewhere)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_name(job: str, rank: int, gen: int) -> str:
    return f"blink-{job}-{rank}-g{gen}"


# -- names this process has linked and not yet unlinked ------------------------
_linked: set[str] = set()
_linked_lock = threading.Lock()


def linked_segments() -> set[str]:
    """Paths this process created and has not unlinked yet (tests)."""
    with _linked_lock:
        return set(_linked)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:  # pragma: no cover
        pass
    with _linked_lock:
        _linked.discard(path)


def sweep_stale_segments(directory: str | None = None) -> list[str]:
    """Unlink ``blink-*`` names whose creator is dead; the names removed.

    A name is linked only until every peer has mapped it, but if *every* rank
    of a job is killed inside that window nobody is left to unlink it, so each
    new transport sweeps what dead jobs left: the creator's pid is in the
    header (``W_PID``, written before ``W_MAGIC``).  A name without a valid
    header is left alone unless it is older than a minute (its creator died
    between creating and initialising it).
    """
    directory = directory or shm_dir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith("blink-")]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as fh:
                head = fh.read(4 * (W_PID + 1))
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        pid = 0
        if len(head) == 4 * (W_PID + 1):
            words = np.frombuffer(head, dtype=np.uint32)
            if int(words[W_MAGIC]) == MAGIC:
                pid = int(words[W_PID])
        if (pid and not pid_alive(pid)) or (not pid and age > 60.0):
            _unlink_quiet(path)
            removed.append(name)
    return removed


def _unlink_all() -> None:
    for path in linked_segments():
        _unlink_quiet(path)


atexit.register(_unlink_all)


class _CleanupSignals:
    """While a segment name is linked: SIGTERM/SIGINT unlink it, then act as before.

    Installed only from the main thread (Python's rule) and only around the
    short create-to-unlink window.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> _CleanupSignals:
        self.saved: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                try:
                    self.saved[sig] = signal.signal(sig, self._handler)
                except (ValueError, OSError):  # pragma: no cover
                    pass
        return self

    def _handler(self, signum, frame) -> None:
        _unlink_all()
        previous = self.saved.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        for sig, previous in self.saved.items():
            try:
                signal.signal(sig, previous)  # type: ignore[arg-type]
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass


def _layout(nranks: int, nflags: int, data_bytes: int) -> dict[str, int]:
    nwords = CONTROL_WORDS + nranks + nflags
    meta0 = -(-(nwords * 4) // 64) * 64
    meta1 = meta0 + META_BYTES
    reason = meta1 + META_BYTES
    eager0 = -(-(reason + REASON_BYTES) // _PAGE) * _PAGE
    eager1 = eager0 + EAGER_BYTES
    data = eager1 + EAGER_BYTES
    return {"nwords": nwords, "meta0": meta0, "meta1": meta1, "reason": reason, "eager0": eager0,
            "eager1": eager1, "data": data, "size": data + data_bytes}


class _Segment:
    """One mapped segment (own: read-write; a peer's: read-only)."""

    def __init__(self, path: str, fd: int, writable: bool, nranks: int) -> None:
        size = os.fstat(fd).st_size
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.mm = mmap.mmap(fd, size, access=access)
        self.path = path
        head = np.frombuffer(self.mm, dtype=np.uint32, count=CONTROL_WORDS)
        nflags, pages = int(head[W_NFLAGS]), int(head[W_DATA_PAGES])
        del head
        self.layout = _layout(nranks, nflags, pages * _PAGE)
        if self.layout["size"] > size:
            self.mm.close()
            raise BlinkInternalError(f"shared memory segment {path}: {size} bytes, header says {self.layout['size']}")
        self.words = np.frombuffer(self.mm, dtype=np.uint32, count=self.layout["nwords"])
        self.data = np.frombuffer(self.mm, dtype=np.uint8, count=pages * _PAGE, offset=self.layout["data"])
        self.eager = [np.frombuffer(self.mm, dtype=np.uint8, count=EAGER_BYTES, offset=self.layout[f"eager{i}"])
                      for i in (0, 1)]
        self.base = self.words.ctypes.data
        self.nflags = nflags

    def close(self) -> None:
        # Views export the buffer; drop them before closing the mapping.
        self.words = None  # type: ignore[assignment]
        self.data = None  # type: ignore[assignment]
        self.eager = []
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view escaped; the GC frees it
            pass


class ShmTransport(Transport):
    """Rank ``rank`` of ``nranks`` ranks of one server, over ``/dev/shm``.

    Parameters
    ----------
    job : str
        Job id every rank of the server agreed on (``[A-Za-z0-9_]``).
    ctx : WaitContext
        Deadline for the setup (every peer must create and map its segment).
    pids : sequence of int, optional
        Peers' process ids from the rendezvous, to notice early a peer that
        dies before making its segment.
    data_bytes, nflags : int
        Initial capacity; :meth:`reserve` grows it.
    """

    def __init__(
        self,
        rank: int,
        nranks: int,
        job: str,
        ctx: WaitContext,
        pids: Sequence[int] | None = None,
        data_bytes: int = 1 << 20,
        nflags: int = 1024,
        directory: str | None = None,
    ) -> None:
        super().__init__(rank, nranks)
        if not job or not all(c.isalnum() or c in "_" for c in job):
            raise BlinkInternalError(f"job id must be alphanumeric, got {job!r}")
        self.job = job
        self.dir = directory or shm_dir()
        self._peers = [r for r in range(nranks) if r != rank]
        self._pids = list(pids) if pids is not None else None
        self._gen = 0
        self._segs: list[_Segment] = []
        data_bytes = -(-max(data_bytes, _PAGE) // _PAGE) * _PAGE
        sweep_stale_segments(self.dir)
        with _CleanupSignals():
            own = self._create(0, data_bytes, nflags, None)
            try:
                self._segs = self._map_peers(0, own, ctx)
                self._confirm_mapped(0, ctx)
            except BaseException:
                own.close()
                for seg in self._segs:
                    if seg is not own:
                        seg.close()
                self._segs = []
                _unlink_quiet(self._path(rank, 0))
                self._cleanup_dead_peers()
                raise

    # -- naming and creation ---------------------------------------------------
    def _path(self, rank: int, gen: int) -> str:
        return os.path.join(self.dir, segment_name(self.job, rank, gen))

    def _create(self, gen: int, data_bytes: int, nflags: int, previous: _Segment | None) -> _Segment:
        lay = _layout(self.nranks, nflags, data_bytes)
        final = self._path(self.rank, gen)
        tmp = final + ".tmp"
        with _linked_lock:
            _linked.update((tmp, final))
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, lay["size"])
            try:
                # Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later.
                os.posix_fallocate(fd, 0, lay["size"])
            except OSError as exc:
                st = os.statvfs(self.dir)
                raise BlinkInternalError(
                    f"cannot allocate {lay['size']} bytes of shared memory in {self.dir} "
                    f"({st.f_bavail * st.f_frsize} bytes free): {exc.strerror}"
                ) from None
            words = np.frombuffer(mmap.mmap(fd, CONTROL_WORDS * 4), dtype=np.uint32)
            if previous is not None:
                words[:CONTROL_WORDS] = previous.words[:CONTROL_WORDS]
            words[W_GEN] = gen
            words[W_PID] = os.getpid()
            words[W_NFLAGS] = nflags
            words[W_DATA_PAGES] = data_bytes // _PAGE
            if previous is None:
                words[W_STATE] = STATE_OPEN
            words[W_MAGIC] = MAGIC
            del words
            seg = _Segment(final, fd, True, self.nranks)
            if previous is not None:
                n = self.flag_base + min(previous.nflags, nflags)
                seg.words[CONTROL_WORDS : n] = previous.words[CONTROL_WORDS : n]
        except BaseException:
            os.close(fd)
            _unlink_quiet(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
        with _linked_lock:
            _linked.discard(tmp)
        return seg

    def _map_peers(self, gen: int, own: _Segment, ctx: WaitContext) -> list[_Segment]:
        """Open every peer's segment of ``gen`` as soon as it exists."""
        segs: list[_Segment | None] = [None] * self.nranks
        segs[self.rank] = own
        delay = 0.0005
        try:
            while True:
                for r in range(self.nranks):
                    if segs[r] is not None:
                        continue
                    try:
                        fd = os.open(self._path(r, gen), os.O_RDONLY)
                    except FileNotFoundError:
                        continue
                    try:
                        segs[r] = _Segment(self._path(r, gen), fd, False, self.nranks)
                    finally:
                        os.close(fd)
                missing = [r for r in range(self.nranks) if segs[r] is None]
                if not missing:
                    return segs  # type: ignore[return-value]
                if self._pids is not None:
                    dead = [r for r in missing if not pid_alive(self._pids[r])]
                    if dead:
                        # A peer that failed first may be one that did create its segment: name every dead
                        # rank, so the one at the origin is among them whichever died second.
                        also = [r for r in range(self.nranks)
                                if r not in dead and r != self.rank and not pid_alive(self._pids[r])]
                        raise BlinkInternalError(
                            f"{ctx.label}: rank {dead[0]} (pid {self._pids[dead[0]]}) died before creating its "
                            f"shared memory segment"
                            + "".join(f"; rank {r} (pid {self._pids[r]}) died too" for r in also)
                        )
                if time.monotonic() >= ctx.deadline:
                    raise BlinkTimeoutError(
                        f"{ctx.label}: rank {self.rank} timed out after {ctx.timeout:g} s waiting for rank "
                        f"{missing[0]} to create its shared memory segment; ranks not arrived: {missing}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        except BaseException:
            for r, seg in enumerate(segs):
                if seg is not None and r != self.rank:
                    seg.close()
            raise

    def _confirm_mapped(self, gen: int, ctx: WaitContext) -> None:
        """Say we mapped every peer's ``gen``; once all peers mapped ours, unlink its name."""
        own = self._segs[self.rank]
        for r in range(self.nranks):
            own.words[W_MAPPED + r] = gen + 1
        futex_wake(own.base + 4 * (W_MAPPED + self.rank))
        for r in range(self.nranks):
            futex_wake(own.base + 4 * (W_MAPPED + r))
        peers = [r for r in range(self.nranks) if r != self.rank]
        self.wait_words(peers, W_MAPPED + self.rank, gen + 1, ctx, "segment mapping")
        _unlink_quiet(self._path(self.rank, gen))
        self._gen = gen

    def _cleanup_dead_peers(self) -> None:
        """Unlink names a dead peer created but could not unlink itself."""
        if self._pids is None and not self._segs:
            return
        for r in range(self.nranks):
            if r == self.rank:
                continue
            pid = self._pids[r] if self._pids is not None else self.peer_pid(r)
            if not pid_alive(pid):
                for gen in (self._gen, self._gen + 1):
                    path = self._path(r, gen)
                    for p in (path, path + ".tmp"):
                        try:
                            os.unlink(p)
                        except OSError:
                            pass

    # -- primitives ------------------------------------------------------------
    def load(self, rank: int, word: int) -> int:
        return int(self._segs[rank].words[word])

    def store(self, word: int, value: int) -> None:
        segs = self._segs
        own = segs[self.rank]
        own.words[word] = value
        # Wake only a peer that says it sleeps on this very word: a FUTEX_WAKE
        # costs a system call, and often a preemption, even when nobody sleeps.
        token = (self.rank + 1) << 24 | word  # sleep_token(self.rank, word), inlined: every flag store runs this
        _fence()
        for r in self._peers:
            if segs[r].words[W_SLEEP] == token:
                futex_wake(own.base + 4 * word)
                return

    def block(self, rank: int, word: int, seen: int, timeout: float) -> None:
        own = self._segs[self.rank]
        own.words[W_SLEEP_SEEN] = seen  # before the token: a reader of both sees a matching pair
        own.words[W_SLEEP] = sleep_token(rank, word)
        _fence()
        seg = self._segs[rank]
        try:
            if int(seg.words[word]) == seen:
                # The kernel re-reads the word under its futex lock: no post is lost.
                futex_wait(seg.base + 4 * word, seen, timeout)
        finally:
            own.words[W_SLEEP] = 0

    def native_layout(self) -> tuple[list[int], list[int]] | None:
        segs = self._segs
        return [seg.base for seg in segs], [seg.base + seg.layout["meta0"] for seg in segs]

    @property
    def generation(self) -> int:  # type: ignore[override]
        return self._gen

    def write_region(self, region: str, data: bytes) -> None:
        own = self._segs[self.rank]
        off = own.layout[region]
        own.mm[off : off + len(data)] = data

    def read_region(self, rank: int, region: str, length: int) -> bytes:
        seg = self._segs[rank]
        off = seg.layout[region]
        return bytes(seg.mm[off : off + length])

    def peer_alive(self, rank: int) -> bool:
        return pid_alive(self.peer_pid(rank))

    def peer_pid(self, rank: int) -> int:
        return int(self._segs[rank].words[W_PID])

    def data(self, rank: int) -> np.ndarray:
        return self._segs[rank].data

    def eager(self, rank: int, slot: int) -> np.ndarray:
        return self._segs[rank].eager[slot]

    def data_capacity(self) -> int:
        return int(self._segs[self.rank].data.size)

    def flag_capacity(self) -> int:
        return self._segs[self.rank].nflags

    def reserve(self, data_bytes: int, nflags: int, ctx: WaitContext) -> bool:
        cap, fcap = self.data_capacity(), self.flag_capacity()
        if data_bytes <= cap and nflags <= fcap:
            return False
        # Grow geometrically so that a job's sizes settle after a few generations.
        new_cap = cap
        while new_cap < data_bytes:
            new_cap *= 2
        new_fcap = fcap
        while new_fcap < nflags:
            new_fcap *= 2
        gen = self._gen + 1
        old = self._segs
        with _CleanupSignals():
            own = self._create(gen, new_cap, new_fcap, old[self.rank])
            self.store(W_READY_GEN, gen)  # in the old segment, which the peers watch
            try:
                peers = [r for r in range(self.nranks) if r != self.rank]
                self.wait_words(peers, W_READY_GEN, gen, ctx, "buffer growth")
                self._segs = self._map_peers(gen, own, ctx)
                self._confirm_mapped(gen, ctx)
            except BaseException:
                if self._segs is not old:
                    for r, seg in enumerate(self._segs):
                        if r != self.rank:
                            seg.close()
                self._segs = old
                own.close()
                _unlink_quiet(self._path(self.rank, gen))
                self._cleanup_dead_peers()
                raise
        # Every peer finished the previous collective (its metadata for this one
        # is posted), so nobody reads the old buffers any more.
        for seg in old:
            seg.close()
        return True

    def abort(self, exc: BaseException) -> None:
        super().abort(exc)
        try:
            self._cleanup_dead_peers()
        except Exception:  # pragma: no cover
            pass

    def _release(self) -> None:
        try:
            self._cleanup_dead_peers()
        except Exception:  # pragma: no cover
            pass
        for seg in self._segs:
            seg.close()
        self._segs = []
        for gen in (self._gen, self._gen + 1):
            _unlink_quiet(self._path(self.rank, gen))
