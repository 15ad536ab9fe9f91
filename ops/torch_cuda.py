"""CUDA tensors of ``horovod.torch`` on Blink's GPU runtime: fused in GPU memory, run on one stream.

The engine (:mod:`.engine`) decides, with every rank, what runs next; a round
of CUDA tensors comes here (:class:`TorchCudaStages`, the engine's
:class:`~.engine.DeviceStages`).  Stream order is Horovod's with NCCL
(``horovod/torch/ready_event.cc``, ``horovod/common/ops/gpu_operations.cc``):

1. at submit (:func:`prepare`, in the caller's thread) the inputs are copied
   and prescaled on the caller's current stream, and an event is recorded
   there -- the call returns without waiting on the host;
2. here, the engine's thread waits until that event has completed (Horovod's
   background thread, too, negotiates a CUDA tensor only once its ready event
   has fired), then the tensors of one dtype are
   fused into one flat buffer (a persistent GPU allocation, registered for
   peer access once, so repeats of a training step's buckets replay their
   kernels), the three stages run on that stream (:class:`.hierarchical.Hierarchy`:
   Blink's tree kernel within the server, Horovod across servers), the
   result is postscaled and copied back, and a done event is recorded.
   Why the host waits: a tree kernel spins on its peers' flags, holding SMs.
   Had a rank launched it behind its caller's unfinished work, a peer sharing
   the GPU could spin on every SM while that work waits for one (a suspect in
   a stall seen on the H200: a 100 M parameter model's backward pass,
   overlapping its gradients' allreduces, waited until the timeout; see
   docs/gpu-runtime.md for the others addressed).  Launched once every rank's
   inputs are ready, a kernel waits only for its peers' launches;
3. ``synchronize(handle)`` makes the caller's current stream wait for the
   done event (:meth:`.engine.Handle.wait`), so the caller's next kernels see
   the result.

The server's GPU communicator (``Communicator(device="cuda")``) is made at
the first CUDA round, when every rank of the server runs the same round, on
the device of that round's tensors: users call ``torch.cuda.set_device``
after ``hvd.init``, so the device is not known earlier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ..config import Config
from ..errors import BlinkTimeoutError, ConfigError
from .hierarchical import CrossTransport, Hierarchy
from .layout import Layout
from .quiet import Quiet
from .scaling import needs_scaling

__all__ = ["TorchCudaStages", "gpu_reason", "gpu_sharers", "prepare", "scale_tensor"]

log = logging.getLogger("blink_horovod.ops")

_MIN_FUSION_ELEMS = 1 << 18


def gpu_reason() -> str:
    """Why Blink's GPU runtime cannot carry CUDA tensors in this process ("" when it can)."""
    from ..runtime.gpu.device import available

    ok, why = available()
    return "" if ok else f"CUDA tensors (Blink's GPU runtime is not usable here: {why})"


def gpu_sharers(machine_ranks: int) -> int:
    """How many of the job's ranks share each GPU of this machine, at least: its ranks over its GPUs
    (every GPU NVML sees, ``CUDA_VISIBLE_DEVICES`` aside; 1 where NVML cannot be read).

    Servers of one job on one machine (as the tests run two on the one GPU) do not see each other's
    ranks in their server's communicator, yet their kernels share the GPU's SMs."""
    if machine_ranks <= 1:
        return 1
    from ..errors import TopologyError
    from ..topology.probe import local_facts

    try:
        gpus = len(local_facts(None).gpus)
    except TopologyError:
        return 1
    return max(1, -(-machine_ranks // gpus)) if gpus else 1


def scale_tensor(t: Any, factor: float) -> None:
    """``t *= factor`` in place with Horovod's rounding (:mod:`.scaling`): float32 arithmetic for the
    16-bit floats and float32, double for float64 and the integers (truncated toward zero)."""
    import torch

    if t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float().mul_(factor))
    elif t.dtype in (torch.float32, torch.float64):
        t.mul_(factor)
    else:
        t.copy_(t.double().mul_(factor).trunc_())


def _flat(t: Any) -> Any:
    """A flat view of a contiguous tensor; bool as uint8 (the kernels move bytes for it)."""
    import torch

    v = t.reshape(-1)
    return v.view(torch.uint8) if v.dtype == torch.bool else v


def prepare(tensors: Sequence[Any], outputs: Sequence[Any], prescale: float) -> tuple[list[Any], Any]:
    """Step 1 of the module docstring: outputs hold the (prescaled) inputs, in the caller's stream order.

    Returns the outputs' flat views and the event recorded after them on the caller's current stream."""
    import torch

    dev = outputs[0].device
    stream = torch.cuda.current_stream(dev)
    with torch.cuda.device(dev):
        for t, out in zip(tensors, outputs):
            if out is not t:
                out.copy_(t)
            if needs_scaling(prescale):
                scale_tensor(out, prescale)
        ready = torch.cuda.Event()
        ready.record(stream)
    return [_flat(o) for o in outputs], ready


class _Suffixed:
    """A rendezvous whose job id names the GPU communicator's control segments apart from the CPU one's."""

    def __init__(self, rdv: Any, suffix: str) -> None:
        self._rdv, self._suffix = rdv, suffix
        self.local_rank, self.local_size = rdv.local_rank, rdv.local_size

    @property
    def job_id(self) -> str:
        return f"{self._rdv.job_id}{self._suffix}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rdv, name)

    def close(self) -> None:  # the CPU communicator's rendezvous: closed with the context
        pass


class TorchCudaStages:
    """The engine's GPU stages for ``horovod.torch`` (module docstring).

    Parameters
    ----------
    layout:
        The job's servers.
    cross:
        Horovod on the cross-server process sets (None for a single-server job).
    config:
        The ``BLINK_*`` settings.
    rendezvous:
        The server's rendezvous (None when the server has one rank).
    """

    def __init__(self, layout: Layout, cross: CrossTransport | None, config: Config, rendezvous: Any,
                 machine_ranks: int = 1) -> None:
        self.layout, self.cross, self.config, self.rendezvous = layout, cross, config, rendezvous
        self.machine_ranks = machine_ranks
        self.device: Any = None
        self.comm: Any = None
        self.stream: Any = None
        self.hierarchy: Hierarchy | None = None
        self._buffers: dict[Any, Any] = {}
        self.join_device: Any = None  # the caller's current GPU at hvd.join() (a joined rank serves there)

    # -- setup -------------------------------------------------------------------------
    def _ready(self, device: Any) -> Any:
        """The GPU communicator, stream and stages on ``device`` (made at the first CUDA round)."""
        import torch

        if self.device is not None:
            if device != self.device:
                raise ConfigError(f"device: this rank's CUDA tensors were on {self.device}, now on {device}; "
                                  "Blink runs one GPU per rank (call torch.cuda.set_device once)")
            return self.stream
        torch.cuda.set_device(device)
        comm = None
        if self.layout.local_size > 1:
            from ..runtime.communicator import Communicator

            comm = Communicator(self.layout.local_rank, self.layout.local_size, None,
                                _Suffixed(self.rendezvous, "g"), self.config, device="cuda",
                                gpu_sharers=gpu_sharers(self.machine_ranks), gpu_overlap=True)
            if comm.transport is not None:
                comm.transport.rank_offset = self.layout.server * self.layout.local_size  # errors name global ranks
            t = comm.topology
            log.info("blink: rank %d: CUDA tensors on %s, server topology %s (%d GPUs)", self.layout.rank, device,
                     t.name, t.n)
        self.device, self.comm, self.stream = device, comm, torch.cuda.Stream(device)
        self.hierarchy = Hierarchy(self.layout, comm, self.cross, quiet=Quiet(False, False), settle=self._settle)
        return self.stream

    def _settle(self) -> None:
        """Before Horovod reads a CUDA buffer across servers: the kernels and copies queued so far are done."""
        if self.comm is not None:
            self.comm.synchronize()  # peer checks and a deadline while the kernels run
        self.stream.synchronize()

    def _buffer(self, dtype: Any, count: int) -> Any:
        """The first ``count`` elements of this rank's fusion buffer of ``dtype`` (grown by doubling, so that
        its address, and with it the peers' mappings and the kernels' replays, stay put)."""
        import torch

        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < count:
            size = max(count, _MIN_FUSION_ELEMS, 2 * buf.numel() if buf is not None else 0)
            buf = self._buffers[dtype] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:count]

    def _groups(self, works: Sequence[Any]) -> list[list[Any]]:
        by: dict[Any, list[Any]] = {}
        for w in works:
            for a in w.arrays:
                by.setdefault(a.dtype, []).append(a)
        return [by[dt] for dt in sorted(by, key=str)]

    def _fused(self, group: list[Any], copy_in: bool) -> Any:
        import torch

        if len(group) == 1:
            return group[0]
        flat = self._buffer(group[0].dtype, sum(a.numel() for a in group))
        if copy_in:
            torch.cat(group, out=flat)
        return flat

    @staticmethod
    def _unfuse(flat: Any, group: list[Any]) -> None:
        import torch

        if len(group) == 1:
            return
        parts = list(torch.split(flat, [a.numel() for a in group]))
        copy = getattr(torch, "_foreach_copy_", None)  # one launch for the whole group where torch has it
        if copy is not None:
            copy(group, parts)
        else:
            for a, p in zip(group, parts):
                a.copy_(p)

    def _run(self, works: Sequence[Any], body: Any) -> None:
        """``body(hierarchy)`` on Blink's stream after the callers' ready events; the done event goes to every
        handle (waited for by ``synchronize`` on the caller's stream)."""
        import torch

        stream = self._ready(works[0].device)
        self._inputs_ready(works)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for w in works:
                if w.ready is not None:
                    stream.wait_event(w.ready)
                for a in w.arrays:  # the caller's allocator must not reuse them before this stream is done
                    a.record_stream(stream)
            body(self.hierarchy)
            done = torch.cuda.Event()
            done.record(stream)
        for w in works:
            w.handle._after = done.wait

    def _inputs_ready(self, works: Sequence[Any]) -> None:
        """Wait (polling, under ``BLINK_TIMEOUT_SECONDS``) until every work's ready event has completed:
        step 2 of the module docstring says why."""
        events = [w.ready for w in works if w.ready is not None]
        if all(e.query() for e in events):
            return
        start = time.monotonic()
        deadline = start + self.config.timeout_seconds
        delay = 2e-6
        for e in events:
            while not e.query():
                now = time.monotonic()
                if now > deadline:
                    late = [w.name or "?" for w in works if w.ready is not None and not w.ready.query()]
                    names = ", ".join(repr(n) for n in late[:3]) + (f" and {len(late) - 3} more" if len(late) > 3 else "")
                    raise BlinkTimeoutError(
                        f"rank {self.layout.rank}: the inputs of {names} were not ready on {self.device} after "
                        f"{now - start:.1f} s (the work queued before the collective on the caller's stream has "
                        f"not finished; BLINK_TIMEOUT_SECONDS={self.config.timeout_seconds:g})")
                time.sleep(delay)
                delay = min(2 * delay, 1e-4 if now - start < 0.01 else 1e-3)

    # -- the engine's stages --------------------------------------------------------------
    def allreduce(self, works: Sequence[Any], op: str, postscale: float, tag: str) -> None:
        def body(h: Hierarchy) -> None:
            for gi, group in enumerate(self._groups(works)):
                flat = self._fused(group, copy_in=True)
                h.allreduce(flat, op, f"{tag}.{gi}")
                if needs_scaling(postscale):
                    scale_tensor(flat, postscale)
                self._unfuse(flat, group)

        self._run(works, body)

    def broadcast(self, works: Sequence[Any], root: int, tag: str) -> None:
        def body(h: Hierarchy) -> None:
            for gi, group in enumerate(self._groups(works)):
                flat = self._fused(group, copy_in=self.layout.rank == root)
                h.broadcast(flat, root, f"{tag}.{gi}")
                self._unfuse(flat, group)

        self._run(works, body)

    def serve(self, numel: Sequence[tuple[str, int]], op: str, tag: str) -> None:
        """A joined rank's part in the others' CUDA allreduce: the reduction's identity, on its GPU."""
        import numpy as np
        import torch

        from .engine import identity_value

        if self.device is None:
            self._ready(self.join_device or torch.device("cuda", torch.cuda.current_device()))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for gi, (dt, n) in enumerate(numel):
                tdt = getattr(torch, "uint8" if dt == "bool" else dt)
                flat = self._buffer(tdt, n)
                like = np.dtype("float32" if dt in ("float16", "bfloat16") else "uint8" if dt == "bool" else dt)
                flat.fill_(identity_value(op, like))
                self.hierarchy.allreduce(flat, op, f"{tag}.{gi}")  # type: ignore[union-attr]

    def close(self) -> None:
        """Wait for the launched work, then free the GPU communicator (its peers meet it there)."""
        if self.comm is None:
            return
        import torch

        prev = torch.cuda.current_device()
        try:
            torch.cuda.set_device(self.device)
            self.comm.close()
        finally:
            torch.cuda.set_device(prev)
            self.comm = None
            self._buffers.clear()
