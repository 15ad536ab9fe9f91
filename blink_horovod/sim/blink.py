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

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..planner.plan import Plan
from ..topology.model import Topology
from .execute import SimResult, simulate_program
from .params import DEFAULT_PARAMS, SimParams
from .resources import ResourceMap

__all__ = [
    "RUNTIME_SCHEDULE",
    "SIM_SCHEDULE",
    "BlinkEstimate",
    "Schedule",
    "choose_chunk_bytes",
    "hybrid_split",
    "plan_for",
    "predict_time",
    "simulate_blink",
    "simulate_plan",
]

GB = 1e9
FRACTION_EPS = 1e-9
MIN_CHUNK = 64 * 1024
# The simulator's cost grows with the number of ops; chunks are not made so
# small that one collective needs more than this many (the estimate's optimum
# lies far above it at the sizes that matter).
MAX_OPS = 60000


@dataclass(frozen=True)
class Schedule:
    """How a plan is compiled: :func:`~blink_horovod.schedule.compile_program`'s options.

    The simulator's default, :data:`SIM_SCHEDULE`, is the one that keeps a
    plan's trees at their planned rates (schedule/compile.py, "Pacing" and
    "Double buffering"): one lane per tree and link (no head-of-line blocking
    between trees at different phases), every tree the same number of chunks
    (sizes in proportion to its share), the trees that share a link kept
    within ``pace`` pipeline steps of each other (equal sharing of a link
    among lanes would otherwise give every tree the same rate, not its
    planned one), and two lanes per tree and link, alternating chunks, with
    a half-size first and last chunk, so one chunk's fixed costs overlap
    another's bytes.  :data:`RUNTIME_SCHEDULE` is what the runtimes compile
    (the compiler's defaults).
    """

    lanes: str = "tree"
    chunking: str = "even"
    pace: int | None = 4
    streams: int = 2
    fanin: bool = False

    def options(self) -> dict:
        """Keyword arguments for ``compile_program``."""
        return {"lanes": self.lanes, "chunking": self.chunking, "pace": self.pace, "streams": self.streams,
                "fanin": self.fanin}

    def label(self) -> str:
        extra = ", fan-in" if self.fanin else ""
        return f"lanes={self.lanes}, chunking={self.chunking}, pace={self.pace}, streams={self.streams}{extra}"


SIM_SCHEDULE = Schedule()
RUNTIME_SCHEDULE = Schedule(lanes="root", chunking="fixed", pace=None, streams=1)


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


def _tree_hops(plan: Plan, kind: str, fanin: bool = False) -> int:
    """Longest chain of dependent chunk transfers in any tree (the pipeline's depth).

    Down a tree a chunk takes one hop per level.  Up a tree a node reduces its
    children's chunks one after the other (they write one region), so a node
    with k children adds k - 1 hops to the chain through it -- unless one
    ``fanin`` op reduces them all (``fanin=True``).
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
            up[v] = max(up[c] for c in cs) + (1 if fanin else len(cs)) if cs else 0

        hops = 0
        if kind in ("allreduce", "reduce"):
            hops += up[t.root]
        if kind in ("allreduce", "broadcast"):
            hops += t.depth()
        best = max(best, hops)
    return best


def _even_chunks(trees: Sequence, size_bytes: int, chunk_bytes: int) -> dict[str, int]:
    """Chunks per tree, by channel, under ``chunking="even"`` (before the ramp's extra ones): one count for all."""
    k = max(1, max(math.ceil(t.fraction * size_bytes / chunk_bytes) for t in trees))
    return {t.channel: k for t in trees}


def _resolve(schedule: Schedule | None, lanes: str | None) -> Schedule:
    sched = SIM_SCHEDULE if schedule is None else schedule
    return sched if lanes is None else dataclasses.replace(sched, lanes=lanes)


def predict_time(plan: Plan, topology: Topology, size_bytes: int, chunk_bytes: int,
                 params: SimParams = DEFAULT_PARAMS, kind: str | None = None, resources: ResourceMap | None = None,
                 schedule: Schedule | None = None) -> float:
    """Closed-form estimate of the simulated time (used to choose a chunk size).

    ``steady``: every resource moves its bytes at its capacity (for an
    optimal plan, the bound), and every lane (one per tree and incoming link)
    its own bytes at its route's bottleneck.  Fixed costs: a lane pays each of
    its ops' fixed cost; with ``streams`` lanes per tree and link they overlap
    the bytes of the other lanes' chunks, so only the part of a step they
    exceed shows (``fixed_chunking``: every op's, in series).  Fill and drain:
    the deepest tree's hops (:func:`_tree_hops`) minus one, each one pipeline
    step, plus each hop's fixed cost once.
    """
    kind = kind or plan.collective
    sched = _resolve(schedule, None)
    rmap = resources or ResourceMap(topology, params)
    lanes: dict[tuple, list[float]] = {}
    res_bytes: dict[int, float] = {}
    L_copy = params.copy_s
    L_red = params.copy_s + params.reduce_extra_s
    carrying = [t for t in plan.trees if t.fraction > FRACTION_EPS and t.edges]
    if not carrying:
        return params.launch_s
    even = sched.chunking == "even"
    kmax_of = _even_chunks(carrying, size_bytes, chunk_bytes)
    kmax = max(kmax_of.values())
    nch_even = kmax + sched.streams - 1
    worst_lat = 0.0
    for ti, t in enumerate(carrying):
        b = t.fraction * size_bytes
        nch = kmax_of[t.channel] + sched.streams - 1 if even else max(1, math.ceil(b / chunk_bytes))
        inner = {p for p, _ in t.edges}
        for p, c in t.edges:
            moves = []
            if kind in ("allreduce", "reduce"):
                moves.append((c, p, L_red + (params.post_s if c in inner else 0.0)))
            if kind in ("allreduce", "broadcast"):
                moves.append((p, c, L_copy + (params.post_s if c in inner else 0.0)))
            for src, dst, lat in moves:
                key = (dst, src, t.channel) if sched.lanes == "link" else (dst, src, t.channel, ti)
                lane = lanes.setdefault(key, [0.0, 0.0, math.inf, 0.0])
                route = rmap.route(src, dst, t.channel)
                bottleneck = min(rmap.capacity[r] for r in route)
                lane[0] += b
                lane[1] += nch * lat
                lane[2] = min(lane[2], bottleneck)
                lane[3] += min(chunk_bytes, b) / bottleneck + lat  # one step: a chunk of every tree on the lane
                worst_lat = max(worst_lat, lat)
                for r in route:
                    res_bytes[r] = res_bytes.get(r, 0.0) + b
    bound = max(b / rmap.capacity[r] for r, b in res_bytes.items())
    hops = _tree_hops(plan, kind, sched.fanin)
    if even:
        step = bound / kmax
        # With ``streams`` lanes per tree and link a lane's fixed cost overlaps
        # the bytes of the other lanes' chunks, but the paced trees take their
        # steps together, so not all of it: counted as 1 / streams of it per
        # step.  (Checked against simulated chunk sweeps, 256 KiB .. 8 MiB, of
        # every DGX-1V allocation at 1 GiB: the chunk this picks was within 6%
        # of the bound everywhere.)
        exposed = worst_lat / sched.streams
        steady = bound + nch_even * exposed
        fill = max(0, hops - 1) * (step + exposed) + hops * worst_lat
    else:
        steady = max(max(v[0] / v[2] + v[1] for v in lanes.values()), bound)
        step = max(v[3] for v in lanes.values())
        fill = max(0, hops - 1) * step
    # The PCIe channel switch does not depend on the chunk size: left out.
    return params.launch_s + steady + fill


def _op_count(plan: Plan, size_bytes: int, chunk_bytes: int, kind: str, schedule: Schedule | None = None) -> int:
    sched = _resolve(schedule, None)
    per_edge = 2 if kind == "allreduce" else 1
    carrying = [t for t in plan.trees if t.fraction > FRACTION_EPS and t.edges]
    if not carrying:
        return 0
    kmax_of = _even_chunks(carrying, size_bytes, chunk_bytes)
    total = 0
    for t in carrying:
        k = kmax_of[t.channel] + sched.streams - 1 if sched.chunking == "even" else math.ceil(t.fraction * size_bytes / chunk_bytes)
        total += k * len(t.edges) * per_edge * 2
    return total


def choose_chunk_bytes(plan: Plan, topology: Topology, size_bytes: int, params: SimParams = DEFAULT_PARAMS,
                       kind: str | None = None, schedule: Schedule | None = None) -> int:
    """The power-of-two chunk size (>= 64 KiB) with the least :func:`predict_time`.

    Examples
    --------
    >>> from blink_horovod.planner.plan import Plan, Tree
    >>> from blink_horovod.topology import resolve
    >>> chain = Plan("broadcast", "dgx1v", (0, 1, 2), 0, (Tree(0, 1.0, ((0, 1), (1, 2))),), 25.0, 25.0)
    >>> choose_chunk_bytes(chain, resolve("dgx1v:0,1,2"), 2**30) >= 2**18
    True
    """
    kind = kind or plan.collective
    rmap = ResourceMap(topology, params)
    if size_bytes <= MIN_CHUNK:
        return max(params.itemsize, size_bytes)
    best: tuple[float, int] | None = None
    s = MIN_CHUNK
    while True:
        if _op_count(plan, size_bytes, s, kind, schedule) <= MAX_OPS or best is None and s >= size_bytes:
            t = predict_time(plan, topology, size_bytes, s, params, kind, rmap, schedule)
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, s)
        if s >= size_bytes:
            break
        s *= 2
    assert best is not None
    return best[1]


def _simulate_chunk(plan: Plan, topology: Topology, size_bytes: int, chunk_bytes: int, params: SimParams, kind: str,
                    schedule: Schedule) -> BlinkEstimate:
    from ..schedule import compile_program

    count = -(-size_bytes // params.itemsize)
    program = compile_program(plan, count, max(1, chunk_bytes // params.itemsize), kind, **schedule.options())
    result = simulate_program(program, topology, params, gpus=plan.gpus)
    bound = size_bytes / (plan.optimum_gbps * GB) if plan.optimum_gbps > 0 else 0.0
    if kind != plan.collective:
        bound = 0.0  # the optimum is the whole collective's, not one stage's
    return BlinkEstimate(result.time_s, bound, plan, chunk_bytes, result)


def _switched_pairs(plan: Plan, topology: Topology, params: SimParams) -> int:
    """GPU pairs of the PCIe trees that NVLink also joins: each pays the channel switch (execute.py)."""
    rmap = ResourceMap(topology, params)
    pairs = {frozenset(e) for t in plan.trees if t.channel == "pcie" and t.fraction > FRACTION_EPS for e in t.edges}
    return sum(1 for pr in pairs if rmap.nvlink_connected(*tuple(pr)))


def hybrid_split(plan: Plan, topology: Topology, size_bytes: int, params: SimParams = DEFAULT_PARAMS) -> Plan:
    """Blink's hybrid split (section 3.4), peer-access-disable latency included.

    The planner splits the bytes between NVLink and PCIe by bandwidth alone
    (planner/hybrid.py: ``T_pcie = T_nvlink``); Blink's split also counts the
    measured latency of disabling peer access, which the PCIe share pays
    before its first byte: ``x S / R_pcie + T_switch = (1 - x) S / R_nvlink``,
    so ``x = (S / R_nvlink - T_switch) / (S / R_nvlink + S / R_pcie)``.
    The trees of each channel keep their proportions; where the switch costs
    more than the whole NVLink transfer, ``x <= 0`` and the PCIe trees carry
    nothing (NVLink alone).  A plan on one channel is returned unchanged.
    """
    nvl = [t for t in plan.trees if t.channel == "nvlink" and t.fraction > FRACTION_EPS]
    pci = [t for t in plan.trees if t.channel == "pcie" and t.fraction > FRACTION_EPS]
    if not nvl or not pci or size_bytes <= 0:
        return plan
    f_pcie = math.fsum(t.fraction for t in pci)
    r_total = plan.rate_gbps if plan.rate_gbps > 0 else plan.optimum_gbps
    r_nvl = plan.nvlink_optimum_gbps if plan.nvlink_optimum_gbps else r_total * (1 - f_pcie)
    r_pcie = max(r_total - r_nvl, r_total * f_pcie * 1e-9)
    t_switch = params.pcie_switch_s * _switched_pairs(plan, topology, params)
    t_nvl = size_bytes / (r_nvl * GB)
    t_pcie = size_bytes / (r_pcie * GB)
    x = max(0.0, (t_nvl - t_switch) / (t_nvl + t_pcie))
    scale = {"pcie": x / f_pcie, "nvlink": (1 - x) / (1 - f_pcie)}
    trees = tuple(dataclasses.replace(t, fraction=t.fraction * scale[t.channel]) for t in plan.trees)
    extras = dict(plan.extras)
    extras["hybrid_split"] = {"pcie_fraction": x, "planner_pcie_fraction": f_pcie, "switch_s": t_switch}
    return dataclasses.replace(plan, trees=trees, extras=extras)


def tune_chunk_miad(plan: Plan, topology: Topology, size_bytes: int, params: SimParams = DEFAULT_PARAMS,
                    kind: str | None = None, lanes: str | None = None, start_bytes: int = 1 << 20,
                    factor: float = 2.0,
                    schedule: Schedule | None = None) -> tuple[BlinkEstimate, list[tuple[int, float]]]:
    """MIAD (blink_horovod.schedule.miad) measuring the simulator: the best estimate and MIAD's walk.

    The walk is ``[(chunk_bytes, GB/s), ...]`` in the order MIAD measured them
    (Blink section 4: multiplicative increase while the throughput rises,
    additive decrease after it falls; the paper starts at 1 MB with 2x steps).
    """
    from ..schedule.miad import tune

    kind = kind or plan.collective
    sched = _resolve(schedule, lanes)
    runs: dict[int, BlinkEstimate] = {}

    def measure(chunk: int) -> float:
        if chunk not in runs:
            runs[chunk] = _simulate_chunk(plan, topology, size_bytes, chunk, params, kind, sched)
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
    schedule: Schedule | None = None,
    split: bool = True,
) -> BlinkEstimate:
    """Compile ``plan`` for ``size_bytes`` and simulate it on ``topology``.

    ``chunk_bytes="miad"`` lets MIAD find it on the simulator
    (:func:`tune_chunk_miad`).  Without ``chunk_bytes`` the chunk size starts at :func:`choose_chunk_bytes`
    and, with ``search > 0``, moves by factors of two while the *simulated*
    time improves (at most ``search`` steps each way): the estimate does not see
    every stall of the compiled program, and Blink tunes its chunk size on the
    running collective too (section 4).  ``schedule`` says how the plan is
    compiled (default :data:`SIM_SCHEDULE`); ``lanes`` overrides its lane
    policy.  ``split``: a hybrid plan first gets Blink's split with the
    channel-switch latency (:func:`hybrid_split`).
    """
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes < 0:
        raise ConfigError(f"size: expected a whole number of bytes >= 0, got {size_bytes!r}")
    kind = kind or plan.collective
    sched = _resolve(schedule, lanes)
    if split:
        plan = hybrid_split(plan, topology, size_bytes, params)
    if chunk_bytes == "miad":
        return tune_chunk_miad(plan, topology, size_bytes, params, kind, schedule=sched)[0]
    if chunk_bytes is not None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool):
            raise ConfigError(f"chunk: expected a number of bytes or 'miad', got {chunk_bytes!r}")
        if chunk_bytes < params.itemsize:
            raise ConfigError(f"chunk: must be at least one element ({params.itemsize} bytes), got {chunk_bytes}")
        return _simulate_chunk(plan, topology, size_bytes, chunk_bytes, params, kind, sched)
    start = choose_chunk_bytes(plan, topology, size_bytes, params, kind, sched)
    best = _simulate_chunk(plan, topology, size_bytes, start, params, kind, sched)
    if search <= 0 or size_bytes <= MIN_CHUNK:
        return best
    for direction in (0.5, 2.0):
        chunk = start
        for _ in range(search):
            chunk = int(chunk * direction)
            if chunk < MIN_CHUNK or chunk > max(size_bytes, MIN_CHUNK) or _op_count(plan, size_bytes, chunk, kind, sched) > MAX_OPS:
                break
            est = _simulate_chunk(plan, topology, size_bytes, chunk, params, kind, sched)
            if est.time_s >= best.time_s:
                break
            best = est
        if best.chunk_bytes != start:
            break  # improved going this way: no need to try the other
    return best


def simulate_blink(topology: Topology, collective: str, size_bytes: int, *, root: int | None = None,
                   channels: Sequence[str] | None = None, chunk_bytes: int | None = None,
                   params: SimParams = DEFAULT_PARAMS, plan: Plan | None = None,
                   schedule: Schedule | None = None) -> BlinkEstimate:
    """Plan (unless ``plan`` is given), compile and simulate one Blink collective.

    ``root`` defaults to the allocation's first GPU for a broadcast.
    """
    if plan is None:
        if collective == "broadcast" and root is None:
            root = topology.gpus[0]
        plan = plan_for(topology, collective, root=root, channels=channels)
    return simulate_plan(plan, topology, size_bytes, chunk_bytes, params, schedule=schedule)
