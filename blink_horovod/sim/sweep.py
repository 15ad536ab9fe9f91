"""Blink against the NCCL model over allocations and sizes: the rows of ``blink simulate``.

Blink (section 5) evaluates "all allocations" of a server: every subset of its
GPUs a scheduler could hand a job.  :func:`gpu_subsets` lists them (3 GPUs or
more, as ``--allocations all``); :func:`compare` simulates one collective of
one size on one allocation with both Blink (sim/blink.py: planner, compiler,
chunk-level simulation) and NCCL (sim/nccl.py); :func:`sweep` does it for many,
with a progress bar, optionally on several processes.  The broadcast root is
the allocation's first GPU (docs/formats.md, ``blink simulate``).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from ..planner.plan import Plan
from ..topology.model import Topology
from .blink import Schedule, plan_for, simulate_plan
from .nccl import RingSet, nccl_estimate, nccl_rings
from .params import DEFAULT_PARAMS, SimParams
from .progress import Progress

__all__ = ["Row", "SweepResult", "compare", "geomean", "gpu_subsets", "nvlink_connected", "sweep"]

COLLECTIVES = ("allreduce", "broadcast")


@dataclass
class Row:
    """One (allocation, collective, size): Blink's simulated time against NCCL's."""

    gpus: list[int]
    collective: str
    size_bytes: int
    blink_s: float
    nccl_s: float
    speedup: float
    trees: int
    # Optional fields (docs/formats.md allows added ones):
    bound_s: float = 0.0  # size / the planner's proven optimum
    optimum_gbps: float = 0.0
    chunk_bytes: int = 0
    nccl_algorithm: str = ""
    nccl_protocol: str = ""
    nccl_channel: str = ""  # nvlink or pcie (NCCL's fallback)
    nccl_rings: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SweepResult:
    rows: list[Row]
    skipped: list[tuple[int, ...]]  # allocations left out (not NVLink-connected with --channels nvlink)

    @property
    def geomean_speedup(self) -> float:
        return geomean(r.speedup for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "geomean_speedup": self.geomean_speedup,
            "skipped": [list(s) for s in self.skipped],
        }


def geomean(values: Iterable[float]) -> float:
    """Geometric mean (nan for no values)."""
    vals = [float(v) for v in values]
    if not vals:
        return math.nan
    return math.exp(math.fsum(math.log(v) for v in vals) / len(vals))


def gpu_subsets(topology: Topology, min_gpus: int = 3) -> list[tuple[int, ...]]:
    """Every subset of the machine's GPUs with at least ``min_gpus`` GPUs, smallest first.

    Examples
    --------
    >>> from blink_horovod.topology import resolve
    >>> len(gpu_subsets(resolve("dgx1v")))  # C(8,3) + ... + C(8,8)
    219
    """
    gpus = sorted(topology.gpus)
    out: list[tuple[int, ...]] = []
    for k in range(min_gpus, len(gpus) + 1):
        out.extend(itertools.combinations(gpus, k))
    return out


def nvlink_connected(topology: Topology) -> bool:
    """Whether NVLink (direct links and switches) joins all of the topology's GPUs."""
    adj: dict[object, set[object]] = {}
    for link in topology.links:
        if link.kind == "nvlink":
            adj.setdefault(link.src, set()).add(link.dst)
            adj.setdefault(link.dst, set()).add(link.src)
    gpus = list(topology.gpus)
    if len(gpus) <= 1:
        return True
    seen = {gpus[0]}
    stack = [gpus[0]]
    while stack:
        v = stack.pop()
        for w in adj.get(v, ()):
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return all(g in seen for g in gpus)


def compare(
    topology: Topology,
    collective: str,
    size_bytes: int,
    *,
    channels: Sequence[str] | None = None,
    params: SimParams = DEFAULT_PARAMS,
    chunk_bytes: int | str | None = None,
    plan: Plan | None = None,
    rings: RingSet | None = None,
    lanes: str | None = None,
    schedule: Schedule | None = None,
) -> Row:
    """Simulate Blink and the NCCL model for one collective on ``topology`` (an allocation)."""
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective: expected one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if plan is None:
        root = topology.gpus[0] if collective == "broadcast" else None
        plan = plan_for(topology, collective, root=root, channels=channels)
    est = simulate_plan(plan, topology, size_bytes, chunk_bytes, params, lanes=lanes, schedule=schedule)
    nc = nccl_estimate(topology, collective, size_bytes, params, rings=rings)
    speedup = nc.time_s / est.time_s if est.time_s > 0 else math.inf
    return Row(
        gpus=list(topology.gpus),
        collective=collective,
        size_bytes=size_bytes,
        blink_s=est.time_s,
        nccl_s=nc.time_s,
        speedup=speedup,
        trees=est.trees,
        bound_s=est.bound_s,
        optimum_gbps=plan.optimum_gbps,
        chunk_bytes=est.chunk_bytes,
        nccl_algorithm=nc.algorithm,
        nccl_protocol=nc.protocol,
        nccl_channel=nc.rings.channel,
        nccl_rings=nc.rings.nchannels,
    )


def _job(args: tuple) -> list[Row]:
    """One (allocation, collective) with all sizes: the unit of work of a sweep."""
    topology, collective, sizes, channels, params, chunk_bytes, lanes, schedule = args
    root = topology.gpus[0] if collective == "broadcast" else None
    plan = plan_for(topology, collective, root=root, channels=channels)
    rings = nccl_rings(topology, params)
    return [
        compare(topology, collective, s, channels=channels, params=params, chunk_bytes=chunk_bytes, plan=plan, rings=rings,
                lanes=lanes, schedule=schedule)
        for s in sizes
    ]


def sweep(
    topology: Topology,
    allocations: Sequence[Sequence[int]] | None,
    collectives: Sequence[str],
    sizes: Sequence[int],
    *,
    channels: Sequence[str] | None = None,
    params: SimParams = DEFAULT_PARAMS,
    chunk_bytes: int | str | None = None,
    progress: bool = True,
    jobs: int = 1,
    note: Callable[[str], None] | None = None,
    lanes: str | None = None,
    schedule: Schedule | None = None,
) -> SweepResult:
    """Rows for every allocation x collective x size.

    Parameters
    ----------
    topology : the whole machine.
    allocations : GPU lists (each ordered; its first GPU is the broadcast
        root); None for the whole machine as one allocation.
    channels : as ``blink plan --channels``; without ``pcie`` (``["nvlink"]``),
        allocations NVLink does not connect are skipped, with a ``note``.
    jobs : worker processes (1: in this process).
    lanes : overrides the lane policy of ``schedule``.
    schedule : how plans are compiled (default sim/blink.py's ``SIM_SCHEDULE``).
    """
    for c in collectives:
        if c not in COLLECTIVES:
            raise ConfigError(f"collective: expected one of {', '.join(COLLECTIVES)}, got {c!r}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs: expected a positive integer, got {jobs!r}")
    note = note or (lambda msg: print(msg, file=sys.stderr))
    allocs = [tuple(topology.gpus)] if allocations is None else [tuple(a) for a in allocations]
    nvlink_only = channels is not None and "pcie" not in channels
    work = []
    skipped = []
    for a in allocs:
        sub = topology.allocate(a)
        if nvlink_only and not nvlink_connected(sub):
            skipped.append(a)
            continue
        for c in collectives:
            work.append((sub, c, list(sizes), None if channels is None else list(channels), params, chunk_bytes, lanes, schedule))
    if skipped:
        shown = ", ".join(",".join(map(str, a)) for a in skipped[:8])
        more = f" and {len(skipped) - 8} more" if len(skipped) > 8 else ""
        note(f"blink simulate: note: skipped {len(skipped)} allocation(s) that NVLink does not connect (--channels nvlink): {shown}{more}")
    rows: list[Row] = []
    with Progress(len(work), "simulate", enabled=progress) as bar:
        if jobs == 1 or len(work) <= 1:
            for w in work:
                rows.extend(_job(w))
                bar.advance(f"{w[0].name} {w[1]}")
        else:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for w, out in zip(work, pool.map(_job, work, chunksize=1)):
                    rows.extend(out)
                    bar.advance(f"{w[0].name} {w[1]}")
    return SweepResult(rows, skipped)
