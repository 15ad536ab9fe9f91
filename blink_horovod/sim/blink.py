"""Blink's side of a comparison: plan, pick a chunk size, compile, simulate.

:func:`simulate_blink` runs the real pipeline of the project -- the planner
(:func:`blink_horovod.planner.make_plan`), the schedule compiler
(:func:`blink_horovod.schedule.compile_program`) and the chunk-level
simulator (execute.py) -- for one collective on one allocation.

The chunk size trades per-chunk fixed costs against pipeline fill (Blink,
section 4, "Automatic chunk size selection").  Unless given, it is chosen by
:func:`choose_chunk_bytes` from a closed-form estimate of the simulated time
(steady state on the busiest link lane, plus fill over the deepest tree),
which is cheap enough to use on every allocation of a sweep; the MIAD tuner
(``blink_horovod.schedule.miad``) searches the simulator itself and is shown
against a full chunk-size sweep in docs/paper/ (figure d).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..planner.plan import Plan
from ..topology.model import Topology
from .execute import SimResult, simulate_program
from .params import DEFAULT_PARAMS, SimParams
from .resources import ResourceMap

__all__ = ["BlinkEstimate", "choose_chunk_bytes", "plan_for", "predict_time", "simulate_blink", "simulate_plan"]

GB = 1e9
FRACTION_EPS = 1e-9
MIN_CHUNK = 64 * 1024
# The simulator's cost grows with the number of ops; chunks are not made so
# small that one collective needs more than this many (the estimate's optimum
# lies far above it at the sizes that matter).
MAX_OPS = 60000


@dataclass
class BlinkEstimate:
    """One simulated Blink collective."""

    time_s: float
    bound_s: float  # size / plan.optimum_gbps: no schedule can beat it on these links
    plan: Plan
    chunk_bytes: int
    result: SimResult

    @property
    def trees(self) -> int:
        return sum(1 for t in self.plan.trees if t.fraction > FRACTION_EPS)

    @property
    def over_bound(self) -> float:
        """Simulated time over the proven bound, minus one (0.05 = 5% above)."""
        return self.time_s / self.bound_s - 1.0 if self.bound_s > 0 else math.inf


def plan_for(topology: Topology, collective: str, root: int | None = None, channels: Sequence[str] | None = None) -> Plan:
    """The planner's plan (cached under ``BLINK_PLAN_CACHE`` when the cache module exists)."""
    try:
        from ..planner.cache import cached_plan
    except ImportError:  # pragma: no cover - cache is part of the planner
        cached_plan = None
    if cached_plan is not None:
        return cached_plan(topology, collective, root=root, channels=channels)
    from ..planner import make_plan

    return make_plan(topology, collective, root=root, channels=channels)


def _tree_hops(plan: Plan, kind: str) -> int:
    """Longest chain of dependent chunk transfers in any tree (the pipeline's depth).

    Down a tree a chunk takes one hop per level.  Up a tree a node reduces its
    children's chunks one after the other (they write one region), so a node
    with k children adds k - 1 hops to the chain through it.
    """
    best = 0
    for t in plan.trees:
        if t.fraction <= FRACTION_EPS or not t.edges:
            continue
        kids = t.children()
        # Post-order (children before parents) without recursion.
        order, stack = [], [t.root]
        while stack:
            v = stack.pop()
            order.append(v)
            stack.extend(kids.get(v, ()))
        up: dict[int, int] = {}
        for v in reversed(order):
            cs = kids.get(v, ())
            up[v] = max(up[c] for c in cs) + len(cs) if cs else 0

        hops = 0
        if kind in ("allreduce", "reduce"):
            hops += up[t.root]
        if kind in ("allreduce", "broadcast"):
            hops += t.depth()
        best = max(best, hops)
    return best


def predict_time(plan: Plan, topology: Topology, size_bytes: int, chunk_bytes: int, params: SimParams = DEFAULT_PARAMS, kind: str | None = None, resources: ResourceMap | None = None) -> float:
    """Closed-form estimate of the simulated time (used to choose a chunk size).

    Steady state: every lane (one per incoming link of a rank, as the compiler
    assigns them) moves its bytes at its route's bottleneck and pays the fixed
    cost of each of its ops; every resource moves its bytes at its capacity.
    Fill and drain: the deepest tree's hops, each a *step* of the busiest
    lane, which moves one chunk of every tree crossing it per step (the
    compiler orders a lane's ops by pipeline step).
    """
    kind = kind or plan.collective
    rmap = resources or ResourceMap(topology, params)
    lanes: dict[tuple[int, int, str], list[float]] = {}
    res_bytes: dict[int, float] = {}
    L_copy = params.copy_s
    L_red = params.copy_s + params.reduce_extra_s
    for t in plan.trees:
        if t.fraction <= FRACTION_EPS or not t.edges:
            continue
        b = t.fraction * size_bytes
        nch = max(1, math.ceil(b / chunk_bytes))
        inner = {p for p, _ in t.edges}
        for p, c in t.edges:
            moves = []
            if kind in ("allreduce", "reduce"):
                moves.append((c, p, L_red + (params.post_s if c in inner else 0.0)))
            if kind in ("allreduce", "broadcast"):
                moves.append((p, c, L_copy + (params.post_s if c in inner else 0.0)))
            for src, dst, lat in moves:
                lane = lanes.setdefault((dst, src, t.channel), [0.0, 0.0, math.inf, 0.0])
                route = rmap.route(src, dst, t.channel)
                bottleneck = min(rmap.capacity[r] for r in route)
                lane[0] += b
                lane[1] += nch * lat
                lane[2] = min(lane[2], bottleneck)
                lane[3] += min(chunk_bytes, b) / bottleneck + lat
                for r in route:
                    res_bytes[r] = res_bytes.get(r, 0.0) + b
    if not lanes:
        return params.launch_s
    steady = max(max(v[0] / v[2] + v[1] for v in lanes.values()), max(b / rmap.capacity[r] for r, b in res_bytes.items()))
    step = max(v[3] for v in lanes.values())
    fill = max(0, _tree_hops(plan, kind) - 1) * step
    # The PCIe channel switch does not depend on the chunk size: left out.
    return params.launch_s + steady + fill


def _op_count(plan: Plan, size_bytes: int, chunk_bytes: int, kind: str) -> int:
    per_edge = 2 if kind == "allreduce" else 1
    total = 0
    for t in plan.trees:
        if t.fraction > FRACTION_EPS and t.edges:
            total += math.ceil(t.fraction * size_bytes / chunk_bytes) * len(t.edges) * per_edge * 2
    return total


def choose_chunk_bytes(plan: Plan, topology: Topology, size_bytes: int, params: SimParams = DEFAULT_PARAMS, kind: str | None = None) -> int:
    """The power-of-two chunk size (>= 64 KiB) with the least :func:`predict_time`.

    Examples
    --------
    >>> from blink_horovod.planner.plan import Plan, Tree
    >>> from blink_horovod.topology import resolve
    >>> chain = Plan("broadcast", "dgx1v", (0, 1, 2), 0, (Tree(0, 1.0, ((0, 1), (1, 2))),), 25.0, 25.0)
    >>> choose_chunk_bytes(chain, resolve("dgx1v:0,1,2"), 2**30) >= 2**20
    True
    """
    kind = kind or plan.collective
    rmap = ResourceMap(topology, params)
    if size_bytes <= MIN_CHUNK:
        return max(params.itemsize, size_bytes)
    best: tuple[float, int] | None = None
    s = MIN_CHUNK
    while True:
        if _op_count(plan, size_bytes, s, kind) <= MAX_OPS:
            t = predict_time(plan, topology, size_bytes, s, params, kind, rmap)
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, s)
        if s >= size_bytes:
            break
        s *= 2
    assert best is not None
    return best[1]


def _simulate_chunk(plan: Plan, topology: Topology, size_bytes: int, chunk_bytes: int, params: SimParams, kind: str, lanes: str | None = None) -> BlinkEstimate:
    from ..schedule import compile_program

    count = -(-size_bytes // params.itemsize)
    extra = {} if lanes is None else {"lanes": lanes}
    program = compile_program(plan, count, max(1, chunk_bytes // params.itemsize), kind, **extra)
    result = simulate_program(program, topology, params, gpus=plan.gpus)
    bound = size_bytes / (plan.optimum_gbps * GB) if plan.optimum_gbps > 0 else 0.0
    if kind != plan.collective:
        bound = 0.0  # the optimum is the whole collective's, not one stage's
    return BlinkEstimate(result.time_s, bound, plan, chunk_bytes, result)


def tune_chunk_miad(
    plan: Plan,
    topology: Topology,
    size_bytes: int,
    params: SimParams = DEFAULT_PARAMS,
    kind: str | None = None,
    lanes: str | None = None,
    start_bytes: int = 1 << 20,
    factor: float = 2.0,
) -> tuple[BlinkEstimate, list[tuple[int, float]]]:
    """MIAD (blink_horovod.schedule.miad) measuring the simulator: the best estimate and MIAD's walk.

    The walk is ``[(chunk_bytes, GB/s), ...]`` in the order MIAD measured them
    (Blink section 4: multiplicative increase while the throughput rises,
    additive decrease after it falls; the paper starts at 1 MB with 2x steps).
    """
    from ..schedule.miad import tune

    kind = kind or plan.collective
    runs: dict[int, BlinkEstimate] = {}

    def measure(chunk: int) -> float:
        if chunk not in runs:
            runs[chunk] = _simulate_chunk(plan, topology, size_bytes, chunk, params, kind, lanes)
        return size_bytes / runs[chunk].time_s / GB

    hi = max(MIN_CHUNK, size_bytes)
    best, history = tune(measure, start_bytes=min(start_bytes, hi), factor=factor, decrease_bytes=min(start_bytes, hi),
                         min_bytes=min(MIN_CHUNK, hi), max_bytes=hi, align_bytes=params.itemsize)
    measure(best)
    return runs[best], history


def simulate_plan(
    plan: Plan,
    topology: Topology,
    size_bytes: int,
    chunk_bytes: int | str | None = None,
    params: SimParams = DEFAULT_PARAMS,
    kind: str | None = None,
    search: int = 0,
    lanes: str | None = None,
) -> BlinkEstimate:
    """Compile ``plan`` for ``size_bytes`` and simulate it on ``topology``.

    ``chunk_bytes="miad"`` lets MIAD find it on the simulator
    (:func:`tune_chunk_miad`).  Without ``chunk_bytes`` the chunk size starts at :func:`choose_chunk_bytes`
    and, with ``search > 0``, moves by factors of two while the *simulated*
    time improves (at most ``search`` steps each way): the estimate does not see
    every stall of the compiled program, and Blink tunes its chunk size on the
    running collective too (section 4).  ``lanes`` is passed to
    :func:`~blink_horovod.schedule.compile_program` (its lane policy; default
    the compiler's own).
    """
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes < 0:
        raise ConfigError(f"size: expected a whole number of bytes >= 0, got {size_bytes!r}")
    kind = kind or plan.collective
    if chunk_bytes == "miad":
        return tune_chunk_miad(plan, topology, size_bytes, params, kind, lanes)[0]
    if chunk_bytes is not None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool):
            raise ConfigError(f"chunk: expected a number of bytes or 'miad', got {chunk_bytes!r}")
        if chunk_bytes < params.itemsize:
            raise ConfigError(f"chunk: must be at least one element ({params.itemsize} bytes), got {chunk_bytes}")
        return _simulate_chunk(plan, topology, size_bytes, chunk_bytes, params, kind, lanes)
    start = choose_chunk_bytes(plan, topology, size_bytes, params, kind)
    best = _simulate_chunk(plan, topology, size_bytes, start, params, kind, lanes)
    if search <= 0 or size_bytes <= MIN_CHUNK:
        return best
    for direction in (0.5, 2.0):
        chunk = start
        for _ in range(search):
            chunk = int(chunk * direction)
            if chunk < MIN_CHUNK or chunk > max(size_bytes, MIN_CHUNK) or _op_count(plan, size_bytes, chunk, kind) > MAX_OPS:
                break
            est = _simulate_chunk(plan, topology, size_bytes, chunk, params, kind, lanes)
            if est.time_s >= best.time_s:
                break
            best = est
        if best.chunk_bytes != start:
            break  # improved going this way: no need to try the other
    return best


def simulate_blink(
    topology: Topology,
    collective: str,
    size_bytes: int,
    *,
    root: int | None = None,
    channels: Sequence[str] | None = None,
    chunk_bytes: int | None = None,
    params: SimParams = DEFAULT_PARAMS,
    plan: Plan | None = None,
) -> BlinkEstimate:
    """Plan (unless ``plan`` is given), compile and simulate one Blink collective.

    ``root`` defaults to the allocation's first GPU for a broadcast.
    """
    if plan is None:
        if collective == "broadcast" and root is None:
            root = topology.gpus[0]
        plan = plan_for(topology, collective, root=root, channels=channels)
    return simulate_plan(plan, topology, size_bytes, chunk_bytes, params)
