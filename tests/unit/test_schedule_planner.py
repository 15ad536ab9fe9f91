"""Every program compiled from the planner's plans passes the symbolic checker.

The schedule's acceptance: the symbolic checker passes every program compiled
from the planner's acceptance set.  Here: every NVLink-connected allocation
of 3..8 GPUs of DGX-1V and DGX-1P, both collectives (the allreduce plan also
compiled as the hierarchical stages ``reduce`` and ``broadcast``), at sizes
whose counts do not divide by the GPU count nor by the chunk; plus hybrid
NVLink+PCIe plans of the 8-GPU machines.  A sample is also replayed
numerically.
"""

from __future__ import annotations

import itertools
import time

import networkx as nx
import numpy as np
import pytest

from blink_horovod.planner import make_plan
from blink_horovod.schedule import check_program, compile_program
from blink_horovod.schedule.replay import replay
from blink_horovod.topology.machines import resolve

# (count, chunk_elems): divisible neither by n nor by the chunk (many chunks per tree, a short
# last one); one chunk per tree.
SIZES = ((1001, 64), (4099, 4099))


def connected_allocations(name: str) -> list[tuple[int, ...]]:
    topo = resolve(name)
    g = nx.Graph()
    g.add_nodes_from(topo.gpus)
    g.add_edges_from((a, b) for (a, b) in topo.capacities("nvlink"))
    out = []
    for k in range(3, topo.n + 1):
        for sub in itertools.combinations(topo.gpus, k):
            if nx.is_connected(g.subgraph(sub)):
                out.append(sub)
    return out


def compile_and_check(plan, counts=SIZES) -> int:
    kinds = ("allreduce", "reduce", "broadcast") if plan.collective == "allreduce" else ("broadcast",)
    ops = 0
    for count, chunk in counts:
        for kind in kinds:
            prog = compile_program(plan, count, chunk, kind)
            check_program(prog, plan)
            ops += prog.num_ops()
    return ops


@pytest.mark.timeout(600)
@pytest.mark.parametrize("machine", ["dgx1v", pytest.param("dgx1p", marks=pytest.mark.slow)])
def test_every_connected_allocation_compiles_and_checks(machine: str) -> None:
    allocs = connected_allocations(machine)
    assert len(allocs) == 181
    base = resolve(machine)
    t_plan = t_prog = 0.0
    ops = 0
    for gpus in allocs:
        topo = base.allocate(gpus)
        for coll in ("allreduce", "broadcast"):
            t0 = time.perf_counter()
            plan = make_plan(topo, coll, root=gpus[0] if coll == "broadcast" else None, channels=("nvlink",))
            t1 = time.perf_counter()
            ops += compile_and_check(plan)
            t_prog += time.perf_counter() - t1
            t_plan += t1 - t0
    print(f"\n{machine}: {len(allocs)} allocations x 2 collectives: planning {t_plan:.1f} s, "
          f"compile+check {t_prog:.1f} s for {ops} ops")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("machine", ["dgx1v", "dgx1p"])
def test_hybrid_plans_compile_and_check(machine: str) -> None:
    topo = resolve(machine)
    for coll in ("allreduce", "broadcast"):
        plan = make_plan(topo, coll, root=0 if coll == "broadcast" else None)
        compile_and_check(plan)


@pytest.mark.timeout(300)
def test_planner_programs_replay_to_exact_sums() -> None:
    rng = np.random.default_rng(7)
    for spec in ("dgx1v", "dgx1v:0,1,4", "dgx1v:1,2,3,5,6", "dgx1p:0,1,2,3,4"):
        topo = resolve(spec)
        for coll in ("allreduce", "broadcast"):
            plan = make_plan(topo, coll, root=topo.gpus[-1] if coll == "broadcast" else None)
            inputs = [rng.integers(-99, 99, 2003).astype(np.float64) for _ in range(plan.n)]
            prog = compile_program(plan, 2003, 50)
            check_program(prog, plan)
            out = replay(prog, inputs, seed=1)
            want = np.sum(inputs, axis=0) if coll == "allreduce" else inputs[prog.root]
            for r, o in enumerate(out):
                np.testing.assert_array_equal(o, want, err_msg=f"{spec} {coll} rank {r}")


@pytest.mark.timeout(300)
def test_one_gigabyte_program_compiles_and_checks_quickly() -> None:
    """8-GPU DGX-1V, 1 GB of float32 in 1 MB chunks, both collectives."""
    topo = resolve("dgx1v")
    for coll in ("allreduce", "broadcast"):
        plan = make_plan(topo, coll, root=0 if coll == "broadcast" else None, channels=("nvlink",))
        t0 = time.perf_counter()
        prog = compile_program(plan, (1 << 30) // 4, (1 << 20) // 4)
        t1 = time.perf_counter()
        check_program(prog, plan)
        t2 = time.perf_counter()
        print(f"\n{coll}: {len(plan.trees)} trees, {prog.num_ops()} ops: compile {t1 - t0:.2f} s, check {t2 - t1:.2f} s")
        assert t1 - t0 < 5 and t2 - t1 < 10
