"""A discrete-event, flow-level (fluid) simulator of task graphs over shared resources.

Each task waits for its predecessors (and for *signals*: set by the first of
the tasks that raise them, as a flag post does), then spends a fixed latency,
then moves its bytes as a *flow* across one or more capacitated resources
(link directions, switch ports, a GPU's reduction rate).  Concurrent flows
share a resource equally -- processor sharing, the fluid limit of packet
round-robin -- and a flow moves at the smallest share among its resources::

    rate(f) = min over r in resources(f) of capacity(r) / active_flows(r)

This is exact max-min fairness whenever a flow's other resources are not its
bottleneck, which holds for every transfer over a direct link; for routes
through a switch, capacity that a flow bottlenecked elsewhere leaves unused is
not handed to the others (conservative).  Events are task readiness, latency
expiry and flow completion; rates change only when a flow starts or ends, and
all events of one instant are applied before rates are recomputed, so the
number of events is a small multiple of the number of tasks.  This is the
usual fluid model of network simulators (e.g. SimGrid's flow-level model,
Velho et al., "On the validity of flow-level TCP network models", TOMACS 2013).

Pipeline fill and drain are not modelled separately: they *emerge*, because a
chunk can only move after the chunk it depends on has arrived.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ScheduleError
from . import native

__all__ = ["ENGINE_IMPLS", "EngineResult", "TaskGraph", "run"]

# "auto": the compiled loop (native.py) where it builds, else Python; "c" insists on it.
ENGINE_IMPLS = ("auto", "c", "python")

_EPS_T = 1e-13  # events this close (seconds) are one instant


class TaskGraph:
    """Tasks to simulate; build with :meth:`add` and :meth:`signal`."""

    __slots__ = ("deps", "latency", "nbytes", "nsignals", "raises", "resources", "tags", "tail", "waits")

    def __init__(self) -> None:
        self.latency: list[float] = []
        self.nbytes: list[float] = []
        self.tail: list[float] = []
        self.resources: list[tuple[int, ...]] = []
        self.deps: list[Sequence[int]] = []  # tuples from add(), lists from program_task_graph
        self.waits: list[tuple[int, ...]] = []
        self.raises: list[int] = []
        self.tags: list[object] = []
        self.nsignals = 0

    def __len__(self) -> int:
        return len(self.latency)

    def signal(self) -> int:
        """A new signal id: set when the first task raising it completes."""
        self.nsignals += 1
        return self.nsignals - 1

    def add(
        self,
        latency: float = 0.0,
        nbytes: float = 0.0,
        resources: Sequence[int] = (),
        deps: Sequence[int] = (),
        waits: Sequence[int] = (),
        raises: int = -1,
        tag: object = None,
        tail: float = 0.0,
    ) -> int:
        """Add a task; returns its id.

        Parameters
        ----------
        latency : fixed seconds spent before the bytes move (no resource used).
        nbytes : bytes moved after the latency (0: no flow).
        resources : resource ids the flow loads (required when ``nbytes > 0``).
        deps : task ids that must complete first.
        waits : signal ids that must be set first.
        raises : signal id this task sets when it completes (-1: none).
        tag : anything, returned in reports (e.g. ``(rank, op_index)``).
        tail : fixed seconds after the bytes moved, before the task completes
            (e.g. a flag post that follows a copy on the same stream).
        """
        if latency < 0 or not math.isfinite(latency):
            raise ScheduleError(f"task latency must be finite and >= 0, got {latency!r}")
        if nbytes < 0 or not math.isfinite(nbytes):
            raise ScheduleError(f"task bytes must be finite and >= 0, got {nbytes!r}")
        if tail < 0 or not math.isfinite(tail):
            raise ScheduleError(f"task tail latency must be finite and >= 0, got {tail!r}")
        if nbytes > 0 and not resources:
            raise ScheduleError("a task that moves bytes needs at least one resource")
        self.latency.append(float(latency))
        self.nbytes.append(float(nbytes))
        self.tail.append(float(tail))
        self.resources.append(tuple(resources))
        self.deps.append(tuple(deps))
        self.waits.append(tuple(waits))
        self.raises.append(raises)
        self.tags.append(tag)
        return len(self.latency) - 1


@dataclass
class EngineResult:
    """What :func:`run` measured."""

    makespan: float  # seconds from t=0 to the last task's completion
    finish: list[float]  # per task
    events: int  # events processed (a cost measure)
    resource_bytes: list[float] = field(default_factory=list)  # bytes moved over each resource


def run(graph: TaskGraph, capacity: Sequence[float], t0: float = 0.0, impl: str = "auto") -> EngineResult:
    """Simulate ``graph`` over resources of ``capacity`` (bytes/s); tasks without predecessors start at ``t0``.

    ``impl`` picks the event loop: ``"python"`` (below), ``"c"`` (the same
    loop compiled, native.py: bit-identical results, ~30x faster) or
    ``"auto"`` (C where it builds).

    Raises
    ------
    ScheduleError
        if some tasks can never start (a dependency cycle, or a signal nobody
        raises): the message names the first such tasks by their tags.
    """
    if impl not in ENGINE_IMPLS:
        raise ScheduleError(f"engine impl: expected one of {', '.join(ENGINE_IMPLS)}, got {impl!r}")
    if impl != "python":
        lib = native.library()
        if lib is not None:
            return _run_native(lib, graph, capacity, t0)
        if impl == "c":
            raise ScheduleError("engine impl 'c': the compiled event loop is unavailable (no C compiler, or its build failed)")
    return _run_python(graph, capacity, t0)


def _csr(rows: list[tuple[int, ...]], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets, flat values and lengths of per-task tuples."""
    lens = np.fromiter(map(len, rows), np.int64, n)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(off[-1]))
    return off, flat, lens


def _first_bad(rows: list[tuple[int, ...]], ok: range) -> tuple[int, int]:
    """The first task whose tuple holds a value outside ``ok``, and that value."""
    for i, vals in enumerate(rows):
        for v in vals:
            if v not in ok:
                return i, v
    raise AssertionError("no bad value")  # pragma: no cover - callers checked there is one


def _checked_capacity(capacity: Sequence[float]) -> list[float]:
    """Capacities as floats; each must be > 0."""
    cap = [float(c) for c in capacity]
    for r, c in enumerate(cap):
        if not c > 0:
            raise ScheduleError(f"resource {r}: capacity must be > 0, got {c!r}")
    return cap


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _run_native(lib: ctypes.CDLL, graph: TaskGraph, capacity: Sequence[float], t0: float) -> EngineResult:
    """:func:`_run_python`'s validation, then the compiled loop over the graph laid out as arrays."""
    n = len(graph)
    ncap = len(capacity)
    cap = np.asarray(capacity, np.float64)
    res_off, res_flat, res_len = _csr(graph.resources, n)
    if res_flat.size and (res_flat.min() < 0 or res_flat.max() >= ncap):
        i, r = _first_bad(graph.resources, range(ncap))
        raise ScheduleError(f"task {graph.tags[i]!r}: unknown resource id {r}")
    _checked_capacity(capacity)
    # A flow listing one resource twice counts once in the Python loop (a set) and twice here: rare, so
    # such graphs take the Python loop.
    if any(len(set(rs)) != len(rs) for rs in graph.resources if len(rs) > 1):
        return _run_python(graph, capacity, t0)
    _, dep_flat, dep_len = _csr(graph.deps, n)
    if dep_flat.size and (dep_flat.min() < 0 or dep_flat.max() >= n):
        i, d = _first_bad(graph.deps, range(n))
        raise ScheduleError(f"task {graph.tags[i]!r}: unknown dependency {d}")
    nsig = graph.nsignals
    _, wait_flat, wait_len = _csr(graph.waits, n)
    if wait_flat.size and (wait_flat.min() < 0 or wait_flat.max() >= nsig):
        i, w = _first_bad(graph.waits, range(nsig))
        raise ScheduleError(f"task {graph.tags[i]!r}: unknown signal {w}")
    raises = np.asarray(graph.raises, np.int32)
    if n and (raises.min() < -1 or raises.max() >= nsig):
        i = next(k for k, s in enumerate(graph.raises) if not -1 <= s < nsig)
        raise ScheduleError(f"task {graph.tags[i]!r}: raises unknown signal {graph.raises[i]}")
    # Successors of task d, and waiters of signal s, in ascending task order (as the Python loop appends them).
    dep_owner = np.repeat(np.arange(n, dtype=np.int64), dep_len)
    order = np.argsort(dep_flat, kind="stable")
    succ_idx = dep_owner[order].astype(np.int32)
    succ_off = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dep_flat, minlength=n)[:n], out=succ_off[1:])
    wait_owner = np.repeat(np.arange(n, dtype=np.int64), wait_len)
    order = np.argsort(wait_flat, kind="stable")
    waiter_idx = wait_owner[order].astype(np.int32)
    waiter_off = np.zeros(nsig + 1, np.int64)
    if nsig:
        np.cumsum(np.bincount(wait_flat, minlength=nsig)[:nsig], out=waiter_off[1:])
    npred = (dep_len + wait_len).astype(np.int32)
    lat = np.asarray(graph.latency, np.float64)
    nbytes = np.asarray(graph.nbytes, np.float64)
    tail = np.asarray(graph.tail, np.float64)
    res_idx = res_flat.astype(np.int32)
    finish = np.zeros(max(n, 1), np.float64)
    finished = np.zeros(max(n, 1), np.uint8)
    events = np.zeros(1, np.int64)
    done = lib.blink_fluid_run(
        n, _ptr(lat), _ptr(nbytes), _ptr(tail), _ptr(res_off), _ptr(res_idx), _ptr(succ_off), _ptr(succ_idx),
        nsig, _ptr(waiter_off), _ptr(waiter_idx), _ptr(raises), _ptr(npred), ncap, _ptr(cap), float(t0), _EPS_T,
        _ptr(finish), _ptr(finished), _ptr(events),
    )
    if done < 0:
        raise MemoryError("simulator: the compiled event loop ran out of memory")
    if done != n:
        stuck = [graph.tags[i] for i in np.flatnonzero(finished[:n] == 0).tolist()]
        raise ScheduleError(
            f"program deadlocks: {len(stuck)} of {n} operations never run, first {stuck[:5]!r}"
        )
    weights = np.repeat(nbytes, res_len)
    resource_bytes = np.bincount(res_flat, weights=weights, minlength=ncap).tolist() if res_flat.size else [0.0] * ncap
    fin = finish[:n].tolist()
    makespan = max(fin) if n else t0
    return EngineResult(makespan=makespan, finish=fin, events=int(events[0]), resource_bytes=resource_bytes)


def _wait(tasks: list[int], delay: Sequence[float], t: float, event: int, heap: list, then: list[int]) -> None:
    """Each of ``tasks`` (emptied) goes to ``then`` at ``t + delay[i]``: at once when there is no
    delay, else by the heap event ``(time, event, task)``."""
    while tasks:
        i = tasks.pop()
        if delay[i] > 0.0:
            heapq.heappush(heap, (t + delay[i], event, i))
        else:
            then.append(i)


def _run_python(graph: TaskGraph, capacity: Sequence[float], t0: float) -> EngineResult:
    """The event loop in Python: the reference the compiled one (_fluid.c) follows line by line."""
    n = len(graph)
    lat = graph.latency
    nbytes = graph.nbytes
    res = graph.resources
    raises = graph.raises
    for i, rs in enumerate(res):
        for r in rs:
            if not 0 <= r < len(capacity):
                raise ScheduleError(f"task {graph.tags[i]!r}: unknown resource id {r}")
    cap = _checked_capacity(capacity)

    npred = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(graph.deps):
        for d in ds:
            if not 0 <= d < n:
                raise ScheduleError(f"task {graph.tags[i]!r}: unknown dependency {d}")
            succ[d].append(i)
        npred[i] = len(ds)
    waiters: list[list[int]] = [[] for _ in range(graph.nsignals)]
    for i, ws in enumerate(graph.waits):
        for s in ws:
            waiters[s].append(i)
        npred[i] += len(ws)
    raised = bytearray(graph.nsignals)

    finish = [0.0] * n
    finished = bytearray(n)
    active: list[set[int]] = [set() for _ in cap]
    rem = [0.0] * n
    rate = [0.0] * n
    tlast = [0.0] * n
    ver = [0] * n
    heap: list[tuple[float, int, int]] = []  # (time, flow version, or -1 head / -2 tail latency over, task)
    events = 0
    done = 0
    push = heapq.heappush
    pop = heapq.heappop

    tail = graph.tail
    # Work of one instant: tasks that became ready, whose head latency is over,
    # whose bytes have moved, that are finished.  Dirty resources get their
    # flows' rates recomputed once after the instant's work.
    ready: list[int] = [i for i in range(n) if npred[i] == 0]
    moving: list[int] = []
    moved: list[int] = []
    over: list[int] = []
    dirty: set[int] = set()
    t = t0
    while True:
        while ready or moving or moved or over:
            _wait(ready, lat, t, -1, heap, moving)
            while moving:
                i = moving.pop()
                if nbytes[i] > 0.0:
                    rem[i] = nbytes[i]
                    rate[i] = 0.0
                    tlast[i] = t
                    for r in res[i]:
                        active[r].add(i)
                        dirty.add(r)
                else:
                    moved.append(i)
            _wait(moved, tail, t, -2, heap, over)
            while over:
                i = over.pop()
                finish[i] = t
                finished[i] = 1
                done += 1
                for s in succ[i]:
                    npred[s] -= 1
                    if npred[s] == 0:
                        ready.append(s)
                sig = raises[i]
                if sig >= 0 and not raised[sig]:
                    raised[sig] = 1
                    for s in waiters[sig]:
                        npred[s] -= 1
                        if npred[s] == 0:
                            ready.append(s)
        if dirty:
            if len(dirty) == 1:
                flows = active[next(iter(dirty))]
            else:
                flows = set()
                for r in dirty:
                    flows.update(active[r])
            dirty = set()
            for f in flows:
                rs = res[f]
                if len(rs) == 1:
                    new = cap[rs[0]] / len(active[rs[0]])
                else:
                    new = min([cap[r] / len(active[r]) for r in rs])
                old = rate[f]
                if new != old:
                    if old > 0.0:
                        left = rem[f] - old * (t - tlast[f])
                        rem[f] = left if left > 0.0 else 0.0  # noqa: FURB136 (hot loop: no call)
                    tlast[f] = t
                    rate[f] = new
                    v = ver[f] + 1
                    ver[f] = v
                    push(heap, (t + rem[f] / new, v, f))
        if not heap:
            break
        # Advance to the next instant and take all of its events.
        t = heap[0][0]
        horizon = t + _EPS_T + t * 1e-12
        while heap and heap[0][0] <= horizon:
            _, v, i = pop(heap)
            events += 1
            if v == -1:
                moving.append(i)
            elif v == -2:
                over.append(i)
            elif v == ver[i] and not finished[i]:
                for r in res[i]:
                    active[r].discard(i)
                    dirty.add(r)
                rem[i] = 0.0
                ver[i] = v + 1  # no second completion
                moved.append(i)
    if done != n:
        stuck = [graph.tags[i] for i in range(n) if not finished[i]]
        raise ScheduleError(
            f"program deadlocks: {len(stuck)} of {n} operations never run, first {stuck[:5]!r}"
        )
    resource_bytes = [0.0] * len(cap)
    for i in range(n):
        b = nbytes[i]
        if b:
            for r in res[i]:
                resource_bytes[r] += b
    makespan = max(finish, default=t0) if n else t0
    return EngineResult(makespan=makespan, finish=finish, events=events, resource_bytes=resource_bytes)
