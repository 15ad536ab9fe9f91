"""``blink perf``: the benchmark, with nccl-tests' flags, columns and checking (FORMATS.md section 3).

Modelled on nccl-tests (``src/common.cu``): sizes from ``-b`` to ``-e`` by
``-f`` (or ``-i``), ``-w`` warm-up and ``-n`` timed iterations, ``-c 1``
checking with data whose result is exactly predictable
(:mod:`blink_horovod.runtime.verifiable`), and the columns ``size count type
redop root time algbw busbw #wrong``; ``busbw`` is ``algbw * 2(n-1)/n`` for
allreduce and ``algbw`` for broadcast (nccl-tests ``doc/PERFORMANCE.md``).
``time`` is the slowest rank's mean time per iteration.

What is timed (``--impl``, a comma-separated list):

- ``blink``: the call users make, ``hvd.allreduce_``/``hvd.broadcast_`` on
  torch CPU tensors with Blink enabled (as ``BLINK_ENABLE=1``): Horovod's API,
  the ops layer's engine and hierarchy, the communicator.  Needs Horovod
  (``horovodrun``/``blinkrun``); the default there.
- ``raw``: Blink's communicator called directly (and, across servers, the
  three stages with the cross-server stage on Horovod or MPI): no Horovod
  API, no engine.  The default where there is no Horovod (ranks started by
  hand, ``mpirun`` with mpi4py) and the only one on CUDA tensors.
- ``horovod``: stock Horovod, the same calls stepping around Blink.
- ``both``: ``blink,horovod``, in the same run, their columns side by side, as
  nccl-tests puts out-of-place and in-place side by side.

Ranks come from Horovod (under ``horovodrun``/``blinkrun``), from mpi4py
(under ``mpirun`` where Horovod is not built), from a directory of files
(``--rendezvous-dir DIR --rank R --nranks N``, ranks started by hand), or
there is one rank.  With several servers, Blink's allreduce is the
hierarchical one: intra-server reduce over Blink's trees, cross-server
allreduce of each segment among the same-local-rank ranks (a Horovod process
set, or an MPI communicator), intra-server broadcast.

Exit status: 0, or 1 if any ``#wrong`` > 0 (bad input: 2).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import load_config
from ..errors import ConfigError
from ..units import parse_number, parse_size

__all__ = ["busbw_factor", "register", "run", "size_list"]

IMPLS = ("blink", "raw", "horovod")
COLLECTIVES = ("allreduce", "broadcast")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "perf",
        help="benchmark Blink's collectives (and stock Horovod's) like nccl-tests",
        description=(
            "Benchmark allreduce/broadcast over this server's ranks (and the servers of a Horovod job) with "
            "nccl-tests' flags and columns; -c 1 checks every result exactly and the exit status is 1 if "
            "any element is wrong. Run under horovodrun/blinkrun, mpirun, or alone."
        ),
        epilog="Sizes take K, M, G suffixes (2^10, 2^20, 2^30 bytes); rates are GB/s (10^9 bytes/s).",
    )
    p.add_argument("-b", "--minbytes", default="32M", help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", default="32M", help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", default="2", help="multiply the size by this (default 2)")
    p.add_argument("-i", "--stepbytes", default=None, help="add this many bytes instead of -f")
    p.add_argument("-n", "--iters", default="20", help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", default="5", help="warm-up iterations per size (default 5)")
    p.add_argument("-c", "--check", default="1", help="1: check every result exactly (default), 0: do not")
    p.add_argument("--collective", default="allreduce", help="allreduce (default) or broadcast")
    p.add_argument("-o", "--op", default="sum", help="sum, average, min, max, product, or all (default sum)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32 (float), float64 (double), float16 (half), bfloat16, int32, int64, int8, uint8, "
                        "int16, or all (default float32)")
    p.add_argument("-r", "--root", default="0", help="broadcast root rank (default 0)")
    p.add_argument("--impl", default=None,
                   help="what to time, a comma-separated list: blink (hvd.allreduce_ with Blink enabled; the default "
                        "under Horovod), raw (Blink's communicator alone; the default elsewhere), horovod (stock), "
                        "or both (blink,horovod side by side)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON (rank 0, atomically)")
    p.add_argument("--rendezvous-dir", default=None, help="ranks started by hand: a directory they share")
    p.add_argument("--rank", default=None, help="with --rendezvous-dir: this rank")
    p.add_argument("--nranks", default=None, help="with --rendezvous-dir: the number of ranks")
    p.set_defaults(func=run)


# -- argument checking --------------------------------------------------------------
def _int(text: str, flag: str, minimum: int) -> int:
    return parse_number(text, flag, int, f"an integer >= {minimum}", lambda v: v >= minimum)


def size_list(minbytes: int, maxbytes: int, factor: int, stepbytes: int | None) -> list[int]:
    """nccl-tests' sizes: ``minbytes`` up to ``maxbytes`` by ``*factor`` (or ``+stepbytes``)."""
    if maxbytes < minbytes:
        raise ConfigError(f"-e: maxbytes {maxbytes} is below minbytes {minbytes}")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        nxt = size + stepbytes if stepbytes else size * factor
        if nxt <= size:
            break
        size = nxt
    return out


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: allreduce 2(n-1)/n, broadcast 1."""
    return 2.0 * (n - 1) / n if collective == "allreduce" and n > 1 else 1.0


@dataclass
class _Args:
    sizes: list[int]
    iters: int
    warmup: int
    check: bool
    collective: str
    ops: list[str]
    dtypes: list[str]
    root: int
    impls: list[str]
    json_path: str | None
    factor_text: str
    minbytes: int
    maxbytes: int
    device: str = "cpu"


def _impls(text: str | None, device: str) -> list[str]:
    """``--impl`` as a list (module docstring); unset: ``blink`` under Horovod on CPU tensors, else ``raw``."""
    if text is None:
        return ["blink"] if _under_horovod() and device == "cpu" else ["raw"]
    impls: list[str] = []
    for word in str(text).strip().lower().split(","):
        for impl in ("blink", "horovod") if word.strip() == "both" else (word.strip(),):
            if impl not in IMPLS:
                raise ConfigError(f"--impl: expected blink, raw, horovod or both, got {text!r}")
            if impl not in impls:
                impls.append(impl)
    return impls


def _parse(args: argparse.Namespace) -> _Args:
    from ..runtime.dtypes import DTYPES, OPS, canonical_dtype, check_op

    minbytes = parse_size(args.minbytes, "-b")
    maxbytes = parse_size(args.maxbytes, "-e")
    if minbytes < 1:
        raise ConfigError(f"-b: expected at least 1 byte, got {args.minbytes!r}")
    factor = _int(args.stepfactor, "-f", 1)
    stepbytes = parse_size(args.stepbytes, "-i") if args.stepbytes is not None else None
    if stepbytes is None and factor < 2 and maxbytes > minbytes:
        raise ConfigError(f"-f: a step factor of {factor} never reaches -e {args.maxbytes}; use -f 2 or more, or -i")
    collective = str(args.collective).strip().lower()
    if collective not in COLLECTIVES:
        raise ConfigError(f"--collective: expected allreduce or broadcast, got {args.collective!r}")
    device = str(args.device).strip().lower()
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device: expected cpu or cuda, got {args.device!r}")
    impls = _impls(args.impl, device)
    if device == "cuda":
        from ..runtime.gpu.device import available

        ok, why = available()
        if not ok:
            raise ConfigError(f"--device: cuda is not usable here ({why}); use --device cpu")
        if impls != ["raw"]:
            raise ConfigError(f"--impl: {','.join(impls)} with --device cuda: blink perf times Blink's communicator "
                              "alone on CUDA tensors; use --impl raw (and nccl-tests for NCCL)")
    check = _int(args.check, "-c", 0)
    if check not in (0, 1):
        raise ConfigError(f"-c: expected 0 or 1, got {args.check!r}")
    ops = list(OPS) if str(args.op).strip().lower() == "all" else [check_op(args.op)]
    if str(args.dtype).strip().lower() == "all":
        dtypes = list(DTYPES)
    else:
        dtypes = [canonical_dtype(d, "--dtype") for d in str(args.dtype).split(",")]
    if device == "cuda":
        try:
            import torch  # noqa: F401  # CUDA tensors are torch tensors (bfloat16 included)
        except ImportError:
            raise ConfigError("--device cuda: needs PyTorch with CUDA for its tensors") from None
    if collective == "broadcast":
        ops = ["sum"]  # no reduction; the column says "none"
    return _Args(
        sizes=size_list(minbytes, maxbytes, factor, stepbytes),
        iters=_int(args.iters, "-n", 1),
        warmup=_int(args.warmup_iters, "-w", 0),
        check=bool(check),
        collective=collective,
        ops=ops,
        dtypes=dtypes,
        root=_int(args.root, "-r", 0),
        impls=impls,
        json_path=args.json,
        factor_text=f"{stepbytes}(bytes)" if stepbytes else f"{factor}(factor)",
        minbytes=minbytes,
        maxbytes=maxbytes,
        device=device,
    )


# -- the job: ranks, servers and how to reach them --------------------------------------
@dataclass
class _Job:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    server: int = 0
    servers: int = 1
    launcher: str = "alone"
    hvd: Any = None
    process_sets: list = field(default_factory=list)  # Horovod: one per local rank index
    mpi: Any = None  # mpi4py world communicator
    mpi_cross: Any = None  # mpi4py: my local rank's communicator across servers
    rendezvous: Any = None
    comm: Any = None  # the Blink communicator of --impl raw, perf's own
    blink_comm: Any = None  # the ops layer's Blink communicator (--impl blink; None on a server of one rank)
    gather: Callable[[Any], list] = lambda obj: [obj]

    def server_of(self, rank: int) -> tuple[int, int]:
        """(server, local rank) of a global rank: servers hold consecutive ranks."""
        return rank // self.local_size, rank % self.local_size


def _under_horovod() -> bool:
    return "HOROVOD_RANK" in os.environ or "HOROVOD_HOSTNAME" in os.environ


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"))


def _env_int(*names: str) -> int | None:
    for name in names:
        raw = os.environ.get(name)
        if raw and raw.strip().isdigit():
            return int(raw)
    return None


def _start_horovod(job: _Job, cfg) -> None:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ConfigError(f"--impl: stock Horovod (horovod.torch) is not importable here: {exc}") from None
    size = _env_int("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE") or 1
    local = cfg.local_size or _env_int("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE") or size
    if size % local:
        raise ConfigError(f"BLINK_LOCAL_SIZE: {local} ranks per server do not divide the job's {size} ranks")
    sets = []
    if 1 < local < size:
        # One process set per local rank index: the ranks of the cross-server stage.
        sets = [hvd.ProcessSet([s * local + i for s in range(size // local)]) for i in range(local)]
    from ..ops.background import noting_new_threads

    with noting_new_threads():  # Horovod's threads (also noted by the BLINK_ENABLE hook's init, if installed)
        hvd.init(process_sets=sets) if sets else hvd.init()
    # One rank per server: the cross-server stage is the whole job, Horovod's global set (registering
    # it again fails Horovod's init with "mismatching numbers of process sets").
    job.hvd, job.process_sets = hvd, sets or ([hvd.global_process_set] if local == 1 else [])
    job.rank, job.size = hvd.rank(), hvd.size()
    job.local_size = local
    job.local_rank, job.server, job.servers = job.rank % local, job.rank // local, job.size // local
    if cfg.local_size is None and (hvd.local_rank(), hvd.local_size()) != (job.local_rank, local):
        raise ConfigError(
            f"BLINK_LOCAL_SIZE: Horovod placed rank {job.rank} as local rank {hvd.local_rank()} of "
            f"{hvd.local_size()}, not {job.local_rank} of {local} (ranks must be numbered server by server); "
            "set BLINK_LOCAL_SIZE"
        )
    job.launcher = "horovod"

    def gather(obj: Any) -> list:
        with _bypass():  # perf's bookkeeping, not a collective to count as one Blink sends to Horovod
            return hvd.allgather_object(obj)

    job.gather = gather


def _enable_blink() -> None:
    """Blink under ``horovod.torch`` as ``BLINK_ENABLE=1`` puts it there (before ``hvd.init``)."""
    from ..ops import hook

    os.environ["BLINK_ENABLE"] = "1"
    hook.install()


def _blink_context(job: _Job) -> None:
    """After ``hvd.init``: the ops layer's communicator, or why Blink stays out of the job."""
    from ..ops import torch_ops

    ctx = torch_ops.context()
    if ctx is None:
        raise ConfigError(f"--impl blink: Blink stays out of this job ({torch_ops.disabled_reason()})")
    job.blink_comm = ctx.communicator


def _make_job(a: _Args, args: argparse.Namespace, cfg) -> _Job:
    from ..runtime import rendezvous as rdv

    job = _Job()
    if args.rendezvous_dir:
        if args.rank is None or args.nranks is None:
            raise ConfigError("--rendezvous-dir: needs --rank R and --nranks N")
        n = _int(args.nranks, "--nranks", 1)
        r = _int(args.rank, "--rank", 0)
        if r >= n:
            raise ConfigError(f"--rank: {r} is not below --nranks {n}")
        if "raw" not in a.impls or len(a.impls) > 1:
            raise ConfigError("--impl: blink and horovod need Horovod (horovodrun, blinkrun); ranks started by hand "
                              "run --impl raw")
        job.rendezvous = rdv.FileRendezvous(args.rendezvous_dir, r, n, cfg.timeout_seconds)
        job.rank = job.local_rank = r
        job.size = job.local_size = n
        job.launcher = "files"
        job.gather = lambda obj: job.rendezvous.allgather(obj)
        return job
    if _under_horovod() or {"blink", "horovod"} & set(a.impls):
        if "blink" in a.impls:
            _enable_blink()
        _start_horovod(job, cfg)
        if "blink" in a.impls:
            _blink_context(job)
        if "raw" in a.impls:
            with _bypass():  # its allgather is perf's own, not the user's
                job.rendezvous = rdv.from_horovod(job.hvd, cfg)
        return job
    if _under_mpi():
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        job.mpi = world
        job.rendezvous = rdv.from_mpi(world, cfg)
        job.rank, job.size = world.Get_rank(), world.Get_size()
        job.local_rank, job.local_size = job.rendezvous.local_rank, job.rendezvous.local_size
        job.server, job.servers = job.rendezvous.server, job.rendezvous.servers
        if job.servers > 1:
            job.mpi_cross = world.Split(color=job.local_rank, key=job.rank)
        job.launcher = "mpi"
        job.gather = lambda obj: world.allgather(obj)
        return job
    return job


# -- the implementations -----------------------------------------------------------------
_WIDE = {"float16": np.float32, "bfloat16": np.float32, "int8": np.int32, "uint8": np.int32, "int16": np.int32}


def _to_torch(arr: np.ndarray, dtype: str):
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _hvd_op(hvd: Any, op: str) -> Any:
    return {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}[op]


def _bypass():
    """Stock Horovod even under BLINK_ENABLE=1 (the ops hook's own bypass, when installed)."""
    try:
        from ..ops.patching import bypass
    except ImportError:
        return contextlib.nullcontext()
    return bypass()


def _cross_allreduce(job: _Job, dtype: str, name: str) -> Callable[[np.ndarray, str], None]:
    """The cross-server stage for Blink's hierarchical allreduce: segment i among local ranks i."""
    from ..runtime.dtypes import finish_average  # noqa: F401 - average never reaches this stage
    from ..runtime.verifiable import to_float64

    def widen(seg: np.ndarray) -> np.ndarray:
        return to_float64(seg, dtype).astype(_WIDE[dtype]) if dtype in _WIDE else seg

    def narrow(seg: np.ndarray, wide: np.ndarray) -> None:
        if wide is seg:
            return
        if dtype == "bfloat16":
            from ..runtime.dtypes import f32_to_bf16, numpy_dtype

            bits = f32_to_bf16(wide.astype(np.float32))
            seg[...] = bits.view(numpy_dtype("bfloat16")) if seg.dtype != np.uint16 else bits
        else:
            seg[...] = wide.astype(seg.dtype)

    if job.hvd is not None:
        hvd, ps = job.hvd, job.process_sets[job.local_rank]

        def cross(seg: np.ndarray, op: str) -> None:
            wide = widen(seg)
            with _bypass():
                hvd.allreduce_(_to_torch(np.ascontiguousarray(wide), "x"), op=_hvd_op(hvd, op), name=name,
                               process_set=ps)
            narrow(seg, wide)

        return cross
    if job.mpi_cross is not None:
        from mpi4py import MPI

        ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}

        def cross_mpi(seg: np.ndarray, op: str) -> None:
            wide = np.ascontiguousarray(widen(seg) if dtype not in ("float32", "float64", "int32", "int64") else seg)
            job.mpi_cross.Allreduce(MPI.IN_PLACE, wide, op=ops[op])
            narrow(seg, wide)

        return cross_mpi
    raise ConfigError("several servers need Horovod or MPI for the cross-server stage")


def _cross_broadcast(job: _Job, dtype: str, root: int, name: str) -> Callable[[np.ndarray], None]:
    root_server, _ = job.server_of(root)
    if job.hvd is not None:
        hvd, ps = job.hvd, job.process_sets[job.local_rank]

        def cross(arr: np.ndarray) -> None:
            with _bypass():
                hvd.broadcast_(_to_torch(arr.reshape(-1).view(np.uint8), "uint8"), root_rank=root, name=name,
                               process_set=ps)

        return cross
    if job.mpi_cross is not None:

        def cross_mpi(arr: np.ndarray) -> None:
            job.mpi_cross.Bcast(arr.reshape(-1).view(np.uint8), root=root_server)

        return cross_mpi
    raise ConfigError("several servers need Horovod or MPI for the cross-server stage")


def _raw_step(job: _Job, a: _Args, dtype: str, op: str, name: str) -> tuple[Callable[[np.ndarray], None], Callable[[], None]]:
    """(one collective on an array, barrier) through Blink's communicator alone (``--impl raw``)."""
    from ..runtime.hierarchical import hierarchical_allreduce, hierarchical_broadcast

    comm = job.comm
    if a.collective == "allreduce":
        if job.servers > 1:
            cross = _cross_allreduce(job, dtype, name + ".cross")
            step = lambda x: hierarchical_allreduce(comm, x, op, cross, job.size, name=name)
        else:
            step = lambda x: comm.allreduce(x, op, name=name)
    else:
        _, root_local = job.server_of(a.root)
        if job.servers > 1:
            cross_b = _cross_broadcast(job, dtype, a.root, name + ".cross")
            step = lambda x: hierarchical_broadcast(comm, x, root_local, cross_b, name=name)
        else:
            step = lambda x: comm.broadcast(x, root_local, name=name)

    def barrier() -> None:
        if job.servers > 1:
            job.gather(None)
        else:
            comm.barrier()

    return step, barrier


_HVD_TYPES = {"float16", "float32", "float64", "int32", "int64"}  # what stock horovod.torch reduces on CPU here
# The same calls with Blink: Horovod's own argument check stays (it refuses bfloat16 CPU tensors), and the
# ops layer carries the 8- and 16-bit integers that Horovod has no CPU kernels for (ops/torch_ops.py).
_BLINK_TYPES = _HVD_TYPES | {"uint8", "int8", "int16"}


def _hvd_step(job: _Job, a: _Args, dtype: str, op: str, name: str, stock: bool):
    """(one collective, barrier) as users call it, ``hvd.allreduce_``/``hvd.broadcast_`` on a torch tensor
    sharing the array's memory: carried by Blink (``--impl blink``: the ops layer's engine, hierarchy and
    communicator), or by stock Horovod around Blink (``stock``).  (None, None) for an allreduce of a dtype
    the call refuses; a broadcast of one moves the bytes as uint8."""
    hvd = job.hvd
    types = _HVD_TYPES if stock else _BLINK_TYPES
    if dtype not in types and a.collective == "allreduce":
        return None, None
    around = _bypass if stock else contextlib.nullcontext
    if a.collective == "allreduce":
        hop = _hvd_op(hvd, op)

        def step(x: np.ndarray) -> None:
            with around():
                hvd.allreduce_(_to_torch(x, dtype), op=hop, name=name)
    else:

        def step(x: np.ndarray) -> None:
            with around():
                hvd.broadcast_(_to_torch(x.reshape(-1).view(np.uint8), "uint8") if dtype not in types
                               else _to_torch(x, dtype), root_rank=a.root, name=name)

    def barrier() -> None:
        with _bypass():
            hvd.allreduce_(_to_torch(np.zeros(1, np.float32), "float32"), op=hvd.Sum, name="blink.perf.barrier")

    return step, barrier


_STEPS = {"blink": functools.partial(_hvd_step, stock=False), "raw": _raw_step,
          "horovod": functools.partial(_hvd_step, stock=True)}


# -- measuring ------------------------------------------------------------------------------
@dataclass
class _Row:
    impl: str
    size: int
    count: int
    dtype: str
    op: str
    time_us: float | None
    algbw: float | None
    busbw: float | None
    wrong: int | None  # None: not checked; -1 in the table: not run (n/a)
    cpu_us: float | None = None  # mean over ranks of CPU time per iteration (process_time: all threads)
    bound: float | None = None  # busbw at the HBM bound (ranks sharing a GPU), same run


def _rounds(a: _Args) -> list[int]:
    """Timed iterations per round: with two implementations the timed loop alternates between them
    in up to 5 rounds, so that both see the same machine (a shared host's load drifts within
    seconds); one implementation runs its loop in one round, as nccl-tests does."""
    k = min(a.iters, 5) if len(a.impls) > 1 else 1
    return [a.iters // k + (1 if i < a.iters % k else 0) for i in range(k)]


def _measure(job: _Job, a: _Args, dtype: str, op: str, size: int) -> dict[str, _Row]:
    """One size through every implementation of ``a.impls``: check, warm up, time, check again."""
    from ..runtime.dtypes import numpy_dtype
    from ..runtime.verifiable import count_wrong, expected, make_input

    dt = numpy_dtype(dtype)
    count = size // dt.itemsize
    name = f"blink.perf.{a.collective}.{dtype}.{op}.{size}"
    runs: dict[str, tuple[Callable[[np.ndarray], None], Callable[[], None]]] = {}
    for impl in a.impls:
        step, barrier = _STEPS[impl](job, a, dtype, op, name)
        if all(job.gather(step is not None)):
            runs[impl] = (step, barrier)
    rows = {impl: _Row(impl, size, count, dtype, op, None, None, None, None) for impl in a.impls}
    if not runs:
        return rows
    # The same data for every implementation: generated once, copied for each checked run.
    want = expected(dtype, job.size, count, op, a.collective, a.root) if a.check else None
    data = make_input(dtype, job.size, job.rank, count, op, a.collective, a.root) if a.check else None

    cuda = a.device == "cuda"

    def done() -> None:  # CUDA collectives return once launched
        if cuda:
            job.comm.synchronize()

    def checked_run(impl: str) -> int:
        y = _to_cuda(data, dtype) if cuda else data.copy()
        runs[impl][0](y)
        done()
        return count_wrong(_from_cuda(y, dt) if cuda else y, want, dtype)

    # Checked before timing (the first, cold programs) and after it (the tuned ones).
    wrong = {impl: checked_run(impl) if a.check else 0 for impl in runs}
    x = _to_cuda(np.zeros(count, dt), dtype) if cuda else np.zeros(count, dt)
    for impl, (step, _) in runs.items():
        for _ in range(a.warmup):
            step(x)
        done()
    if job.servers == 1 or a.collective == "broadcast":
        kinds = [a.collective]
    else:
        kinds = ["reduce_to_roots", "broadcast_from_roots"]
    for impl, comm in (("blink", job.blink_comm), ("raw", job.comm)):
        if impl not in runs or cuda:  # no online tuning on GPUs yet
            continue
        # MIAD settles the chunk size during the first iterations; finish that before timing.
        step = runs[impl][0]
        extra = 0
        while extra < 40 and not all(job.gather(comm is None or all(comm.tuning_converged(k, x.nbytes)
                                                                     for k in kinds))):
            step(x)
            extra += 1
    elapsed = dict.fromkeys(runs, 0.0)
    cpu = dict.fromkeys(runs, 0.0)
    order = list(runs)
    for k, iters in enumerate(_rounds(a)):
        # Alternate which implementation goes first, so that neither always follows the other.
        for impl in order if k % 2 == 0 else order[::-1]:
            step, barrier = runs[impl]
            barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(iters):
                step(x)
            done()
            elapsed[impl] += time.perf_counter() - start
            cpu[impl] += time.process_time() - cpu_start
    if a.check:
        for impl in runs:
            wrong[impl] += checked_run(impl)
    bound = _bound(job, a, size) if cuda else None
    for impl in runs:
        stats = job.gather((elapsed[impl] / a.iters, wrong[impl], cpu[impl] / a.iters))
        slowest = max(t for t, _, _ in stats)
        algbw = size / slowest / 1e9 if slowest > 0 else 0.0
        rows[impl] = _Row(impl, size, count, dtype, op, slowest * 1e6, algbw,
                          algbw * busbw_factor(a.collective, job.size),
                          sum(w for _, w, _ in stats) if a.check else None,
                          sum(c for _, _, c in stats) / len(stats) * 1e6, bound)
    return rows


def _to_cuda(arr: np.ndarray, dtype: str):
    """A CUDA torch tensor holding ``arr`` (bfloat16: numpy's uint16 or ml_dtypes storage, bit for bit)."""
    import torch

    t = _to_torch(np.ascontiguousarray(arr), dtype).cuda()
    torch.cuda.synchronize()
    return t


def _from_cuda(t, dt: np.dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(dt)
    return t.cpu().numpy()


def _bound(job: _Job, a: _Args, size: int) -> float | None:
    """The yardstick of a CUDA row, as busbw: the HBM bound where ranks share a GPU (:func:`_hbm_bound`),
    else the plan's proven optimum (every GPU's links busy: algbw = the plan's rate)."""
    ex = job.comm._executor if job.comm is not None else None
    if ex is None:
        return None
    if getattr(ex, "ranks_on_device", 1) >= 2:
        return _hbm_bound(job, a, size)
    plan = job.comm.plan(a.collective, None if a.collective == "allreduce" else job.server_of(a.root)[1])
    return optimum_busbw(plan.rate_gbps, a.collective, job.local_size) if plan is not None else None


def optimum_busbw(rate_gbps: float, collective: str, n: int) -> float:
    """busbw (GB/s, nccl-tests' factor) of a collective that runs at the plan's rate: Blink's trees move
    each byte of the buffer at ``rate_gbps`` (section 3), so algbw is the rate."""
    return rate_gbps * busbw_factor(collective, n)


def _hbm_bound(job: _Job, a: _Args, size: int) -> float | None:
    """The busbw an allreduce (or broadcast) of ``size`` bytes could reach on a GPU the ranks share if every
    rank's input were read once and every output written once at the device's own copy rate, measured now
    by local rank 0 with the GPU otherwise idle.  A device-to-device copy of ``b`` bytes moves 2b, so the
    copy rate is 2b / t."""
    n = job.local_size
    import torch

    rate = 0.0
    job.comm.barrier()
    if job.local_rank == 0:
        src = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = max(3, min(50, (1 << 31) // max(size, 1)))
        start.record()
        for _ in range(reps):
            dst.copy_(src)
        end.record()
        end.synchronize()
        rate = 2 * size * reps / (start.elapsed_time(end) / 1e3)
        del src, dst
    rate = max(job.comm.allgather_object(rate, "blink.perf.copyrate"))
    return hbm_bound_busbw(rate, size, a.collective, n) if rate > 0 else None


def hbm_bound_busbw(copy_rate: float, size: int, collective: str, n: int) -> float:
    """busbw (GB/s) of a collective of ``size`` bytes on ``n`` ranks sharing one GPU that moves only the
    least HBM traffic at ``copy_rate`` (bytes/s, read and write counted): allreduce, n inputs read and n
    outputs written (2nN); broadcast, the root's input read once and n - 1 outputs written (nN)."""
    seconds = (2 * n if collective == "allreduce" else n) * size / copy_rate
    return size / seconds / 1e9 * busbw_factor(collective, n)


# -- printing (nccl-tests' layout) -------------------------------------------------------------
def _fmt_time(us: float) -> str:
    """nccl-tests' time column (``src/common.cu``): ``%7.0f`` from 10 ms, ``%7.1f`` from 100 us, else ``%7.2f``."""
    return f"{us:7.0f}" if us >= 1e4 else f"{us:7.1f}" if us >= 100.0 else f"{us:7.2f}"


def _group_cols(row: _Row | None, check: bool) -> str:
    """One implementation's columns, nccl-tests' ``"  %7s  %6.2f  %6.2f  %5g"`` (``N/A``: not checked)."""
    if row is None or row.time_us is None:
        return f"  {'n/a':>7}  {'n/a':>6}  {'n/a':>6}  {'n/a':>5}"
    wrong = f"{float(row.wrong):5g}" if check and row.wrong is not None else f"{'N/A':>5}"
    return f"  {_fmt_time(row.time_us)}  {row.algbw:6.2f}  {row.busbw:6.2f}  {wrong}"


def _header(job: _Job, a: _Args, pids: list, hosts: list) -> list[str]:
    from ..runtime.dtypes import NCCL_NAMES

    lines = [
        f"# blink perf: {a.collective}, impl {' + '.join(a.impls)}, {job.size} ranks "
        f"({job.servers} server{'s' if job.servers != 1 else ''} of {job.local_size}), launcher {job.launcher}",
        f"# nThread 1 nGpus 1 minBytes {a.minbytes} maxBytes {a.maxbytes} step: {a.factor_text} "
        f"warmup iters: {a.warmup} iters: {a.iters} agg iters: 1 validation: {int(a.check)} graph: 0",
        "#",
        "# Using devices",
    ]
    for r in range(job.size):
        s, lr = job.server_of(r)
        lines.append(f"#  Rank {r:2d} Group  0 Pid {pids[r]:6d} on {hosts[r]:>10} device {lr:2d} [{a.device}] "
                     f"server {s} local rank {lr}")
    comm = job.comm or job.blink_comm
    if comm is not None:
        topo = comm.topology
        chunk = "BLINK_CHUNK_BYTES" if comm.config.chunk_bytes else "MIAD"
        lines.append(f"# Blink: topology {topo.name} ({topo.n} ranks per server), chunk size: {chunk}; "
                     f"types: {', '.join(NCCL_NAMES[d] for d in a.dtypes)}")
        if a.device == "cpu":
            from ..runtime import streamcopy

            copies = streamcopy.status() if comm.config.stream_copy else "numpy copies (BLINK_STREAM_COPY=0)"
            lines.append(f"# Blink CPU chunk copies: {copies}")
    lines.append("#")
    # nccl-tests' three header lines (src/common.cu): group titles over 32-character column
    # groups where nccl-tests writes out-of-place / in-place, then names and units.
    groups = a.impls
    lead = f"# {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}"
    lines.append((lead + "".join(f"{g:^32}" for g in groups)).rstrip())
    cols = "".join(f"  {'time':>7}  {'algbw':>6}  {'busbw':>6} {'#wrong':>6}" for _ in groups)
    units = "".join(f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>5}" for _ in groups)
    if a.device == "cuda":  # the yardstick: the HBM bound where ranks share a GPU, else the plan's optimum
        cols += f"  {'bound':>6}  {'%bound':>6}"
        units += f"  {'(GB/s)':>6}  {'':>6}"
    lines.append(f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}{cols}")
    lines.append(f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}{units}")
    return lines


def _row_line(a: _Args, rows: dict[str, _Row]) -> str:
    from ..runtime.dtypes import NCCL_NAMES

    first = next(iter(rows.values()))
    redop = first.op if a.collective == "allreduce" else "none"
    root = -1 if a.collective == "allreduce" else a.root
    head = f"{first.size:12d}  {first.count:12d}  {NCCL_NAMES[first.dtype]:>8}  {redop:>6}  {root:6d}"
    line = head + "".join(_group_cols(rows.get(impl), a.check) for impl in a.impls)
    if a.device == "cuda":
        b = rows.get("raw")  # CUDA tensors: the communicator alone
        if b is not None and b.bound and b.busbw is not None:
            line += f"  {b.bound:6.1f}  {100 * b.busbw / b.bound:6.1f}"
        else:
            line += f"  {'n/a':>6}  {'n/a':>6}"
    return line


def _write_json(path: str, rows: list[_Row], a: _Args, job: _Job) -> None:
    from ..runtime.dtypes import NCCL_NAMES

    out = {"rows": [
        {"impl": r.impl, "collective": a.collective, "size": r.size, "count": r.count, "type": NCCL_NAMES[r.dtype],
         "time_us": r.time_us, "algbw": r.algbw, "busbw": r.busbw, "wrong": r.wrong, "cpu_us": r.cpu_us,
         "op": r.op if a.collective == "allreduce" else None, "root": a.root if a.collective == "broadcast" else None,
         "ranks": job.size, "servers": job.servers, "bound": r.bound}
        for r in rows
    ]}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".blink-perf-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(out, fh, indent=2)
            fh.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain open() would give
        os.replace(tmp, path)  # atomic: readers never see half a file
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    """``blink perf``: measure, print the table on rank 0, write ``--json``; 1 if any element is wrong."""
    a = _parse(args)
    cfg = load_config()
    job = _make_job(a, args, cfg)
    try:
        if "raw" in a.impls:
            from ..runtime.communicator import Communicator

            if a.device == "cuda" and job.servers > 1:
                raise ConfigError("--device cuda: one server only for now (the cross-server stage is not wired "
                                  "for CUDA tensors)")
            job.comm = Communicator(job.local_rank, job.local_size, None, job.rendezvous, cfg, device=a.device)
            if job.servers == 1:
                # Bookkeeping (times, #wrong) through the shared metadata slots: microseconds,
                # where Horovod's allgather_object costs milliseconds per call.
                job.gather = lambda obj: job.comm.allgather_object(obj, "blink.perf")
        pids = job.gather(os.getpid())
        hosts = job.gather(socket.gethostname())
        out = sys.stdout
        if job.rank == 0:
            print("\n".join(_header(job, a, pids, hosts)), file=out, flush=True)
        rows: list[_Row] = []
        for dtype in a.dtypes:
            for op in a.ops:
                for size in a.sizes:
                    from ..runtime.dtypes import numpy_dtype

                    if size < numpy_dtype(dtype).itemsize:
                        continue
                    measured = _measure(job, a, dtype, op, size)
                    rows.extend(measured.values())
                    if job.rank == 0:
                        print(_row_line(a, measured), file=out, flush=True)
                        if a.json_path:
                            _write_json(a.json_path, rows, a, job)  # after every row: a killed run keeps its rows
        wrong = sum(r.wrong or 0 for r in rows)
        if job.rank == 0:
            print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}", file=out)
            avgs = []
            for impl in a.impls:
                bws = [r.busbw for r in rows if r.impl == impl and r.busbw is not None]
                avg = f"{sum(bws) / len(bws):g}" if bws else "n/a"
                avgs.append(f"{avg} ({impl})" if len(a.impls) > 1 else avg)
            # nccl-tests: "# %-20s : %g", one figure per implementation here.
            print(f"# Avg bus bandwidth    : {'  '.join(avgs)}", file=out)
            if len(a.impls) == 2:
                for dtype in a.dtypes:
                    for op in a.ops:
                        b = [r for r in rows if r.impl == "blink" and r.dtype == dtype and r.op == op and r.busbw]
                        h = [r for r in rows if r.impl == "horovod" and r.dtype == dtype and r.op == op and r.busbw]
                        what = f"{dtype} {op}" if a.collective == "allreduce" else dtype
                        if b and h and b[-1].size == h[-1].size:
                            print(f"# blink/horovod busbw at {b[-1].size} B, {what}: "
                                  f"{b[-1].busbw / h[-1].busbw:.2f}x", file=out)
                        if b and h and b[-1].size == h[-1].size and b[-1].cpu_us and h[-1].cpu_us:
                            print(f"# CPU per rank per collective at {b[-1].size} B, {what}: blink "
                                  f"{b[-1].cpu_us / 1e3:.1f} ms, horovod {h[-1].cpu_us / 1e3:.1f} ms "
                                  f"({h[-1].cpu_us / b[-1].cpu_us:.2f}x)", file=out)
                        if b and h and b[0].size == h[0].size:
                            print(f"# latency at {b[0].size} B, {what}: blink {b[0].time_us:.1f} us, "
                                  f"horovod {h[0].time_us:.1f} us", file=out)
            print("#", file=out, flush=True)
            if a.json_path:
                _write_json(a.json_path, rows, a, job)
        return 1 if wrong > 0 else 0
    finally:
        if job.comm is not None:
            job.comm.close()
        if job.rendezvous is not None:
            job.rendezvous.close()
