"""The server's communicator: allreduce, broadcast and the two hierarchical stages, in place on numpy arrays.

One communicator per process joins the ranks of one server.  It never plans
or schedules by itself: it asks the planner for Blink's trees (once per
collective and root, through the plan cache), the schedule compiler for the
program of each size (cached, and proved by the symbolic checker once), and
hands the program to the executor (:mod:`blink_horovod.runtime.executor`)
over the shared-memory transport.

The four collectives (docs/architecture.md, "The flow of one allreduce"):

``allreduce(arr, op)``       every rank ends with op over all ranks' ``arr``;
``broadcast(arr, root)``     every rank ends with local rank ``root``'s ``arr``;
``reduce_to_roots(arr, op)`` stage 1: local rank i's ``arr[start:end]`` holds
                             the server's reduction of the i-th 1/n segment,
                             ``[i*count//n, (i+1)*count//n)`` (the same on
                             every server, whatever its plan);
``broadcast_from_roots(arr)`` stage 3: every rank ends with every local rank's
                             segment.

Messages larger than :data:`MAX_PIECE_BYTES` run in pieces.  For the two
stages the pieces keep every rank's segment: piece k holds the k-th
``q``-element slice of each segment, so the segments of a piece's program
(the i-th 1/n of the piece) are exactly slices of the whole segments.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import BLINK_TOPOLOGY, Config, load_config
from ..errors import BlinkInternalError, ConfigError
from ..planner.plan import Plan
from ..topology.model import Topology
from .dtypes import check_op, dtype_name, finish_average, numpy_dtype
from .executor import Executor, Piece, Run
from .rendezvous import Rendezvous
from .transport import EAGER_BYTES, Transport, WaitContext
from .tuning import ChunkChooser, bucket_of

__all__ = ["MAX_PIECE_BYTES", "Communicator", "segment_bounds"]

log = logging.getLogger("blink_horovod.runtime")

MAX_PIECE_BYTES = 64 << 20  # buffer size per rank beyond which messages run in pieces
_PROGRAM_CACHE = 256

Planner = Callable[[Topology, str, "int | None"], Plan]


def segment_bounds(count: int, n: int, i: int) -> tuple[int, int]:
    """Local rank i's segment of a ``count``-element buffer: the i-th 1/n (docs/formats.md, Plan file)."""
    return i * count // n, (i + 1) * count // n


def _default_planner(cfg: Config, device: str = "cpu") -> Planner:
    def plan(topology: Topology, collective: str, root: int | None) -> Plan:
        from ..planner.cache import (
            cached_plan,  # lazy: planning needs scipy/HiGHS only on a miss
        )

        return cached_plan(topology, collective, root, _channels(topology, collective, device), cfg.plan_cache)

    return plan


def _channels(topology: Topology, collective: str, device: str) -> tuple[str, ...] | None:
    """The channels to plan on: all (None) on CPU; NVLink alone on GPUs where it connects every GPU, because
    the GPU executor reaches peers through their IPC mappings, which ride NVLink there: a PCIe share
    (Blink's hybrid, section 3.4) would be bandwidth planned but not used."""
    if device != "cuda" or topology.pcie is None:
        return None
    from ..planner.network import channel_network

    return ("nvlink",) if channel_network(topology, collective, "nvlink").connected() else None


def fully_connected(topology: Topology) -> bool:
    """Every GPU pair has a direct NVLink link or shares a switch (one-hop trees exist)."""
    caps = topology.capacities("nvlink")
    linked = {frozenset(k) for k in caps}
    switch_of: dict[int, set] = {}
    for link in topology.links:
        if link.kind != "nvlink":
            continue
        for gpu, other in ((link.src, link.dst), (link.dst, link.src)):
            if isinstance(other, str):
                switch_of.setdefault(gpu, set()).add(other)
    gpus = list(topology.gpus)
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            if frozenset((a, b)) not in linked and not (switch_of.get(a, set()) & switch_of.get(b, set())):
                return False
    return True


def resolve_topology(local_size: int, config: Config, device: str = "cpu") -> Topology:
    """The server's topology: ``BLINK_TOPOLOGY`` or, unset, ``cpu(local_size)``."""
    from ..topology import machines

    if config.topology:
        topo = machines.resolve(config.topology)
        if topo.n != local_size:
            raise ConfigError(
                f"{BLINK_TOPOLOGY}: {config.topology!r} has {topo.n} GPUs but the server runs {local_size} ranks "
                f"(pick an allocation of {local_size}, e.g. NAME:0,1,...)"
            )
        return topo
    if device == "cpu":
        return machines.cpu(local_size)
    raise ConfigError(f"{BLINK_TOPOLOGY}: unset, and device {device!r} has no prober")


def probe_server(local_rank: int, local_size: int, rendezvous: Rendezvous | None) -> Topology:
    """The server's GPUs, found by its ranks (``BLINK_TOPOLOGY`` unset, CUDA tensors): each rank names the
    PCI bus id of its current device, local rank 0 reads NVML once and finds those GPUs among the
    machine's (:func:`~blink_horovod.topology.allocation.server_topology`), and every rank adopts rank 0's
    answer.  One line per server at info level says what was found; NVML unreadable is one warning."""
    from ..topology.allocation import server_topology
    from ..topology.model import Topology as _Topology
    from .gpu.device import current_bus_id

    bus = current_bus_id()
    buses = rendezvous.allgather(bus) if rendezvous is not None else [bus]
    answer = None
    if local_rank == 0:
        from ..errors import TopologyError
        from ..topology.probe import local_facts

        facts, why = None, ""
        try:
            facts = local_facts(None)  # every GPU: ranks may see different CUDA_VISIBLE_DEVICES
        except TopologyError as exc:
            why = str(exc)
        topo, desc = server_topology(facts, buses, why)
        if topo.name.startswith("unprobed"):
            log.warning("Blink: %s", desc)
        else:
            log.info("Blink: %s (BLINK_TOPOLOGY unset)", desc)
        answer = topo.to_json(indent=None)
    if rendezvous is not None:
        answer = rendezvous.allgather(answer)[0]
    assert answer is not None
    return _Topology.from_json(answer, source="probe")


class Communicator:
    """The ranks of one server, executing Blink's programs on numpy arrays in place.

    Parameters
    ----------
    local_rank, local_size : int
        This rank and the number of ranks of the server.
    topology : Topology, optional
        The server's topology; None: from ``BLINK_TOPOLOGY``, else ``cpu(local_size)`` on CPU and
        the probe (:func:`probe_server`) on CUDA.
    rendezvous : Rendezvous
        The server's ranks (job id, allgather, barrier).
    config : Config, optional
        The ``BLINK_*`` settings; default :func:`load_config`.
    device : str
        ``"cpu"`` (numpy arrays over shared memory) or ``"cuda"`` (CUDA arrays:
        torch, CuPy, anything with ``__cuda_array_interface__``; the GPU
        executor, :mod:`.gpu.tree_executor`, one server; with ``BLINK_TOPOLOGY``
        unset the ranks probe their GPUs, :func:`probe_server`).  On CUDA a
        collective returns once launched on the tensor's current stream (torch's;
        CuPy's for other arrays), as NCCL's do; :meth:`synchronize` waits for it.
    transport : Transport, optional
        An already built transport (tests: the loopback one).
    planner : callable, optional
        ``planner(topology, collective, root) -> Plan``; default the plan cache.
    gpu_sharers : int
        On CUDA: how many ranks of the whole job share this rank's GPU, where the caller knows
        (servers of one job on one machine); the server's own ranks that share it are counted anyway.
        Each rank's kernel takes its share of the GPU's SMs, so that every spinning block is resident.
    gpu_overlap : bool
        On CUDA: compute kernels run beside the collectives (Horovod's gradients during a backward pass);
        where ranks share a GPU their kernels then take half its block slots unless
        ``BLINK_GPU_SM_SHARE`` says otherwise.
    """

    def __init__(
        self,
        local_rank: int,
        local_size: int,
        topology: Topology | None,
        rendezvous: Rendezvous | None,
        config: Config | None = None,
        device: str = "cpu",
        *,
        transport: Transport | None = None,
        planner: Planner | None = None,
        gpu_sharers: int = 1,
        gpu_overlap: bool = False,
    ) -> None:
        self.config = config or load_config()
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        if device == "cuda":
            from .gpu.device import available

            ok, why = available()
            if not ok:
                raise ConfigError(f"device: 'cuda' is not usable here ({why}); use 'cpu'")
        if local_size < 1 or not 0 <= local_rank < local_size:
            raise ConfigError(f"local_rank: {local_rank} is not in 0..{local_size - 1}")
        self.local_rank, self.local_size = local_rank, local_size
        self.device = device
        if topology is None and device == "cuda" and not self.config.topology:
            topology = probe_server(local_rank, local_size, rendezvous)
        self.topology = topology if topology is not None else resolve_topology(local_size, self.config, device)
        if self.topology.n != local_size:
            raise ConfigError(f"topology: {self.topology.name!r} has {self.topology.n} GPUs, the server {local_size} ranks")
        self.rendezvous = rendezvous
        self._planner = planner or _default_planner(self.config, device)
        self._topology_hash = self.topology.content_hash()[:16]
        # Small messages take one round (Executor.eager_collective) where every
        # rank has a direct link to every other: one-hop trees.
        self.eager_bytes = EAGER_BYTES if fully_connected(self.topology) and device == "cpu" else 0
        self._plans: dict[tuple[str, int | None], tuple[Plan, str]] = {}
        self._programs: OrderedDict[tuple, Any] = OrderedDict()
        self._chunks = ChunkChooser(self.config.chunk_bytes)
        self._last_rate: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()
        if transport is None and local_size > 1:
            transport = self._make_transport()
        self._transport = transport
        self._executor: Any = None
        if transport is not None and device == "cuda":
            from .gpu.tree_executor import TreeExecutor

            if self.config.fault:
                log.warning("BLINK_FAULT=%s is ignored on CUDA tensors (CPU runtime only)", self.config.fault)
            self._executor = TreeExecutor(transport, self.config.timeout_seconds, self.config.stall_check_seconds,
                                          sharers=gpu_sharers, sm_share=self.config.gpu_sm_share,
                                          overlap=gpu_overlap)
        elif transport is not None:
            self._executor = Executor(transport, self.config.timeout_seconds, self.config.stall_check_seconds,
                                      self.config.fault, self.config.stream_copy)

    def _make_transport(self) -> Transport:
        from .shm import ShmTransport

        if self.rendezvous is None:
            raise ConfigError("rendezvous: a server of several ranks needs a rendezvous")
        job = self.rendezvous.job_id
        pids = self.rendezvous.allgather(os.getpid())
        ctx = WaitContext.start("communicator setup", self.config.timeout_seconds, self.config.stall_check_seconds)
        if self.device == "cuda":  # control only (metadata, aborts, liveness): data moves in CUDA buffers
            return ShmTransport(self.local_rank, self.local_size, job, ctx, pids=pids, data_bytes=4096, nflags=16)
        return ShmTransport(self.local_rank, self.local_size, job, ctx, pids=pids)

    # -- plans and programs ------------------------------------------------------
    def plan(self, collective: str, root: int | None = None) -> Plan | None:
        """The plan in use for ``collective`` (root: a local rank); None before its first call.

        Plans are made by local rank 0 (or read from the plan cache) and travel
        to the other ranks inside the first collective's metadata exchange
        (:meth:`_run`), so every rank executes one plan, and ranks that
        disagree about the collective get a MismatchError, not a plan exchange
        that never meets.
        """
        entry = self._plans.get((collective, root))
        return entry[0] if entry else None

    def _make_plan(self, collective: str, root: int | None) -> Plan:
        gpu_root = None if root is None else self.topology.gpus[root]
        return self._planner(self.topology, collective, gpu_root)

    def _adopt_plan(self, key: tuple[str, int | None], plan: Plan) -> tuple[Plan, str]:
        if tuple(plan.gpus) != tuple(self.topology.gpus):
            raise BlinkInternalError(
                f"plan for {key[0]}: gpus {list(plan.gpus)} are not the topology's {list(self.topology.gpus)} in order"
            )
        digest = hashlib.sha1(plan.to_json(indent=None).encode()).hexdigest()[:16]
        entry = self._plans[key] = (plan, digest)
        if self.local_rank == 0:
            log.info("Blink: %s plan on %s: %d trees, %.1f GB/s (optimum %.1f GB/s)", key[0], self.topology.name,
                     len(plan.trees), plan.rate_gbps, plan.optimum_gbps)
        return entry

    def program(self, plan: Plan, digest: str, count: int, chunk_elems: int, kind: str):
        """The compiled, checked program (cached per plan, count, chunk and kind)."""
        key = (digest, count, chunk_elems, kind)
        prog = self._programs.get(key)
        if prog is not None:
            self._programs.move_to_end(key)
            return prog
        from ..schedule import check_program, compile_program

        prog = compile_program(plan, count, chunk_elems, kind)
        check_program(prog, plan)
        self._programs[key] = prog
        if len(self._programs) > _PROGRAM_CACHE:
            self._programs.popitem(last=False)
        return prog

    def chunk_sizes(self) -> dict[tuple[str, int], int]:
        """(collective, size bucket in bytes) -> chunk bytes in use (MIAD's choices, or the fixed size)."""
        return self._chunks.settled()

    def tuning_converged(self, collective: str, nbytes: int) -> bool:
        """Whether the chunk size of this collective and size has settled (MIAD done)."""
        return self.local_size == 1 or self._chunks.converged(nbytes, collective)

    # -- argument checks -----------------------------------------------------------
    def _flat(self, arr: np.ndarray, what: str) -> tuple[np.ndarray, str]:
        if self.device == "cuda":
            view = _DeviceFlat.of(arr, what)
            return view, view.dtype_name  # type: ignore[return-value]
        if not isinstance(arr, np.ndarray):
            raise ConfigError(f"{what}: expected a numpy array, got {type(arr).__name__}")
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ConfigError(f"{what}: the array must be C-contiguous and writeable (got shape {list(arr.shape)}, "
                              f"strides {list(arr.strides)})")
        return arr.reshape(-1), dtype_name(arr.dtype)

    def _checked(self, collective: str, name: str | None, arr: np.ndarray, dtype: str, op: str | None,
                 root: int | None) -> dict[str, Any]:
        # "plan" compares the topology every rank plans on (BLINK_TOPOLOGY must agree).
        return {"collective": collective, "name": name or "", "dtype": dtype, "shape": list(arr.shape),
                "op": op, "root": root, "plan": self._topology_hash}

    def _label(self, collective: str, name: str | None) -> str:
        seq = (self._executor.seq + 1) if self._executor else 0
        return f"{collective} {name!r} (collective {seq})" if name else f"{collective} (collective {seq})"

    def _chunk_elems(self, all_extras: list[dict[str, Any]], nbytes: int, itemsize: int, kind: str) -> int:
        rates = [e.get("t") for e in all_extras]
        agreed = min(rates) if all(isinstance(x, (int, float)) for x in rates) else None
        return max(1, self._chunks.chunk_bytes(nbytes, agreed, kind) // itemsize)

    def _offer_plan(self, plan_key: tuple[str, int | None], extras: dict[str, Any]) -> tuple[Plan, str] | None:
        """The cached plan and digest of ``plan_key``, or None when it is new: every rank knows that
        (same history), and local rank 0 then adds its plan to its ``extras`` for all to adopt."""
        entry = self._plans.get(plan_key)
        if entry is None and self.local_rank == 0:
            try:
                extras["plan"] = self._make_plan(*plan_key).to_dict()
            except BaseException as exc:
                self._executor.fail(exc)  # type: ignore[union-attr]  # peers raise now, not at their timeout
                raise
        return entry

    def _agreed_plan(self, plan_key: tuple[str, int | None], entry: tuple[Plan, str] | None,
                     all_extras: list[dict[str, Any]]) -> tuple[Plan, str]:
        """The plan every rank runs: the cached ``entry``, else local rank 0's (:meth:`_offer_plan`)."""
        return entry if entry is not None else self._adopt_plan(plan_key, Plan.from_dict(all_extras[0]["plan"]))

    def _run(self, collective: str, name: str | None, arr: np.ndarray, flat: np.ndarray, dtype: str, op: str,
             root: int | None, plan_key: tuple[str, int | None], make_pieces) -> None:
        nbytes = flat.nbytes
        bucket = (collective, bucket_of(nbytes))
        # "t": this rank's throughput (bytes/s) of the previous message of the bucket.
        extras: dict[str, Any] = {"t": self._last_rate.pop(bucket, None)}
        entry = self._offer_plan(plan_key, extras)
        itemsize = flat.dtype.itemsize

        def build(all_extras: list[dict[str, Any]]) -> list[Piece]:
            plan, digest = self._agreed_plan(plan_key, entry, all_extras)
            chunk = self._chunk_elems(all_extras, nbytes, itemsize, collective)
            return make_pieces(plan, digest, chunk)

        ex = self._executor
        ex.collective(  # type: ignore[union-attr]
            self._label(collective, name), self._checked(collective, name, arr, dtype, op, root), extras,
            flat, dtype, op, build,
        )
        if ex.last_setup_free and ex.last_run_seconds > 0:  # type: ignore[union-attr]
            self._last_rate[bucket] = nbytes / ex.last_run_seconds  # type: ignore[union-attr]

    def _cuda(self, collective: str, name: str | None, arr: Any, op: str | None, root: int | None) -> Any:
        """allreduce or broadcast of a CUDA array (:meth:`_run_cuda`); returns ``arr``."""
        flat = _DeviceFlat.of(arr, collective)
        if self._executor is not None and flat.size:
            self._run_cuda(collective, name, arr, flat, flat.dtype_name, op, root)
        return arr

    def _run_cuda(self, collective: str, name: str | None, arr: Any, flat: _DeviceFlat, dtype: str,
                  op: str | None, root: int | None) -> None:
        """One collective on a CUDA tensor: the tree kernel (:mod:`.gpu.tree_executor`) runs the plan's trees
        directly over every rank's tensor, launched on the tensor's current stream."""
        # The hierarchical stages run the allreduce plan's two phases apart (reduce up, broadcast down).
        plan_key = ("broadcast", root) if collective == "broadcast" else ("allreduce", None)
        ex = self._executor
        # Everything that decides this collective's metadata and kernel: a repeat (a training step's
        # buckets) replays the prepared launch.
        key = (collective, name, flat.ptr, flat.size, dtype, op, root)
        with self._lock:
            if ex.replay(key, flat.ptr, flat.stream):  # type: ignore[union-attr]
                return
            extras: dict[str, Any] = {}
            entry = self._offer_plan(plan_key, extras)

            def plan_of(all_extras: list[dict[str, Any]]) -> tuple[Plan, str]:
                return self._agreed_plan(plan_key, entry, all_extras)

            self._executor.collective(  # type: ignore[union-attr]
                self._label(collective, name), self._checked(collective, name, arr, dtype, op, root), extras,
                flat, dtype, op, plan_of, kind=collective, stream=flat.stream, replay_key=key, known_plan=entry)

    def _eager(self, collective: str, name: str | None, arr: np.ndarray, flat: np.ndarray, dtype: str,
               op: str | None, root: int | None) -> None:
        n = self.local_size
        segments = [segment_bounds(flat.size, n, i) for i in range(n)]
        self._executor.eager_collective(  # type: ignore[union-attr]
            self._label(collective, name), self._checked(collective, name, arr, dtype, op, root), {},
            flat, dtype, op or "sum", collective, root or 0, segments,
        )

    # -- the collectives -------------------------------------------------------------
    def allreduce(self, arr: np.ndarray, op: str = "sum", name: str | None = None) -> np.ndarray:
        """Reduce ``arr`` over the server's ranks, in place; returns ``arr``."""
        op = check_op(op)
        if self.device == "cuda":  # (the host path of every CUDA collective: no Piece settings to build)
            return self._cuda("allreduce", name, arr, op, None)
        # The executor divides an average where each sum is final (runtime.steps).
        return self._direct("allreduce", name, arr, op, None, average=self.local_size if op == "average" else 0)

    def broadcast(self, arr: np.ndarray, root: int = 0, name: str | None = None) -> np.ndarray:
        """Every rank's ``arr`` becomes local rank ``root``'s, in place; returns ``arr``."""
        if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= int(root) < self.local_size:
            raise ConfigError(f"root: expected a local rank in 0..{self.local_size - 1}, got {root!r}")
        root = int(root)
        if self.device == "cuda":
            return self._cuda("broadcast", name, arr, None, root)
        me = self.local_rank
        return self._direct("broadcast", name, arr, None, root, has_input=me == root, wants_output=me != root)

    def _direct(self, collective: str, name: str | None, arr: np.ndarray, op: str | None, root: int | None,
                **fields: Any) -> np.ndarray:
        """allreduce or broadcast: small messages in the eager round, larger ones in pieces that each
        map a contiguous part of the array (``fields``: the pieces' :class:`Piece` settings)."""
        flat, dtype = self._flat(arr, collective)
        if self._executor is None or flat.size == 0:
            return arr
        with self._lock:
            if flat.nbytes <= self.eager_bytes:
                self._eager(collective, name, arr, flat, dtype, op, root)
                if op == "average":
                    finish_average(flat, self.local_size, dtype)
                return arr
            piece = max(1, MAX_PIECE_BYTES // flat.dtype.itemsize)

            def pieces(plan: Plan, digest: str, chunk: int) -> list[Piece]:
                return [Piece(self.program(plan, digest, min(piece, flat.size - a), chunk, collective), direct=a,
                              **fields) for a in range(0, flat.size, piece)]

            self._run(collective, name, arr, flat, dtype, op, root, (collective, root), pieces)
        return arr

    def _segment_pieces(self, flat: np.ndarray) -> list[list[Run]]:
        """Runs of each piece for the hierarchical stages (module docstring)."""
        n, count = self.local_size, flat.size
        bounds = [segment_bounds(count, n, i) for i in range(n)]
        q = max(1, MAX_PIECE_BYTES // flat.dtype.itemsize // n)
        full = (count // n) // q
        out: list[list[Run]] = []
        for k in range(full):
            out.append([(lo + k * q, i * q, q) for i, (lo, _) in enumerate(bounds)])
        rest = count - full * q * n
        if rest > 0:
            runs, pos = [], 0
            for lo, hi in bounds:
                m = hi - lo - full * q
                runs.append((lo + full * q, pos, m))
                pos += m
            out.append(runs)
        return out

    def synchronize(self) -> None:
        """Wait until this rank's launched collectives are done (CUDA; a no-op on CPU, where they are)."""
        if self.device == "cuda" and self._executor is not None:
            self._executor.synchronize()

    def reduce_to_roots(self, arr: np.ndarray, op: str = "sum", name: str | None = None) -> tuple[int, int]:
        """Stage 1: local rank i's ``arr[start:end]`` becomes the server's op over its segment.

        Returns ``(start, end)`` in elements of the flattened array; elements
        outside it keep this rank's input on CPU, and may hold partial
        reductions on CUDA (the tree kernel's reduce phase works in place;
        stage 3 overwrites them).  ``average`` divides by the server's rank
        count (the hierarchical caller sums and divides once).
        """
        op = check_op(op)
        flat, dtype = self._staged("reduce_to_roots", name, arr, op, "reduce", lambda runs, me: (runs, [runs[me]]))
        start, end = segment_bounds(flat.size, self.local_size, self.local_rank)
        if op == "average" and self._executor is not None and self.device == "cpu":  # CUDA: the roots divide
            finish_average(flat[start:end], self.local_size, dtype)
        return start, end

    def broadcast_from_roots(self, arr: np.ndarray, name: str | None = None) -> np.ndarray:
        """Stage 3: local rank i's segment of ``arr`` goes to every rank; returns ``arr``."""
        self._staged("broadcast_from_roots", name, arr, None, "broadcast",
                     lambda runs, me: ([runs[me]], [r for i, r in enumerate(runs) if i != me]))
        return arr

    def _staged(self, collective: str, name: str | None, arr: np.ndarray, op: str | None, kind: str,
                stages: Callable[[list[Run], int], tuple[list[Run], list[Run]]]) -> tuple[np.ndarray, str]:
        """reduce_to_roots or broadcast_from_roots: small messages in the eager round, larger ones in
        pieces of every segment (:meth:`_segment_pieces`) of the ``kind`` program, each staged in and
        out as ``stages(runs, local_rank)`` says.  Returns the flat array and its dtype."""
        flat, dtype = self._flat(arr, collective)
        if self.device == "cuda":  # the tree kernel runs one phase of the allreduce plan's trees
            if self._executor is not None and flat.size:
                self._run_cuda(collective, name, arr, flat, dtype, op, None)
            return flat, dtype
        if self._executor is None or flat.size == 0:
            return flat, dtype
        with self._lock:
            if flat.nbytes <= self.eager_bytes:
                self._eager(collective, name, arr, flat, dtype, op, None)
                return flat, dtype

            def pieces(plan: Plan, digest: str, chunk: int) -> list[Piece]:
                return [Piece(self.program(plan, digest, sum(r[2] for r in runs), chunk, kind),
                              *stages(runs, self.local_rank)) for runs in self._segment_pieces(flat)]

            self._run(collective, name, arr, flat, dtype, op, None, ("allreduce", None), pieces)
        return flat, dtype

    def allgather_object(self, obj: Any, name: str | None = None) -> list[Any]:
        """Every local rank's small picklable ``obj`` (up to ~48 KB pickled), through the
        shared metadata slots: microseconds, where a file rendezvous takes milliseconds."""
        import base64
        import pickle

        if self._executor is None:
            return [obj]
        payload = base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
        with self._lock:
            extras = self._executor.collective(
                self._label("allgather_object", name), {"collective": "allgather_object", "name": name or ""},
                {"o": payload}, np.empty(0, np.uint8), "uint8", "sum", lambda _: [],
            )
        return [pickle.loads(base64.b64decode(e["o"])) for e in extras]

    def barrier(self) -> None:
        """Every local rank reaches this point (through the metadata slots)."""
        self.allgather_object(None, "barrier")

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Free the shared memory and leave the server (idempotent)."""
        if self._executor is not None:
            self._executor.close()
        elif self._transport is not None:
            self._transport.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def transport(self) -> Transport | None:
        return self._transport


class _DeviceFlat:
    """A C-contiguous CUDA array seen as flat elements: size, nbytes, dtype, its device address (``ptr``) and
    the stream its producer works on (a torch tensor's current stream; None: CuPy's current stream)."""

    __slots__ = ("dtype", "dtype_name", "nbytes", "ptr", "size", "stream")

    def __init__(self, ptr: int, size: int, dtype: np.dtype | None, name: str, stream: int | None = None) -> None:
        self.ptr, self.size, self.dtype, self.dtype_name, self.stream = ptr, size, dtype, name, stream
        self.nbytes = size * numpy_dtype(name).itemsize

    def data_ptr(self) -> int:
        return self.ptr

    @classmethod
    def of(cls, arr: Any, what: str) -> _DeviceFlat:
        torch_name = _torch_dtype_name(arr)
        if torch_name is not None:  # torch: bfloat16 has no __cuda_array_interface__ typestr
            if not arr.is_cuda:
                raise ConfigError(f"{what}: expected a CUDA tensor on device 'cuda', got a {arr.device} tensor")
            if not arr.is_contiguous():
                raise ConfigError(f"{what}: the CUDA tensor must be contiguous (shape {list(arr.shape)}, strides "
                                  f"{list(arr.stride())})")
            return cls(arr.data_ptr(), arr.numel(), None, torch_name, _torch_stream(arr.get_device()))
        cai = getattr(arr, "__cuda_array_interface__", None)
        if cai is None:
            raise ConfigError(f"{what}: expected a CUDA array (CuPy, torch, __cuda_array_interface__) on device "
                              f"'cuda', got {type(arr).__name__}")
        shape = tuple(cai["shape"])
        known = _CAI_SEEN.get(cai["typestr"])
        if known is None:
            dt = np.dtype(cai["typestr"])
            known = _CAI_SEEN[cai["typestr"]] = (dt, dtype_name(dt))
        dt = known[0]
        size = math.prod(shape)
        strides = cai.get("strides")
        if strides is not None:
            want, acc = [], dt.itemsize
            for d in reversed(shape):
                want.append(acc)
                acc *= d
            if size > 1 and tuple(st for st, d in zip(strides, shape) if d > 1) != tuple(
                    st for st, d in zip(reversed(want), shape) if d > 1):
                raise ConfigError(f"{what}: the CUDA array must be C-contiguous (shape {list(shape)}, strides "
                                  f"{list(strides)})")
        return cls(int(cai["data"][0]), size, dt, known[1])


_TORCH_NAMES = {"float32": "float32", "float64": "float64", "float16": "float16", "bfloat16": "bfloat16",
                "int32": "int32", "int64": "int64", "int8": "int8", "uint8": "uint8", "int16": "int16"}


_CAI_SEEN: dict[str, tuple[np.dtype, str]] = {}  # __cuda_array_interface__ typestr -> dtype, Blink's name
_TORCH_SEEN: dict[Any, str] = {}  # torch dtype -> Blink's name (this runs on every collective)


def _torch_dtype_name(arr: Any) -> str | None:
    """Blink's name of a torch tensor's dtype (None: not a torch tensor)."""
    dt = getattr(arr, "dtype", None)
    hit = _TORCH_SEEN.get(dt)
    if hit is not None:
        return hit
    if type(arr).__module__.split(".")[0] != "torch" or not hasattr(arr, "data_ptr"):
        return None
    name = str(arr.dtype).removeprefix("torch.")
    if name not in _TORCH_NAMES:
        raise ConfigError(f"dtype: torch.{name} is not supported (expected one of {', '.join(_TORCH_NAMES)})")
    _TORCH_SEEN[dt] = _TORCH_NAMES[name]
    return _TORCH_NAMES[name]


def _torch_stream(device: int) -> int:
    """The raw ``cudaStream_t`` torch's current stream of ``device`` (torch's own accessor where it has one:
    no Stream object per call)."""
    global _RAW_STREAM
    if _RAW_STREAM is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return int(_RAW_STREAM(device))


_RAW_STREAM: Any = None  # the current raw stream of a device, found once
