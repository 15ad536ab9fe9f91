"""The GPU executor: each collective is one CUDA graph launch per piece, host work O(1).

Same contract as the CPU :class:`~blink_horovod.runtime.executor.Executor`
(``collective(label, checked, extras, arr, dtype, op, build)`` with
:class:`~blink_horovod.runtime.executor.Piece` objects), but ``arr`` is a
CUDA tensor and the call returns once the work is *launched* on ``stream``
(CuPy's current stream by default), as NCCL does.  Blink, section 4: the
program's chunks move over per-link streams and are reduced on the receiving
GPU; here the whole program of a (piece, dtype, op) is captured once per epoch
residue as a CUDA graph (:mod:`.lowering`, :mod:`.graph`), so a collective
costs the metadata check plus one ``cudaGraphLaunch`` per piece, whatever the
number of chunks and trees (no per-chunk host work on
GPUs).

Memory: one ``cudaMalloc`` per rank holds its flag words and its data
buffer; its IPC handle travels to the peers in the control transport's
metadata slots (:class:`~blink_horovod.runtime.transport.Transport`, here
used only for metadata, aborts and liveness), and every peer maps it with
``cudaIpcOpenMemHandle``, also when all ranks share one GPU.  Buffers grow by
generations at a point where every rank's device is idle.

Host-side waits (argument slot reuse, buffer growth, close) poll CUDA events
with the collective's deadline and check the peers between polls: a dead or
failed peer raises, a stuck device raises ``BlinkTimeoutError``.  A failing
rank sets every flag word it can reach to all-ones, so that graphs blocked on
them drain instead of hanging their processes.

``BLINK_FAULT`` hooks are CPU-only (no per-op host code runs here).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...config import GPU_LAUNCH_MODES
from ...errors import BlinkInternalError, BlinkTimeoutError, ConfigError
from .. import metadata
from ..dtypes import check_op, numpy_dtype
from ..executor import Piece
from ..transport import STATE_CLOSED, W_STATE, Transport, WaitContext
from .device import device_pointer
from .fused import ARGS_SLOT, META_WORDS, PERSISTENT_IDLE_S, PERSISTENT_SLOTS, STOP_BIT
from .lowering import DONE_WORD, RESIDUES, Lowered, epoch_value, lower, plain_runs

__all__ = ["GPU_MAX_PIECE_BYTES", "GpuExecutor"]

log = logging.getLogger("blink_horovod.runtime")

GPU_MAX_PIECE_BYTES = 1 << 30  # the communicator's piece size on GPUs (one graph launch per piece)
_INITIAL_BYTES = 1 << 20
_INITIAL_WORDS = 4096
_PAGE = 4096
_SENT = 16  # launches whose metadata payload is kept for a device-found mismatch
_BELLS = 256  # bell words of persistent launches (a ring: one word per launch)


class _Segment:
    """Own allocation: ``base`` = flag words, then the data buffer at ``base + flag_bytes``."""

    def __init__(self, base: int, flag_bytes: int, data_bytes: int) -> None:
        self.base, self.flag_bytes, self.data_bytes = base, flag_bytes, data_bytes

    @property
    def words(self) -> int:
        return self.flag_bytes // 4


class GpuExecutor:
    """Executes collectives of rank ``transport.rank`` on CUDA device ``device``.

    Parameters
    ----------
    transport : Transport
        Control plane of the server's ranks (metadata, aborts, liveness); its
        data buffers are not used.
    timeout, stall : float
        ``BLINK_TIMEOUT_SECONDS`` and ``BLINK_STALL_CHECK_SECONDS``.
    device : int, optional
        CUDA device index; default ``rank % device_count`` (N ranks on one GPU
        all use device 0).
    max_graphs : int
        Executable graphs kept (three per program, dtype and op).
    flag_ops : str, optional
        ``BLINK_GPU_FLAGS`` (default: the variable, else ``auto``); see :func:`flag_mode`.
    """

    fuses_average = True  # stage_out divides by n: the communicator must not finish averages itself

    def __init__(self, transport: Transport, timeout: float, stall: float, device: int | None = None,
                 fault: str | None = None, max_graphs: int = 768, cuda: Any = None,
                 flag_ops: str | None = None, fused_launch: str | None = None) -> None:
        self.t = transport
        self.rank, self.nranks = transport.rank, transport.nranks
        self.timeout, self.stall = timeout, stall
        if fault:
            log.warning("BLINK_FAULT=%s is ignored by the GPU executor (CPU runtime only)", fault)
        if cuda is None:  # the real device; tests may pass an emulated one with the same methods
            from .device import Cuda, device_count

            ndev = device_count()
            cuda = Cuda(self.rank % ndev if device is None else device,
                        flag_ops=flag_mode(flag_ops, self.nranks, ndev))
        else:
            ndev = 1  # an injected device (virtual ranks): every rank on it
        self.cuda = cuda
        if fused_launch is None:
            from ...config import load_config

            fused_launch = load_config().gpu_launch
        if fused_launch not in GPU_LAUNCH_MODES:  # a fused program as a one-node graph, or by cuLaunchKernel
            raise ConfigError(f"fused_launch: expected one of {', '.join(GPU_LAUNCH_MODES)}, got {fused_launch!r}")
        self.fused_launch = fused_launch
        # key -> everything a repeat of that collective needs (:meth:`replay`)
        self._replays: dict[Any, tuple] = {}
        self.replays = 0
        self._ranks_on_device = -(-self.nranks // max(1, ndev))
        # Waits for the device spin first where every rank of the server has a core of its own, as CUDA's
        # default schedule does (spin while contexts <= cores, else yield): a thread that slept through a
        # millisecond-long collective wakes on a cold, down-clocked core, and the next collective's host
        # work then measured 4-5x its warm time on the H200 machine (hosttime test, 64-256 chunks).
        self._spin_s = _SPIN_S if _cores() > self.nranks else 0.0
        self._fused: dict[tuple, tuple[Lowered, Any]] = {}
        self.seq = 0
        self.epoch = 0
        self.failed: BaseException | None = None
        self.max_graphs = max_graphs
        self.chunk_ops = 0
        self.last_run_seconds = 0.0  # device time is not known at return; the tuner gets no rate
        self.last_setup_free = False
        self.last_meta_seconds = 0.0
        self.last_launch_seconds = 0.0
        self.last_wait_seconds = 0.0
        self.last_api_seconds = 0.0  # the launch call itself (fused programs)
        self._waited = 0.0
        self._memo: tuple | None = None
        self._kinds: dict[tuple[str, str | None], tuple[str, int]] = {}
        self.captures = 0
        self._closed = False
        self._seg: _Segment | None = None
        self._peer_base: list[int] = [0] * self.nranks
        self._flags: list[int] = [0] * self.nranks
        self._data: list[int] = [0] * self.nranks
        self._flag_bytes: list[int] = [0] * self.nranks
        self._gen = 0
        self._graphs: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._lowered: dict[tuple, tuple[Any, Lowered]] = {}
        self._modules: dict[str, Any] = {}
        self._streams: list[Any] = []
        self._events: list[int] = []
        c = self.cuda
        # Fused programs report a metadata mismatch here (the first failing epoch), read without a sync.
        self._device_thread = 0
        self._fused_mode = getattr(c, "flag_ops", "") == "fused"
        self._persistent = self._fused_mode and fused_launch == "persistent"
        # Argument slots (ARGS_SLOT bytes: user pointer, metadata fingerprint, epoch), pinned and mapped:
        # one per epoch residue for graphs, whose slot is captured; a ring of PERSISTENT_SLOTS for a
        # persistent kernel, which takes slot epoch % PERSISTENT_SLOTS, so the host may run that many
        # collectives ahead of the device (as far as a CUDA stream's queue lets launches run ahead)
        # instead of waiting for the collective three before.
        self._slots = PERSISTENT_SLOTS if self._persistent else RESIDUES
        self._args_host, self._args_view = c.host_alloc(self._slots * ARGS_SLOT)
        self._args_dev = c.malloc(RESIDUES * ARGS_SLOT)
        self._err_host, self._err_view = c.host_alloc(64)
        self._err_view[:] = 0
        self._seen: set[bytes] = set()
        # ring by epoch: payload of each launch in flight
        self._sent: list[tuple[int, bytes]] = [(0, b"")] * max(_SENT, self._slots)
        self._fp = 0
        self._head = b""
        self._probe_host, self._probe_view = c.host_alloc(8 * max(8, self.nranks))
        self._slot_event = [c.event() for _ in range(RESIDUES)]
        self._slot_used = [False] * RESIDUES
        self._last_event: int | None = None
        self._last_stream: int | None = None
        self._aux = c.stream()
        # Persistent launches (BLINK_GPU_LAUNCH=persistent, fused programs): one kernel runs every collective
        # of a program, each rung by a store to its bell word (mapped host memory, a ring of one word per
        # launch); `_running` is (launch, bell index) of the kernel now running.
        if self._persistent and getattr(c, "shares_context", False):
            raise ConfigError("BLINK_GPU_LAUNCH=persistent: needs one process per rank (virtual ranks share one "
                              "CUDA context, where a device-wide wait would wait for the peers' running kernels)")
        self._bells_host, self._bells_view = c.host_alloc(8 * _BELLS) if self._persistent else (0, None)
        self._bell_first = [0] * _BELLS
        self._launches = 0
        self._running: tuple[Any, int] | None = None
        self._pstream: Any = None
        self._rung = 0  # the last epoch rung, and when (perf_counter)
        self._rung_at = 0.0

    # -- the collective -------------------------------------------------------------
    def collective(self, label: str, checked: Mapping[str, Any], extras: Mapping[str, Any], arr: Any, dtype: str,
                   op: str, build: Callable[[list[dict[str, Any]]], Sequence[Piece]],
                   stream: Any = None, replay_key: Any = None) -> list[dict[str, Any]]:
        """Launch one collective on the CUDA tensor ``arr`` (in place) on ``stream``; see the module docstring.

        ``op`` ``average`` is finished on the device (:attr:`fuses_average`).
        Returns every rank's extras.  ``replay_key``: a hashable name of everything that decides
        this collective's metadata and pieces (the caller's promise); the next call with it may
        then go through :meth:`replay`.
        """
        if self.failed is not None:
            raise BlinkInternalError(f"{label}: this communicator is unusable after an earlier failure: {self.failed}")
        if self._closed:
            raise BlinkInternalError(f"{label}: the GPU executor is closed")
        ctx = WaitContext.start(label, self.timeout, self.stall)
        try:
            me = threading.get_ident()
            if me != self._device_thread:  # CuPy launches on the calling thread's current device
                self.cuda.set_device()
                self._device_thread = me
            t0 = time.perf_counter()
            self.seq += 1
            if self._fused_mode:
                self._check_device_meta(ctx)
                all_extras = self._agree_fused(checked, extras, ctx)
            else:
                all_extras = self._agree(checked, extras, ctx)
            t1 = time.perf_counter()
            pieces = list(build(all_extras))
            if not pieces:
                return all_extras
            kind = self._kinds.get((dtype, op))
            if kind is None:
                kind = self._kinds[(dtype, op)] = (check_op(op) if op is not None else "sum", numpy_dtype(dtype).itemsize)
            op, itemsize = kind
            known = self.captures
            lows = [self._lower(p) for p in pieces]
            need_bytes = max(p.program.count for p in pieces) * itemsize
            need_words = max(lw.nwords for lw in lows) + (META_WORDS if self._fused_mode else 0)
            grew = self._reserve(need_bytes, need_words, ctx)
            sp = self.cuda.stream_pointer(stream)
            base = device_pointer(arr)
            mod = None if getattr(self.cuda, "flag_ops", "") == "fused" else self._module(dtype)
            self._waited = 0.0
            for piece, lw in zip(pieces, lows):
                self.epoch += 1
                residue = self.epoch % RESIDUES
                exe = self._graph(piece, lw, dtype, itemsize, op, residue, mod)
                user = base + (piece.direct * itemsize if piece.direct is not None else 0)
                self._launch(exe, residue, user, sp, ctx)
                self.chunk_ops += len(piece.program.ranks[self.rank])
            self.last_meta_seconds = t1 - t0
            # Host work of the launch part; time blocked on the device (slot reuse) is reported apart.
            self.last_wait_seconds = self._waited
            self.last_launch_seconds = time.perf_counter() - t1 - self._waited
            self.last_setup_free = not grew and self.captures == known
            if replay_key is not None and all(v is None for v in extras.values()):
                self._remember(replay_key, label, dtype, op, pieces, lows, itemsize)
            return all_extras
        except BaseException as exc:
            self.fail(exc)
            raise

    def _remember(self, key: Any, label: str, dtype: str, op: str, pieces: Sequence[Piece],
                  lows: Sequence[Lowered], itemsize: int) -> None:
        """Keep what :meth:`replay` needs to launch this collective again (graphs are looked up then)."""
        runs = []
        for piece, lw in zip(pieces, lows):
            off = piece.direct * itemsize if piece.direct is not None else 0
            keys = tuple((id(lw), dtype, op, r, self._gen) for r in range(RESIDUES))
            runs.append((lw, keys, off, len(piece.program.ranks[self.rank])))
        if len(self._replays) > 4096:
            self._replays.clear()
        self._replays[key] = (self._gen, self._memo, self._fp, self._head, tuple(runs), label)

    def replay(self, key: Any, arr: Any, stream: Any = None) -> bool:
        """Launch again the collective last run with ``replay_key=key``, on ``arr`` (same size, dtype and
        metadata: the key says so); False when it cannot (nothing kept, buffers regrown, a graph of
        the next epoch residue not captured yet, another thread, a failure pending), and the caller
        then takes :meth:`collective`.

        This is the host path of a training step's repeated buckets: no dicts, no program lookups,
        one metadata exchange (graph programs) or none (fused: the device checks the fingerprint),
        then one launch per piece.
        """
        rec = self._replays.get(key)
        if rec is None or rec[0] != self._gen or self.failed is not None or self._closed:
            return False
        if threading.get_ident() != self._device_thread:
            return False
        fused = self._fused_mode
        if fused and self._err_view[0]:
            return False  # a mismatch found on the device: collective() reports it
        graphs = self._graphs
        runs = rec[4]
        e = self.epoch
        exes = []
        for i, (lw, keys, _off, _n) in enumerate(runs):
            hit = graphs.get(keys[(e + 1 + i) % RESIDUES])
            if hit is None or hit[0] is not lw:
                return False
            exes.append(hit[1])
        t0 = time.perf_counter()
        base = device_pointer(arr)
        sp = self.cuda.stream_pointer(stream)
        ctx = WaitContext.start(rec[5], self.timeout, self.stall)
        try:
            self.seq += 1
            memo = rec[1]
            self._memo = memo
            if fused:
                self._fp, self._head = rec[2], rec[3]
            else:
                payload = memo[2]
                payloads = self.t.exchange_meta(self.seq, payload, ctx)
                if any(p != payload for p in payloads):
                    metadata.check_agreement(payloads, self.seq)  # raises, naming ranks and fields
            t1 = time.perf_counter()
            self._waited = 0.0
            for (lw, keys, off, nops), exe in zip(runs, exes):
                self.epoch += 1
                self._launch(exe, self.epoch % RESIDUES, base + off, sp, ctx)
                self.chunk_ops += nops
            self.last_meta_seconds = t1 - t0
            self.last_wait_seconds = self._waited
            self.last_launch_seconds = time.perf_counter() - t1 - self._waited
            self.last_setup_free = True
            self.replays += 1
            return True
        except BaseException as exc:
            self.fail(exc)
            raise

    def _agree(self, checked: Mapping[str, Any], extras: Mapping[str, Any], ctx: WaitContext) -> list[dict[str, Any]]:
        """The metadata exchange and check (:mod:`..metadata`), with the encoding and, when every rank sent
        the same bytes, the decoding reused from the previous identical collective (a training step
        repeats its buckets): byte-equal payloads decode to equal values, so this is exact."""
        memo = self._memo
        if memo is not None and memo[0] == checked and memo[1] == extras:
            payload = memo[2]
        else:
            payload = metadata.encode(checked, extras)
            memo = self._memo = (dict(checked), dict(extras), payload, None)
        payloads = self.t.exchange_meta(self.seq, payload, ctx)
        if all(p == payload for p in payloads):
            if memo[3] is None:
                decoded = metadata.check_agreement(payloads, self.seq)[0]
                memo = self._memo = (memo[0], memo[1], payload, decoded)
            return [dict(memo[3]) for _ in payloads]
        return metadata.check_agreement(payloads, self.seq)

    def _agree_fused(self, checked: Mapping[str, Any], extras: Mapping[str, Any], ctx: WaitContext) -> list[dict[str, Any]]:
        """Metadata of a fused program: checked on the device (the kernel's prologue, :mod:`.fused`), so
        the host posts a fingerprint and waits for nobody.

        The host exchange (:meth:`_agree`) still runs where the device cannot stand in: the first
        collective of each metadata (every rank sees the same history, so every rank takes it: plans
        ride along there) and calls whose extras carry values (``allgather_object``, ``barrier``).
        Extras that hold a value on some ranks only, for metadata seen before, would break this rule;
        none of Blink's callers sends such (the GPU executor reports no rates).  A mismatch on that
        first call is
        found by the exchange; later ones by the kernel, before any byte moves, and reported by
        :meth:`_check_device_meta` at this rank's next call or wait, naming the ranks and fields.
        """
        memo = self._memo
        if memo is None or memo[0] != checked or memo[1] != extras:
            payload = metadata.encode(checked, extras)
            self._memo = (dict(checked), dict(extras), payload, None)
            import hashlib

            # Over the checked fields only: extras differ between ranks by design (rank 0's plan).
            self._head = metadata.checked_part(payload)
            self._fp = int.from_bytes(hashlib.blake2b(self._head, digest_size=8).digest(), "little") or 1
        if self._head not in self._seen or any(v is not None for v in extras.values()):
            # Every rank decides alike: by the checked fields, and by extras that carry a value on every
            # rank (allgather_object's objects) or only where the metadata is new (rank 0's plan).
            out = self._agree(checked, extras, ctx)
            if len(self._seen) > 65536:
                self._seen.clear()
            self._seen.add(self._head)
            return out
        return [dict(extras) for _ in range(self.nranks)]

    def _check_device_meta(self, ctx: WaitContext) -> None:
        """Raise the mismatch a fused program found on the device (every rank finds the same epoch):
        the ranks exchange that epoch's metadata on the host, and :mod:`..metadata` names who differs."""
        bad = int(self._err_view[0])
        if not bad:
            return
        epoch, payload = self._sent[bad % len(self._sent)]
        if epoch != bad:
            payload = b""
        seq = (1 << 31) + bad  # above every sequence number used before, the same on every rank (a 32-bit word)
        payloads = self.t.exchange_meta(seq, payload, ctx)
        metadata.check_agreement(payloads, seq)
        raise BlinkInternalError(
            f"{ctx.label}: the device found different metadata among the ranks at epoch {bad}, but the ranks' "
            "payloads agree on the host"
        )

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait (with peer checks and a deadline) until this rank's launched work is done."""
        if self._last_event is None and not (self._fused_mode and self._last_stream is not None):
            return
        ctx = WaitContext.start("synchronize", self.timeout if timeout is None else timeout, self.stall)
        try:
            if self._fused_mode:
                done, epoch = self._err_view, self.epoch
                self._wait_until(lambda: int(done[1]) >= epoch, ctx, "launched collectives")
                self._check_device_meta(ctx)
            else:
                self._wait_event(self._last_event, ctx, "launched collectives")
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        """Mark this rank failed, tell the peers, and unblock graphs waiting on flags."""
        if self.failed is None:
            self.failed = exc
            self.t.abort(exc)
            self._unblock()

    # -- pieces -> lowered commands -> graphs ---------------------------------------------
    def _lower(self, piece: Piece) -> Lowered:
        program = piece.program
        if program.nranks != self.nranks:
            raise BlinkInternalError(f"program for {program.nranks} ranks run on {self.nranks} ranks")
        if piece.direct is not None:
            si, so = plain_runs(program, piece.has_input, piece.wants_output)
        else:
            si, so = tuple(map(tuple, piece.stage_in)), tuple(map(tuple, piece.stage_out))
        key = (id(program), si, so)
        hit = self._lowered.get(key)
        if hit is not None and hit[0] is program:
            return hit[1]
        lw = lower(program, self.rank, si, so)
        if len(self._lowered) > 4096:
            self._lowered.clear()
        self._lowered[key] = (program, lw)
        return lw

    def preload(self, dtype: str) -> Any:
        """Compile and load ``dtype``'s module of the current flag mode now (virtual ranks load every
        module before any rank launches: loading may wait for the whole context)."""
        if getattr(self.cuda, "flag_ops", "") != "fused":
            if self.cuda.flag_ops == "kernel":
                self.cuda._flag_kernels()
            return self._module(dtype)
        from .fused import fused_source

        mkey = "fused:" + dtype
        mod = self._modules.get(mkey)
        if mod is None:
            mod = self._modules[mkey] = self.cuda.module(fused_source(dtype))
        return mod

    def _module(self, dtype: str) -> Any:
        mod = self._modules.get(dtype)
        if mod is None:
            from .kernels import device_source

            mod = self._modules[dtype] = self.cuda.module(device_source(dtype))
        return mod

    def _graph(self, piece: Piece, lw: Lowered, dtype: str, itemsize: int, op: str, residue: int, mod: Any) -> int:
        key = (id(lw), dtype, op, residue, self._gen)
        hit = self._graphs.get(key)
        if hit is not None and hit[0] is lw:
            self._graphs.move_to_end(key)
            return hit[1]
        if getattr(self.cuda, "flag_ops", "") == "fused":
            exe = self._fused_graph(lw, dtype, itemsize, op, residue)
            self.captures += 1
            self._cache_graph(key, lw, exe)
            return exe
        from .graph import Memory, capture

        while len(self._streams) < lw.nstreams:
            self._streams.append(self.cuda.stream())
        while len(self._events) < lw.nevents:
            self._events.append(self.cuda.event())
        assert self._seg is not None
        mem = Memory(self._flags, self._data, self._seg.words, self._args_host + ARGS_SLOT * residue,
                     self._args_dev + ARGS_SLOT * residue)
        self.cuda.set_device()
        exe = capture(self.cuda, lw, mem, residue, dtype, itemsize, op, mod, self._streams, self._events)
        self.captures += 1
        self._cache_graph(key, lw, exe)
        return exe

    def _fused_graph(self, lw: Lowered, dtype: str, itemsize: int, op: str, residue: int) -> int:
        """The program as one kernel (:mod:`.fused`): encoded once per (lowering, itemsize, buffers)."""
        from .fused import FusedProgram, block_cap, blocks_per_group

        assert self._seg is not None
        fkey = (id(lw), itemsize, self._gen)
        hit = self._fused.get(fkey)
        if hit is None or hit[0] is not lw:
            blocks = blocks_per_group(lw.nstreams, self._ranks_on_device, int(getattr(self.cuda, "sms", 132)),
                                      block_cap(lw.count * itemsize))
            fp = FusedProgram(self.cuda, lw, self._flags, self._data, self._seg.words - META_WORDS, itemsize, blocks,
                              self._aux)
            if hit is not None:
                hit[1].free()
            hit = self._fused[fkey] = (lw, fp)
        mod = self.preload(dtype)
        if self._persistent:  # one object for the three residues: the kernel picks the slot by epoch
            return hit[1].persistent(self._args_host, dtype, op, mod, err=self._err_host,
                                     meta_word=self._seg.words - META_WORDS)
        if self.fused_launch == "kernel":
            return hit[1].direct(residue, self._args_host + ARGS_SLOT * residue, dtype, op, mod,
                                 err=self._err_host, meta_word=self._seg.words - META_WORDS)
        if not self._streams:
            self._streams.append(self.cuda.stream())
        self.cuda.set_device()
        return hit[1].capture(residue, self._args_host + ARGS_SLOT * residue, self._args_dev + ARGS_SLOT * residue,
                              dtype, op, mod, self._streams[0], err=self._err_host,
                              meta_word=self._seg.words - META_WORDS)

    def _cache_graph(self, key: tuple, lw: Lowered, exe: int) -> None:
        self._graphs[key] = (lw, exe)
        if len(self._graphs) > self.max_graphs:
            # Destroying an exec that may still run is not allowed: drain first (rare).
            self._drain(WaitContext.start("graph cache eviction", self.timeout, self.stall))
            while len(self._graphs) > self.max_graphs // 2:
                _, (_, old) = self._graphs.popitem(last=False)
                self.cuda.destroy_exec(old)

    def _launch_fused(self, exe: int, residue: int, user: int, stream: int, ctx: WaitContext) -> None:
        """Host work of one fused piece: one CUDA call (a persistent kernel: a ring, :meth:`_ring`).  The
        kernel posts the end of its epoch in mapped host memory (``_err_view[1]``), so no event is recorded
        or queried: the argument slot of ``epoch - slots`` is free once that word reached it, and a launch
        on another stream than the last waits for the last epoch (a rank's programs must run one after the
        other; a persistent kernel runs its epochs in order anyway)."""
        done = self._err_view
        need = self.epoch - self._slots
        if self._last_stream is not None and stream != self._last_stream and not self._persistent:
            need = self.epoch - 1
        self._timed_wait(lambda: int(done[1]) >= need, ctx, f"collective {need} on this rank's GPU")
        slot = (ARGS_SLOT // 8) * (self.epoch % self._slots)  # the residue, but for persistent kernels
        view = self._args_view
        view[slot] = user
        view[slot + 1] = self._fp
        view[slot + 2] = self.epoch
        sent = self._sent
        sent[self.epoch % len(sent)] = (self.epoch, self._memo[2] if self._memo is not None else b"")
        a0 = time.perf_counter()
        if self._persistent:
            self._ring(exe, stream, ctx)
            self.last_api_seconds = time.perf_counter() - a0
            return
        self.cuda.launch(exe, stream)
        self.last_api_seconds = time.perf_counter() - a0
        self._last_stream = stream

    def _ring(self, exe: Any, stream: int, ctx: WaitContext) -> None:
        """A persistent launch: this epoch runs once the work queued on ``stream`` is done (host-ordered:
        one stream query, a wait only if it is not) and the bell word holds it; the kernel runs epochs in
        order, so a collective on another stream needs no wait for the last one.  A new program first
        stops the running kernel (it exits after the epochs rung on it) and starts its own behind it."""
        c = self.cuda
        self._timed_wait(lambda: c.stream_done(stream), ctx, "the work queued before it on the caller's stream")
        run = self._running
        epoch = self.epoch
        if run is None or run[0] is not exe:
            self._start_persistent(exe, ctx)
            now = time.perf_counter()
        else:
            prev = self._rung
            self._bells_view[run[1]] = epoch
            now = time.perf_counter()
            # Taken for sure if the kernel was still busy with an earlier epoch after this store (it reads
            # the bell again when done), or if it cannot have idled half its limit yet; else see which.
            if now - self._rung_at >= PERSISTENT_IDLE_S / 2 and int(self._err_view[1]) >= prev:
                self._confirm_ring(exe, run, epoch, ctx)
        self._rung, self._rung_at = epoch, now

    def _confirm_ring(self, exe: Any, run: tuple[Any, int], epoch: int, ctx: WaitContext) -> None:
        """The kernel either acknowledges ``epoch`` (err[3]) or has left idle (err[2] holds its first
        epoch) without it; then a new launch takes it."""
        err, first = self._err_view, self._bell_first[run[1]]
        self._timed_wait(lambda: int(err[3]) >= epoch or int(err[2]) >= first, ctx, "a persistent kernel's answer")
        if int(err[3]) < epoch:
            self._running = None
            self._start_persistent(exe, ctx)

    def _start_persistent(self, exe: Any, ctx: WaitContext) -> None:
        """Launch ``exe`` behind the running kernel (stopped first) with the current epoch rung."""
        self._stop_persistent()
        k = self._launches
        slot = k % _BELLS
        old = self._bell_first[slot]
        done = self._err_view
        if k >= _BELLS:  # the launch that had this word must have left (rare wait)
            self._timed_wait(lambda: int(done[2]) >= old, ctx, "an earlier persistent launch to exit")
        self._bells_view[slot] = self.epoch
        if self._pstream is None:
            self._pstream = self.cuda.stream()
        exe.start(self._pstream.ptr, self._bells_host + 8 * slot, self.epoch)
        self._bell_first[slot] = self.epoch
        self._launches = k + 1
        self._running = (exe, slot)
        self._last_stream = self._pstream.ptr

    def _stop_persistent(self) -> None:
        """Tell the running persistent kernel to exit once the epochs rung on it are done."""
        run = self._running
        if run is not None:
            self._running = None
            self._bells_view[run[1]] = int(self._bells_view[run[1]]) | STOP_BIT

    def _launch(self, exe: int, residue: int, user: int, stream: int, ctx: WaitContext) -> None:
        """Host work of one piece: O(1) calls, whatever the program."""
        if self._fused_mode:
            self._launch_fused(exe, residue, user, stream, ctx)
            return
        ev = self._slot_event[residue]
        if self._slot_used[residue]:
            self._timed_wait(lambda: self.cuda.done(ev), ctx, "the collective launched three pieces ago")
        self._args_view[(ARGS_SLOT // 8) * residue] = user
        if self._last_event is not None:
            # Graphs of one rank must run in launch order (the barrier's three residues rely on it).
            # Redundant on the same stream, but stream pointers cannot tell: a destroyed stream's
            # address may come back as a new stream's.  (Always joined: querying first costs a call too.)
            self.cuda.join(stream, self._last_event)
        self.cuda.launch(exe, stream)
        self.cuda.record(ev, stream)
        self._slot_used[residue] = True
        self._last_event, self._last_stream = ev, stream

    # -- memory ---------------------------------------------------------------------------
    def _reserve(self, need_bytes: int, need_words: int, ctx: WaitContext) -> bool:
        """Collective: every rank's segment holds ``need_bytes`` of data and ``need_words`` flag words."""
        seg = self._seg
        if seg is not None and need_bytes <= seg.data_bytes and need_words <= seg.words:
            return False
        data_bytes = seg.data_bytes if seg is not None else _INITIAL_BYTES
        while data_bytes < need_bytes:
            data_bytes *= 2
        words = seg.words if seg is not None else _INITIAL_WORDS
        while words < need_words:
            words *= 2
        flag_bytes = -(-4 * words // _PAGE) * _PAGE
        c = self.cuda
        self._drain(ctx)  # own device idle: no graph of ours reads any old buffer any more
        base = c.malloc(flag_bytes + data_bytes)
        try:
            c.memset(base, 0, flag_bytes)
            c.copy_to_device(base + 4 * DONE_WORD, np.array([epoch_value(self.epoch)], np.uint32))
            if self._fused_mode:  # as if the last epoch's program had posted its metadata
                c.copy_to_device(base + flag_bytes - 4 * META_WORDS, np.array([epoch_value(self.epoch)], np.uint32))
            c.synchronize()
            handle = c.ipc_handle(base)
            self.seq += 1
            mine = json.dumps({"h": handle.hex(), "fb": flag_bytes, "db": data_bytes, "g": self._gen + 1})
            payloads = self.t.exchange_meta(self.seq, mine.encode(), ctx)
        except BaseException:
            c.free(base)
            raise
        # Every peer posted its new handle after draining its device: the old buffers are unused.
        self._release_memory()
        self._gen += 1
        self._seg = _Segment(base, flag_bytes, data_bytes)
        for q, raw in enumerate(payloads):
            info = json.loads(raw.decode())
            if info["fb"] != flag_bytes or info["db"] != data_bytes:
                raise BlinkInternalError(
                    f"{ctx.label}: rank {q} grew its GPU buffer to {info['db']} bytes/{info['fb']} flag bytes, "
                    f"rank {self.rank} to {data_bytes}/{flag_bytes}"
                )
            ptr = base if q == self.rank else c.ipc_open(bytes.fromhex(info["h"]))
            self._peer_base[q] = ptr
            self._flags[q] = ptr
            self._data[q] = ptr + flag_bytes
            self._flag_bytes[q] = flag_bytes
        return True

    def _release_memory(self) -> None:
        for _, exe in self._graphs.values():
            self.cuda.destroy_exec(exe)
        self._graphs.clear()
        for _, fp in self._fused.values():
            fp.free()
        self._fused.clear()
        for q, ptr in enumerate(self._peer_base):
            if ptr and q != self.rank:
                self.cuda.ipc_close(ptr)
            self._peer_base[q] = 0
        if self._seg is not None:
            self.cuda.free(self._seg.base)
            self._seg = None

    # -- waiting ----------------------------------------------------------------------------
    def _drain(self, ctx: WaitContext) -> None:
        if self._persistent:
            self._stop_persistent()  # the event below completes when the kernel has exited
        if self._fused_mode and self._last_stream is not None:
            # The kernels themselves must have exited (memory is freed after this): an event, once.
            self.cuda.record(self._slot_event[0], self._last_stream)
            self._last_event = self._slot_event[0]
        if self._last_event is not None:
            self._wait_event(self._last_event, ctx, "earlier collectives")

    def _timed_wait(self, ready: Callable[[], bool], ctx: WaitContext, what: str) -> None:
        """:meth:`_wait_until`, its time added to ``_waited`` (reported apart from host work); nothing
        when ``ready()`` already holds, the usual case."""
        if ready():
            return
        w0 = time.perf_counter()
        self._wait_until(ready, ctx, what)
        self._waited += time.perf_counter() - w0

    def _wait_event(self, ev: int, ctx: WaitContext, what: str) -> None:
        """Poll ``ev`` until done; between polls check the peers and the deadline."""
        c = self.cuda
        self._wait_until(lambda: c.done(ev), ctx, what)

    def _wait_until(self, ready: Callable[[], bool], ctx: WaitContext, what: str) -> None:
        """Poll ``ready()``; between polls check the peers, the device's mismatch word and the deadline."""
        if ready():
            return
        started = time.monotonic()
        next_check = started + 0.05
        next_warn = started + ctx.stall
        spin_until = started + self._spin_s
        delay = 2e-5
        while not ready():
            now = time.monotonic()
            if self._fused_mode and self._err_view[0]:
                self._check_device_meta(ctx)
            if now < spin_until and now < next_check:
                continue
            if now >= next_check:
                self.t.check_peers(ctx)
                for q in range(self.nranks):
                    if q != self.rank and not self.t.peer_alive(q):
                        raise BlinkInternalError(
                            f"{ctx.label}: rank {q} (pid {self.t.peer_pid(q)}) died; rank {self.rank}'s GPU waits "
                            f"for it ({what})"
                        )
                next_check = now + 0.05
            if now >= ctx.deadline:
                raise BlinkTimeoutError(
                    f"{ctx.label}: rank {self.rank} timed out after {ctx.timeout:g} s waiting for its GPU to finish "
                    f"{what} (a peer's device work never arrived; BLINK_TIMEOUT_SECONDS={ctx.timeout:g})"
                )
            if now >= next_warn:
                log.warning("%s: rank %d's GPU has waited %.0f s for %s", ctx.label, self.rank, now - started, what)
                next_warn = now + ctx.stall
            time.sleep(delay)
            # Short sleeps first: two more graphs are queued behind this one, and a late wake-up
            # would let the device run dry on small messages; back off once the wait is long.
            delay = min(delay * 2, 5e-5 if now - started < 0.005 else 1e-3)

    def _peer_done_words(self) -> list[int]:
        """Every rank's DONE word, read through the mappings on a private stream (never blocks on
        the user's streams)."""
        c, aux = self.cuda, self._aux.ptr
        for q in range(self.nranks):
            if self._flags[q]:
                c.copy_async(self._probe_host + 8 * q, self._flags[q] + 4 * DONE_WORD, 4, aux, kind="d2h")
        self._aux.synchronize()
        return [int(self._probe_view[q] & 0xFFFFFFFF) for q in range(self.nranks)]

    def _unblock(self) -> None:
        """Best effort after a failure: all-ones in every flag word this rank maps (own and peers'),
        so that graphs waiting on them run to the end instead of hanging (and a persistent kernel exits)."""
        if self._persistent:
            self._stop_persistent()
        try:
            for q in range(self.nranks):
                if self._flags[q]:
                    self.cuda.memset_async(self._flags[q], 0xFF, self._flag_bytes[q], self._aux.ptr)
        except Exception as exc:  # noqa: BLE001 - the failure being reported matters more
            log.debug("unblocking flags failed: %s", exc)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for this rank's work and for the peers' last reads of its buffer, then free everything."""
        if self._closed:
            return
        self._closed = True
        idle = True
        try:
            ctx = WaitContext.start("close", min(self.timeout, 60.0), self.stall)
            try:
                if self.failed is not None:
                    self._unblock()
                    idle = self._quiet_drain(5.0)
                else:
                    self._drain(ctx)
                    if self._fused_mode:
                        self._check_device_meta(ctx)
                    if self._seg is not None:
                        self._await_peers_done(ctx)
            except BaseException as exc:  # noqa: BLE001
                log.warning("rank %d: GPU work did not drain at close (%s)", self.rank, exc)
                self._unblock()
                idle = self._quiet_drain(5.0)
            if idle:
                self._release_memory()
                for ev in self._events + self._slot_event:
                    self.cuda.destroy_event(ev)
                self.cuda.free(self._args_dev)
                self.cuda.free_host(self._args_host)
                self.cuda.free_host(self._err_host)
                self.cuda.free_host(self._probe_host)
                if self._bells_host:
                    self.cuda.free_host(self._bells_host)
            else:
                log.warning("rank %d: device still busy; CUDA memory is left to process exit", self.rank)
        finally:
            self._events, self._streams = [], []
            self.t.close()

    def _quiet_drain(self, seconds: float) -> bool:
        """Whether this rank's launched work finishes within ``seconds`` (no peer checks: after a failure)."""
        if self._fused_mode and self._last_stream is not None:
            try:
                self.cuda.record(self._slot_event[0], self._last_stream)
                self._last_event = self._slot_event[0]
            except Exception:  # noqa: BLE001 - a faulted context: nothing more to wait for
                return False
        if self._last_event is None:
            return True
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                if self.cuda.done(self._last_event):
                    return True
            except Exception:  # noqa: BLE001 - a faulted context: nothing more to wait for
                return False
            time.sleep(1e-3)
        return False

    def _await_peers_done(self, ctx: WaitContext) -> None:
        """Peers read this rank's buffer until their DONE of the last epoch: wait for it (or their exit)."""
        want = epoch_value(self.epoch)
        while True:
            words = self._peer_done_words()
            pending = [q for q in range(self.nranks) if q != self.rank and words[q] != want
                       and self.t.load(q, W_STATE) != STATE_CLOSED and self.t.peer_alive(q)]
            if not pending:
                return
            if time.monotonic() >= ctx.deadline:
                raise BlinkTimeoutError(f"close: ranks {pending} did not finish epoch {self.epoch}")
            time.sleep(1e-3)

    @property
    def host_ordered(self) -> bool:
        """Collectives start after the caller's stream is done and end at :meth:`synchronize`
        (``BLINK_GPU_LAUNCH=persistent``), not in the caller's stream order."""
        return self._persistent

    @property
    def device(self) -> int:
        return self.cuda.device


def check_device_arg(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device: expected 'cpu' or 'cuda', got {device!r}")


_SPIN_S = 0.05  # longest busy wait before sleeping


def _cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def flag_mode(requested: str | None, nranks: int, ndevices: int) -> str:
    """How this server's ranks signal each other on the device (``BLINK_GPU_FLAGS``).

    ``auto``: ``memop`` (stream memory operations) when processes share a GPU
    (``nranks > ndevices``): a spinning kernel keeps its process's context busy,
    so the driver's time-slicing makes every cross-process wait cost a slice,
    while a blocked stream wait lets the other context run at once (measured on
    the H200 machine: ~10 us round trips, against ~4.5 ms with spinning kernels).
    Otherwise, and under MPS (one server context: no time-slicing between the
    ranks), ``fused``: the whole program as one kernel (:mod:`.fused`), one
    CUDA call per collective and the metadata checked on the device (measured
    under MPS on the H200, 2 ranks: ~60 us per small allreduce, 2-5 us of
    metadata work on the host, against ~80 us and 20-50 us with ``kernel``,
    graphs of one-thread flag kernels, which reach a higher busbw at 64 MB:
    157 GB/s against 81).
    """
    if requested is None:
        from ...config import load_config

        requested = load_config().gpu_flags
    if requested == "auto":
        return "memop" if nranks > ndevices and not mps_active() else "fused"
    if requested not in ("kernel", "memop", "fused"):
        raise ConfigError(f"BLINK_GPU_FLAGS: expected auto, kernel, memop or fused, got {requested!r}")
    return requested


def mps_active(env: dict | None = None) -> bool:
    """Whether this process is an MPS client: the MPS control daemon's pipe exists
    (``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``)."""
    import os

    env = os.environ if env is None else env
    return os.path.exists(os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))

