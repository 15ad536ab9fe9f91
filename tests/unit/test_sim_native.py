"""The compiled event loop (sim/_fluid.c) gives exactly what the Python loop gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_horovod.errors import ScheduleError
from blink_horovod.schedule import compile_program
from blink_horovod.sim import native
from blink_horovod.sim.blink import SIM_SCHEDULE, choose_chunk_bytes, plan_for
from blink_horovod.sim.engine import TaskGraph, run
from blink_horovod.sim.execute import program_task_graph
from blink_horovod.sim.params import DEFAULT_PARAMS
from blink_horovod.sim.resources import ResourceMap
from blink_horovod.topology import resolve

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(native.library() is None, reason="no C compiler: the compiled loop cannot be built here"),
]


def same(graph: TaskGraph, capacity: list[float], t0: float = 0.0) -> None:
    a = run(graph, capacity, t0, impl="python")
    b = run(graph, capacity, t0, impl="c")
    assert a.makespan == b.makespan
    assert a.finish == b.finish  # bit for bit
    assert a.events == b.events
    assert a.resource_bytes == b.resource_bytes


def random_graph(seed: int, n: int, nres: int) -> TaskGraph:
    rng = random.Random(seed)
    g = TaskGraph()
    sigs = [g.signal() for _ in range(max(1, n // 4))]
    raised = set()
    for i in range(n):
        deps = rng.sample(range(i), k=min(i, rng.randint(0, 3)))
        # Only signals an earlier task raises: no deadlock.
        waits = rng.sample(sorted(raised), k=min(len(raised), rng.randint(0, 1)))
        nb = rng.choice([0.0, rng.uniform(1, 1e6), float(rng.randint(1, 8) * 2**16)])
        res = rng.sample(range(nres), k=rng.randint(1, min(3, nres))) if nb else []
        sig = rng.choice(sigs) if rng.random() < 0.3 else -1
        if sig >= 0:
            raised.add(sig)
        g.add(latency=rng.choice([0.0, 1e-6, rng.uniform(0, 1e-5)]), nbytes=nb, resources=res, deps=deps, waits=waits,
              raises=sig, tag=i, tail=rng.choice([0.0, 0.0, 2e-6]))
    return g


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 120), st.integers(1, 6))
def test_random_graphs_match_the_python_loop(seed: int, n: int, nres: int) -> None:
    rng = random.Random(seed)
    same(random_graph(seed, n, nres), [rng.choice([1e9, 25e9, 50e9, rng.uniform(1e8, 1e11)]) for _ in range(nres)], 1e-6)


@pytest.mark.parametrize("gpus,collective", [((0, 1, 2, 3, 4, 5), "allreduce"), ((0, 1, 2, 3, 4, 5, 6, 7), "allreduce"),
                                              ((0, 2, 3, 4, 6), "broadcast")])
def test_compiled_programs_match_the_python_loop(gpus, collective) -> None:
    topo = resolve("dgx1v").allocate(gpus)
    plan = plan_for(topo, collective, root=gpus[0] if collective == "broadcast" else None, channels=["nvlink"])
    size = 2**28
    chunk = choose_chunk_bytes(plan, topo, size, DEFAULT_PARAMS, collective, SIM_SCHEDULE)
    prog = compile_program(plan, size // 4, chunk // 4, collective, **SIM_SCHEDULE.options())
    rmap = ResourceMap(topo, DEFAULT_PARAMS)
    graph, _ = program_task_graph(prog, rmap, plan.gpus, DEFAULT_PARAMS)
    same(graph, rmap.capacity, DEFAULT_PARAMS.launch_s)


def test_both_loops_name_the_stuck_tasks_of_a_deadlock() -> None:
    g = TaskGraph()
    s = g.signal()
    g.add(latency=1e-6, tag="first")
    g.add(nbytes=10.0, resources=[0], waits=[s], tag="waits-forever")
    for impl in ("python", "c"):
        with pytest.raises(ScheduleError, match="waits-forever"):
            run(g, [1e9], impl=impl)


def test_bad_ids_are_refused_before_the_loop_runs() -> None:
    g = TaskGraph()
    g.add(nbytes=1.0, resources=[3], tag="t0")
    with pytest.raises(ScheduleError, match="unknown resource id 3"):
        run(g, [1e9], impl="c")
    g = TaskGraph()
    g.add(waits=[5], tag="t0")
    with pytest.raises(ScheduleError, match="unknown signal 5"):
        run(g, [1e9], impl="c")
    with pytest.raises(ScheduleError, match="engine impl"):
        run(g, [1e9], impl="fortran")
