"""The GPU executor: one tree kernel per collective, over the ranks' tensors in place.

Blink (MLSys 2020, section 4) generates one CUDA program per collective that moves each tree's chunks
over the links and reduces them on the receiving GPU.  Here that program is ``trees.cu``, compiled once
per dtype, and a collective is:

1. the metadata exchange through the control transport (shared memory: name, shape, dtype, op, root,
   topology, and where this rank's tensor is: :mod:`.registry`), checked on the host before any byte
   moves, so a disagreement raises the same :class:`~blink_horovod.errors.MismatchError` on every rank;
2. the plan's work tables (:mod:`.work`), cached per (plan, count, dtype);
3. one ``cuLaunchKernel`` on the caller's stream (after the work already queued there, as NCCL's
   collectives are) whose parameters carry the epoch and every rank's tensor and flag words as mapped
   in this process.  The call returns without waiting; :meth:`TreeExecutor.synchronize` waits.

Nothing tests whether a peer shares this GPU to take a shortcut: peers' memory is always reached through
their CUDA IPC mappings.  Where ranks share a GPU only the number of blocks changes: every rank's blocks
must be resident at once (blocks spin on peers' flags), so each rank takes its share of the SMs.

Flags are device words (``trees.cu``); the abort and error words are mapped host memory, so the host
stops its kernel's waits with a plain store and reads a device-found timeout without a CUDA call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import BlinkInternalError, BlinkTimeoutError, ConfigError
from .. import metadata
from ..dtypes import check_op, numpy_dtype
from ..transport import Transport, WaitContext
from . import native_replay
from .work import MAX_ITEMS, MAX_RANKS, Work, make_work

__all__ = ["ARGS_DTYPE", "MAX_BLOCKS", "THREADS", "TreeExecutor", "kernel_name", "kernel_source"]

log = logging.getLogger("blink_horovod.runtime")

THREADS = 512  # BLINK_THREADS in trees.cu
MAX_BLOCKS = 1024  # done[] words per rank
OPS = {"sum": 0, "average": 0, "min": 1, "max": 2, "product": 3}
# trees.cu's phases (1 reduce up the trees, 2 broadcast down) of each kind of collective: the hierarchical
# stages run the allreduce plan's phases apart, so that local rank i's segment crosses servers in between.
PHASES = {"allreduce": 3, "broadcast": 2, "reduce_to_roots": 1, "broadcast_from_roots": 2}
_RED, _FIN, _DONE = 0, MAX_ITEMS, 2 * MAX_ITEMS
FLAG_WORDS = 2 * MAX_ITEMS + MAX_BLOCKS
_TABLES = 64  # work tables kept on the device
_SPIN_S = 0.05

# The kernel's parameter, laid out as struct BlinkArgs in trees.cu.
ARGS_DTYPE = np.dtype([
    ("epoch", "<u8"), ("buf", "<u8", (MAX_RANKS,)), ("flags", "<u8", (MAX_RANKS,)),
    ("items", "<u8"), ("trees", "<u8"), ("timeout_ns", "<u8"), ("ctl", "<u8"),
    ("nitems", "<i4"), ("rank", "<i4"), ("nranks", "<i4"), ("phases", "<i4"),
    ("average_n", "<i4"), ("vec", "<i4"), ("red_word", "<i4"), ("fin_word", "<i4"),
    ("done_word", "<i4"),
], align=True)


def kernel_name(op: str) -> str:
    return f"blink_trees_{check_op(op) if op != 'average' else 'sum'}"


def kernel_source(dtype: str) -> str:
    """The tree kernels of ``dtype`` (one per op), ready for NVRTC."""
    from .kernels import acc_source

    with open(os.path.join(os.path.dirname(__file__), "trees.cu"), encoding="utf-8") as fh:
        body = fh.read()
    tail = "\n".join(f"BLINK_TREES_KERNEL(blink_trees_{op}, {code})"
                     for op, code in (("sum", 0), ("min", 1), ("max", 2), ("product", 3)))
    return acc_source(dtype) + body + "\n" + tail + "\n"


class TreeExecutor:
    """Runs the collectives of rank ``transport.rank`` on its CUDA device (see the module docstring).

    Parameters
    ----------
    transport : Transport
        The server's control plane (metadata, aborts, liveness).
    timeout, stall : float
        ``BLINK_TIMEOUT_SECONDS`` and ``BLINK_STALL_CHECK_SECONDS``.
    device : int, optional
        CUDA device; default the current one.
    sm_share : float, optional
        ``BLINK_GPU_SM_SHARE``: the share of the GPU's block slots the kernels of its ranks take together
        (the smallest of the ranks' settings holds: every rank launches the same grid).  None: 1, or
        :data:`OVERLAP_SHARE` where ranks share a GPU and some rank says ``overlap``.
    overlap : bool
        Compute kernels run beside the collectives (a training step's backward pass under Horovod).
    """

    def __init__(self, transport: Transport, timeout: float, stall: float, device: int | None = None,
                 cuda: Any = None, sharers: int = 1, sm_share: float | None = None,
                 overlap: bool = False) -> None:
        self.t = transport
        self.rank, self.nranks = transport.rank, transport.nranks
        if self.nranks > MAX_RANKS:
            raise ConfigError(f"local_size: {self.nranks} ranks in one server; the GPU executor takes at most "
                              f"{MAX_RANKS}")
        self.timeout, self.stall = timeout, stall
        if cuda is None:
            import cupy

            from .device import Cuda

            cuda = Cuda(int(cupy.cuda.runtime.getDevice()) if device is None else device)
        self.cuda = cuda
        from .registry import Registry

        self.registry = Registry(cuda)
        self.seq = 0
        self.epoch = 0
        self.failed: BaseException | None = None
        self._closed = False
        self.last_meta_seconds = self.last_launch_seconds = 0.0
        # The last native repeat's Call (its ns_* fields: that call's phases), None after a Python one.
        self.last_native: Any = None
        # BLINK_LOG_LEVEL=debug: one line per launch (sequence, epoch, path, size, stream), to compare ranks
        # in a stall; read once, since a repeat's host path is a few microseconds.
        self._trace = log.isEnabledFor(logging.DEBUG)
        self._device_thread = 0
        self._spin_s = _SPIN_S if (os.cpu_count() or 1) > self.nranks else 0.0
        self._modules: dict[str, Any] = {}
        self._tables: OrderedDict[tuple, tuple[Work, int, int]] = OrderedDict()
        self._evicted: list[int] = []
        self._memo: tuple | None = None
        self._replays: dict[Any, _Replay] = {}
        self._decoded: tuple[list[bytes], list[dict[str, Any]]] | None = None
        c = cuda
        self._own_flags = c.malloc(8 * FLAG_WORDS)
        c.memset(self._own_flags, 0, 8 * FLAG_WORDS)
        self._ctl_host, self._ctl_view = c.host_alloc(64)  # [abort, error epoch, what the failed wait awaited]
        self._ctl_view[:] = 0
        self._aux = c.stream()
        # Streams launched on since the last synchronize: their events are recorded there, not per launch.
        self._pending: set[int] = set()
        self._events: dict[int, int] = {}
        self._launched = False
        # Parameter block: one BlinkArgs, passed by value through a void*[1].
        self._args = np.zeros(1, ARGS_DTYPE)
        self._argp = (ctypes.c_void_p * 1)(self._args.ctypes.data)
        self._params = ctypes.addressof(self._argp)
        self._flag_ptrs = [0] * self.nranks
        self._peers = [q for q in range(self.nranks) if q != self.rank]  # a kernel waits on every one of them
        self.blocks = 1
        self._sharers = max(1, int(sharers))
        self._sm_share = None if sm_share is None else float(sm_share)
        self._overlap = bool(overlap)
        self._setup()
        # A repeat's host path in one native call where the transport is shared memory (not threads).
        self._native_path = native_replay.NativeReplay.create(transport, cuda)
        self._native = self._native_path

    # -- setup ---------------------------------------------------------------------------
    def _setup(self) -> None:
        """Exchange flag segments, devices and block counts; map the peers' flags."""
        c = self.cuda
        ctx = WaitContext.start("GPU executor setup", self.timeout, self.stall)
        fn = self._function("float32", "sum")
        per_sm = max(1, c.blocks_per_sm(fn, THREADS))
        mine = {"flags": c.ipc_handle(self._own_flags).hex(), "bus": c.pci_bus_id(), "sms": int(c.sms),
                "per_sm": per_sm, "sharers": self._sharers, "share": self._sm_share,
                "overlap": self._overlap}
        self.seq += 1
        payloads = self.t.exchange_meta(self.seq, metadata.encode({"collective": "gpu setup"}, mine), ctx)
        peers = metadata.check_agreement(payloads, self.seq)
        sharing = sum(1 for e in peers if e["bus"] == mine["bus"])
        # Every rank's blocks must be resident together (they spin on each other's flags): a rank takes
        # its share of the SMs of its GPU.  All ranks launch the same grid (the items are dealt by block
        # index), so the smallest share wins.
        # ``sharers``: the ranks of the whole job that share a GPU here, where the caller knows more than
        # this server's ranks do (servers of a job on one machine, as tests run them).
        self.ranks_on_device = max(max(sum(1 for f in peers if f["bus"] == e["bus"]) for e in peers),
                                   max(int(e.get("sharers", 1)) for e in peers))
        share = _agreed_share(peers, self.ranks_on_device)
        self.blocks = max(1, min(MAX_BLOCKS, int(min(int(e["sms"]) * int(e["per_sm"]) for e in peers) * share)
                                 // self.ranks_on_device))
        for q, e in enumerate(peers):
            self._flag_ptrs[q] = self._own_flags if q == self.rank else c.ipc_open(bytes.fromhex(e["flags"]))
        a = self._args[0]
        a["flags"][: self.nranks] = self._flag_ptrs
        a["rank"], a["nranks"] = self.rank, self.nranks
        a["red_word"], a["fin_word"], a["done_word"] = _RED, _FIN, _DONE
        a["ctl"] = self._ctl_host
        a["timeout_ns"] = int(self.timeout * 1e9)
        log.debug("GPU executor: rank %d, %d ranks on its GPU (%d of them this rank's), %d blocks of %d threads "
                  "(share %g)", self.rank, self.ranks_on_device, sharing, self.blocks, THREADS, share)
        if sharing > 1 and self.rank == 0 and not mps_active():
            log.warning("Blink: %d ranks share GPU %s without MPS: their kernels are time-sliced and every wait for a "
                        "peer costs a slice; start the MPS daemon (nvidia-cuda-mps-control -d) before the job",
                        sharing, mine["bus"])

    def _module(self, dtype: str) -> Any:
        mod = self._modules.get(dtype)
        if mod is None:
            mod = self.cuda.module(kernel_source(dtype))
            # Every op's kernel fetched now: under CUDA's lazy loading a kernel is loaded when first
            # fetched, which may wait for the device -- never while a peer's kernel spins on this rank.
            from .kernels import KERNEL_OPS

            for op in KERNEL_OPS:
                mod.get_function(kernel_name(op))
            self._modules[dtype] = mod
        return mod

    def _function(self, dtype: str, op: str) -> Any:
        return self._module(dtype).get_function(kernel_name(op))

    # -- the collective ----------------------------------------------------------------------
    def collective(self, label: str, checked: Mapping[str, Any], extras: Mapping[str, Any], arr: Any,
                   dtype: str, op: str | None, plan_of: Callable[[list[dict[str, Any]]], Any], kind: str = "allreduce",
                   stream: int | None = None, replay_key: Any = None,
                   known_plan: tuple[Any, str] | None = None) -> list[dict[str, Any]]:
        """Launch one collective on ``arr`` (a flat CUDA array with ``ptr``, ``size``, ``nbytes``), in place.

        ``kind``: ``allreduce`` (``op`` over every rank, the result everywhere), ``broadcast`` (the plan's
        root's tensor everywhere), ``reduce_to_roots`` (the reduce phase alone: each tree's root holds its
        range's result; the other ranks' elements are partial sums) or ``broadcast_from_roots`` (the
        broadcast phase alone: each tree's root's range everywhere).  ``plan_of(all_extras)`` gives the plan (rank 0's rides in the extras on
        its first use).  Returns every rank's extras.  ``replay_key``: a hashable name of everything that
        decides this collective's metadata (the caller's promise); the next call with it may then go
        through :meth:`replay`.  ``known_plan``: the ``(plan, digest)`` that ``plan_of`` will give, where the caller
        knows it before the exchange (a plan already agreed on): the work tables are then ready before any
        peer can launch.
        """
        if self.failed is not None:
            raise BlinkInternalError(f"{label}: this communicator is unusable after an earlier failure: {self.failed}")
        if self._closed:
            raise BlinkInternalError(f"{label}: the GPU executor is closed")
        ctx = WaitContext.start(label, self.timeout, self.stall)
        try:
            me = threading.get_ident()
            if me != self._device_thread:
                self.cuda.set_device()
                self._device_thread = me
            self._check_device_error(ctx)
            t0 = time.perf_counter()
            ptr = int(arr.ptr) if arr is not None and arr.size else 0
            fn = self._function(dtype, op or "sum") if ptr else None  # before any peer can wait on this rank
            itemsize = numpy_dtype(dtype).itemsize
            # Work tables are uploaded with a wait for the device: before the exchange, where no peer can
            # yet spin on this rank's kernel for this collective, when the plan is known.
            tables = self._work(*known_plan, arr.size, itemsize) if ptr and known_plan is not None else None
            mine = dict(extras)
            if ptr:
                serial, offset, handle = self.registry.own(ptr)
                mine["g"] = [serial, offset, handle.hex() if handle is not None else None, ptr % 16]
            self.seq += 1
            all_extras = self._agree(checked, mine, ctx)
            t1 = time.perf_counter()
            if not ptr:
                return all_extras
            if tables is None:
                # A plan seen for the first time (rank 0's, in the extras): every rank uploads its tables now
                # and meets the others below, before any launch.
                tables = self._work(*plan_of(all_extras), arr.size, itemsize)
            work, items, trees = tables
            a = self._args[0]
            bufs = a["buf"]
            vec = 1
            for q, e in enumerate(all_extras):
                serial, offset, handle, mis = e["g"]
                bufs[q] = ptr if q == self.rank else self.registry.peer(q, serial, offset,
                                                                        bytes.fromhex(handle) if handle else None)
                vec &= int(mis == 0)
            if known_plan is None or _new_mappings(all_extras):
                self._mapped(ctx)
            self.epoch += 1
            a["epoch"] = self.epoch
            a["items"], a["trees"], a["nitems"] = items, trees, work.nitems
            a["phases"] = PHASES[kind]
            a["average_n"] = self.nranks if op == "average" else 0
            a["vec"] = vec
            sp = int(stream) if stream is not None else self.cuda.stream_pointer(None)
            if self._trace:
                self._log_launch(label, f"launch, {kind} of {arr.size} {dtype}", a, work.blocks, sp)
            self.cuda.launch_kernel(fn, work.blocks, THREADS, sp, self._params)
            self._pending.add(sp)
            self._launched = True
            if self._evicted:
                self._free_evicted()
            self.last_meta_seconds = t1 - t0
            self.last_launch_seconds = time.perf_counter() - t1
            self.last_native = None
            if replay_key is not None and not extras:
                self._remember(replay_key, label, ptr, work.blocks, fn)
            return all_extras
        except BaseException as exc:
            self.fail(exc)
            raise

    def _remember(self, key: Any, label: str, ptr: int, grid: int, fn: Any) -> None:
        """Keep what :meth:`replay` needs to run this collective again: the payload sent, the payloads
        received, and the kernel's parameters (the epoch aside)."""
        args = self._args.copy()
        argp = (ctypes.c_void_p * 1)(args.ctypes.data)
        if len(self._replays) > 4096:
            self._replays.clear()
        checked, mine, payload = self._memo
        g = mine.get("g")
        if g and g[2]:  # the handle went with the first use; a replay sends none (peers have the mapping)
            payload = metadata.encode(checked, {**mine, "g": [g[0], g[1], None, g[3]]})
        rec = self._replays[key] = _Replay(label, ptr, self.cuda.buffer_id(ptr), payload, self._decoded[0], args,
                                           argp, grid, fn)
        self._prepare_native(rec)

    @property
    def native_available(self) -> bool:
        """Whether repeats can take the native host path (shared-memory transport, library built)."""
        return self._native_path is not None

    def use_native(self, on: bool) -> None:
        """Repeats through the native call (the default where available) or through Python: for measuring
        the two side by side (``benchmarks/gpu_latency_probe.py``).  Prepared repeats are dropped."""
        self._native = self._native_path if on else None
        self._replays.clear()

    def _prepare_native(self, rec: _Replay) -> None:
        """The native call of ``rec``'s repeats, expecting what the peers sent last (``rec.payloads``)."""
        if self._native is not None:
            rec.native = self._native.prepare(rec.payload, rec.payloads, self.cuda.function_address(rec.fn), rec.grid,
                                              THREADS, ctypes.addressof(rec.argp), rec.args.ctypes.data, rec.ptr,
                                              rec.bid)

    def replay(self, key: Any, ptr: int, stream: int | None) -> bool:
        """Launch again the collective last run with ``replay_key=key`` (same metadata, same tensor); False
        when nothing is kept for it (or this tensor's allocation changed), and the caller then takes
        :meth:`collective`.  The host path of a training step's repeated buckets (one native call where
        :mod:`.native_replay` is available): one buffer identity check, the metadata exchange (a peer that sends other bytes is checked as in :meth:`collective`), one
        launch."""
        rec = self._replays.get(key)
        if rec is None or self.failed is not None or self._closed or threading.get_ident() != self._device_thread:
            return False
        native = rec.native
        if native is None and self.cuda.buffer_id(ptr) != rec.bid:  # (the native call checks it itself)
            del self._replays[key]
            return False
        try:
            if self._ctl_view[1]:
                self._check_device_error(WaitContext.start(rec.named(self.seq + 1), self.timeout, self.stall))
            t0 = time.perf_counter()
            sp = int(stream) if stream is not None else self.cuda.stream_pointer(None)
            # Check, post, meet, compare and launch in one native call; what it hands back (a late peer, other
            # bytes) goes on below with this rank's payload already posted.
            code = None if native is None else self._native.run(  # type: ignore[union-attr]
                native, self.seq + 1, sp, self.epoch + 1)
            if code == native_replay.MOVED:  # nothing posted: the caller takes collective()
                del self._replays[key]
                return False
            self.seq += 1
            self.epoch += 1
            if self._trace:
                self._log_launch(rec.base, f"repeat, native call {code}", rec.args[0], rec.grid, sp)
            if code == native_replay.LAUNCHED:
                self._pending.add(sp)
                self.last_meta_seconds = time.perf_counter() - t0
                self.last_launch_seconds = 0.0
                self.last_native = native.call
                return True
            if code == native_replay.LAUNCH_FAILED:
                raise BlinkInternalError(f"{rec.named(self.seq)}: cuLaunchKernel failed with CUDA error {native.cuda_error}")
            # (after a native call the deadline counts from here: its spin is a fraction of a millisecond)
            ctx = WaitContext.start(rec.named(self.seq), self.timeout, self.stall)
            payloads = (self.t.exchange_meta(self.seq, rec.payload, ctx) if code is None
                        else self.t.collect_meta(self.seq, rec.payload, ctx))
            if payloads != rec.payloads:
                # Checked fields are compared (a disagreement raises, naming ranks and fields); the same
                # metadata with a peer's tensor elsewhere only moves that peer's pointer.
                all_extras = metadata.check_agreement(payloads, self.seq)
                bufs = rec.args[0]["buf"]
                for q, e in enumerate(all_extras):
                    if q != self.rank:
                        serial, offset, handle, mis = e["g"]
                        bufs[q] = self.registry.peer(q, serial, offset, bytes.fromhex(handle) if handle else None)
                        rec.args[0]["vec"] &= int(mis == 0)
                rec.payloads = payloads
                self._prepare_native(rec)
                if _new_mappings(all_extras):
                    self._mapped(ctx)
            t1 = time.perf_counter()
            rec.epoch.value = self.epoch  # args' first field, through ctypes: a tenth of numpy's field store
            self.cuda.launch_kernel(rec.fn, rec.grid, THREADS, sp, ctypes.addressof(rec.argp))
            self._pending.add(sp)
            self.last_meta_seconds = t1 - t0
            self.last_launch_seconds = time.perf_counter() - t1
            self.last_native = None
            return True
        except BaseException as exc:
            self.fail(exc)
            raise

    def _log_launch(self, label: str, how: str, a: Any, grid: int, stream: int) -> None:
        """``BLINK_LOG_LEVEL=debug``: one line per launch, from the parameters the kernel gets (to compare ranks)."""
        log.debug("rank %d: %s: seq %d epoch %d (%s, phases %d, %d items, %d blocks, tables %#x/%#x, tensors %s, "
                  "stream %#x)", self.rank, label, self.seq, self.epoch, how, a["phases"], a["nitems"], grid,
                  a["items"], a["trees"], [hex(int(b)) for b in a["buf"][: self.nranks]], stream)

    def _mapped(self, ctx: WaitContext) -> None:
        """Every rank has done this collective's work that may wait for the device; only then does any launch.

        Opening a peer's IPC handle, or uploading work tables (a copy and a stream synchronize), may wait
        for the device.  A rank that did so after a peer had launched would wait for that peer's kernel,
        spinning for this rank's, which is never launched (seen on an H100 under MPS: a rank stuck in the
        table upload's synchronize while its peer's kernel spun).  So when any rank registers a tensor
        (which every rank can tell from the metadata: a handle travels only with a new registration), or
        the plan is new to every rank (all have the same history), every rank meets the others here first."""
        self.seq += 1
        self.t.exchange_meta(self.seq, _MAPPED, ctx)

    def _agree(self, checked: Mapping[str, Any], extras: Mapping[str, Any], ctx: WaitContext) -> list[dict[str, Any]]:
        """Exchange and check metadata; a repeat of the previous collective (same bytes from every rank, as
        a training step's buckets are) reuses the decoding: equal bytes decode to equal values."""
        memo = self._memo
        if memo is not None and memo[0] == checked and memo[1] == extras:
            payload = memo[2]
        else:
            payload = metadata.encode(checked, extras)
            self._memo = (dict(checked), dict(extras), payload)
        payloads = self.t.exchange_meta(self.seq, payload, ctx)
        dec = self._decoded
        if dec is not None and dec[0] == payloads:
            return dec[1]
        out = metadata.check_agreement(payloads, self.seq)
        self._decoded = (payloads, out)
        return out

    def _work(self, plan: Any, digest: str, count: int, itemsize: int) -> tuple[Work, int, int]:
        key = (digest, count, itemsize)
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        work = make_work(plan, count, itemsize, self.rank, self.blocks)
        c = self.cuda
        items = c.malloc(max(32, work.items.nbytes))
        trees = c.malloc(max(8, work.trees.nbytes))
        if work.items.nbytes:
            c.copy_async(items, work.items.ctypes.data, work.items.nbytes, self._aux.ptr, kind="h2d")
        c.copy_async(trees, work.trees.ctypes.data, work.trees.nbytes, self._aux.ptr, kind="h2d")
        self._aux.synchronize()
        hit = self._tables[key] = (work, items, trees)
        if len(self._tables) > _TABLES:
            # Freed after this collective's launch (_free_evicted): freeing may wait for the device, and
            # before this rank's launch a peer's kernel may be spinning for it.
            _, (_, old_items, old_trees) = self._tables.popitem(last=False)
            self._evicted += [old_items, old_trees]
        return hit

    def _free_evicted(self) -> None:
        """Free evicted work tables once this rank's launched work, which may read them, is done."""
        self.synchronize()
        for ptr in self._evicted:
            self.cuda.free(ptr)
        self._evicted = []

    # -- waiting ----------------------------------------------------------------------------
    def _check_device_error(self, ctx: WaitContext) -> None:
        bad = int(self._ctl_view[1])
        if bad:
            g = self.t.rank_offset  # errors name the job's ranks
            raise BlinkTimeoutError(
                f"{ctx.label}: rank {self.rank + g}'s GPU gave up waiting for {_waited(int(self._ctl_view[2]), g)} "
                f"in collective epoch {bad} (BLINK_TIMEOUT_SECONDS={self.timeout:g}, or a failure elsewhere "
                f"aborted it)")

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait (peer checks, deadline) until this rank's launched collectives are done."""
        if not self._launched:
            return
        ctx = WaitContext.start("synchronize", self.timeout if timeout is None else timeout, self.stall)
        try:
            c = self.cuda
            evs = self._record_pending()
            self._wait_until(lambda: all(c.done(ev) for ev in evs), ctx, "launched collectives")
            self._check_device_error(ctx)
        except BaseException as exc:
            self.fail(exc)
            raise

    def _record_pending(self) -> list[int]:
        """An event after the last launch on each stream used (recorded now: stream order puts it behind)."""
        for sp in self._pending:
            ev = self._events.get(sp)
            if ev is None:
                ev = self._events[sp] = self.cuda.event()
            self.cuda.record(ev, sp)
        self._pending.clear()
        return list(self._events.values())

    def _wait_until(self, ready: Callable[[], bool], ctx: WaitContext, what: str) -> None:
        if ready():
            return
        started = time.monotonic()
        next_check, next_warn = started + 0.05, started + ctx.stall
        spin_until = started + self._spin_s
        delay = 2e-5
        while not ready():
            now = time.monotonic()
            if now < spin_until and now < next_check:
                continue
            if now >= next_check:
                self.t.check_peers(ctx, self._peers, f"its GPU to finish {what}")
                self._check_device_error(ctx)
                next_check = now + 0.05
            if now >= ctx.deadline:
                raise BlinkTimeoutError(
                    f"{ctx.label}: rank {self.rank} timed out after {ctx.timeout:g} s waiting for its GPU to finish "
                    f"{what} (a peer's device work never arrived; BLINK_TIMEOUT_SECONDS={ctx.timeout:g})")
            if now >= next_warn:
                log.warning("%s: rank %d's GPU has waited %.0f s for %s", ctx.label, self.rank, now - started, what)
                next_warn = now + ctx.stall
            time.sleep(delay)
            delay = min(delay * 2, 5e-5 if now - started < 0.005 else 1e-3)

    def fail(self, exc: BaseException) -> None:
        """Mark this rank failed, tell the peers, and stop this rank's kernel from waiting."""
        if self.failed is None:
            self.failed = exc
            self._ctl_view[0] = 1  # the kernel's waits read it: they give up and drain
            self.t.abort(exc)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for this rank's work, meet the peers (they read this rank's flags until their kernels end),
        then free everything."""
        if self._closed:
            return
        self._closed = True
        idle = True
        try:
            try:
                if self.failed is None:
                    self.synchronize(min(self.timeout, 60.0))
                    ctx = WaitContext.start("close", min(self.timeout, 60.0), self.stall)
                    self.seq += 1
                    self.t.exchange_meta(self.seq, metadata.CLOSING, ctx)
                else:
                    self._ctl_view[0] = 1
                    idle = self._quiet_drain(5.0)
            except BaseException as exc:  # noqa: BLE001
                log.warning("rank %d: GPU work did not drain at close (%s)", self.rank, exc)
                self._ctl_view[0] = 1
                idle = self._quiet_drain(5.0)
            if idle:
                c = self.cuda
                self.registry.close()
                for q, fp in enumerate(self._flag_ptrs):
                    if fp and q != self.rank:
                        c.ipc_close(fp)
                for _, items, trees in self._tables.values():
                    c.free(items)
                    c.free(trees)
                for ptr in self._evicted:
                    c.free(ptr)
                self._evicted = []
                self._tables.clear()
                c.free(self._own_flags)
                for ev in self._events.values():
                    c.destroy_event(ev)
                c.free_host(self._ctl_host)
            else:
                log.warning("rank %d: device still busy; CUDA memory is left to process exit", self.rank)
        finally:
            self.t.close()

    def _quiet_drain(self, seconds: float) -> bool:
        if not self._launched:
            return True
        end = time.monotonic() + seconds
        try:
            evs = self._record_pending()
        except Exception:  # noqa: BLE001 - a faulted context: nothing more to wait for
            return False
        while time.monotonic() < end:
            try:
                if all(self.cuda.done(ev) for ev in evs):
                    return True
            except Exception:  # noqa: BLE001 - a faulted context: nothing more to wait for
                return False
            time.sleep(1e-3)
        return False




_MAPPED = b"mapped"


def _new_mappings(all_extras: Sequence[Mapping[str, Any]]) -> bool:
    """Whether some rank's tensor of this collective is registered for the first time (its IPC handle
    travels with it, so every peer opens a mapping now)."""
    return any(e.get("g") and e["g"][2] for e in all_extras)


class _Replay:
    """What :meth:`TreeExecutor.replay` needs to launch a collective again."""

    __slots__ = ("argp", "args", "base", "bid", "epoch", "fn", "grid", "native", "payload", "payloads", "ptr")

    def __init__(self, label: str, ptr: int, bid: int, payload: bytes, payloads: list[bytes], args: np.ndarray,
                 argp: Any, grid: int, fn: Any) -> None:
        # The label without the first call's number: a repeat's errors name the collective it is.
        self.base = _NUMBERED.sub("", label)
        self.ptr, self.bid, self.payload, self.payloads = ptr, bid, payload, payloads
        self.args, self.argp, self.grid, self.fn = args, argp, grid, fn
        assert ARGS_DTYPE.fields["epoch"][1] == 0
        self.epoch = ctypes.c_uint64.from_address(args.ctypes.data)
        self.native: native_replay.PreparedCall | None = None  # TreeExecutor._prepare_native

    def named(self, seq: int) -> str:
        """This repeat's label as collective ``seq``."""
        return f"{self.base} (collective {seq})"


# The share of a GPU's block slots that the ranks sharing it take together where compute kernels run beside
# the collectives.  Why: rank r's collective may be queued behind its own compute kernel on another stream
# (the backward pass goes on while the gradients' allreduces run), and a compute kernel whose blocks each
# need a whole SM cannot start while every SM holds a peer's spinning block; the peer then spins until its
# timeout, waiting for rank r's kernel.  (The explanation that fits the stalls of a 103 M parameter
# training step on an H100 under MPS: docs/integration.md.)  With every rank's kernel at most half the
# slots, the ranks whose kernels spin leave SMs free for that compute kernel.
OVERLAP_SHARE = 0.5


def _agreed_share(peers: Sequence[Mapping[str, Any]], ranks_on_device: int) -> float:
    """The share every rank uses: the smallest any rank set (``BLINK_GPU_SM_SHARE``); none set: 1, or
    :data:`OVERLAP_SHARE` where ranks share a GPU and some rank runs compute beside the collectives."""
    set_ = [float(e["share"]) for e in peers if e.get("share") is not None]
    if set_:
        return min(set_)
    return OVERLAP_SHARE if ranks_on_device > 1 and any(e.get("overlap") for e in peers) else 1.0


def _waited(word: int, rank_offset: int = 0) -> str:
    """What the kernel's wait that gave up waited for, from the word it left (``trees.cu``, blink_wait:
    index << 16 | what << 8 | peer + 1)."""
    peer, what, index = (word & 0xFF) - 1, (word >> 8) & 0xFF, word >> 16
    if peer < 0 or what not in _WAITED:
        return "a peer's flags"
    return f"rank {peer + rank_offset}'s {_WAITED[what].format(index)}"


# trees.cu's BLINK_WAIT_* -> what was waited for ({} the item or block)
_WAITED = {1: "reduce flag of item {}", 2: "broadcast flag of item {}", 3: "end-of-collective flag of block {}"}

_NUMBERED = re.compile(r" \(collective \d+\)$")  # Communicator's labels end so


def mps_active(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is an MPS client: the MPS control daemon's pipe exists
    (``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``)."""
    env = os.environ if env is None else env
    return os.path.exists(os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control"))
