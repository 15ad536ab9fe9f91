"""How planning time grows with the number of GPUs: switch machines and random meshes, 8 to 64 GPUs.

For each size it builds an NVSwitch machine (every GPU's 18 x 25 GB/s port on
one switch, as an HGX board) and a random heterogeneous NVLink mesh
(about six links per GPU of mixed counts and speeds), plans broadcast and allreduce over NVLink, and prints the
planner's wall and CPU time per call, the optimum, the plan's rate and its
tree count; every plan is checked by tests/support/plan_checker.py (valid, no
link over capacity at its rate).  Everything runs in this process.

Usage::

    python benchmarks/planner_scaling.py [--sizes 8,16,32,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.plan_checker import check_plan  # tests/ is on the path above

from blink_horovod.planner import make_plan
from blink_horovod.topology import Link, Topology, machine


def switch_machine(n: int, links_per_gpu: int = 18, per_link: float = 25.0) -> Topology:
    """``n`` GPUs on one NVSwitch (dgx2 for n = 16 with 6 links)."""
    links = tuple(Link(g, "nvswitch0", "nvlink", links_per_gpu, links_per_gpu * per_link) for g in range(n))
    return Topology(gpus=tuple(range(n)), links=links, name=f"switch{n}", switches=("nvswitch0",))


def mesh_machine(n: int, seed: int = 1, degree: int = 6) -> Topology:
    """A random heterogeneous NVLink mesh of ``n`` GPUs with about ``degree`` links per GPU.

    A random spanning tree plus random extra links between GPUs with spare
    ports (an NVLink GPU has 4-18 ports), each link 1-3 NVLinks of 20, 25 or
    50 GB/s.
    """
    rnd = random.Random(seed)
    order = list(range(n))
    rnd.shuffle(order)
    pairs = {tuple(sorted((order[i], order[rnd.randrange(i)]))) for i in range(1, n)}
    deg = [0] * n
    for a, b in pairs:
        deg[a] += 1
        deg[b] += 1
    for _ in range(20 * n):
        if len(pairs) >= degree * n // 2:
            break
        a, b = rnd.sample(range(n), 2)
        if deg[a] < degree and deg[b] < degree and tuple(sorted((a, b))) not in pairs:
            pairs.add(tuple(sorted((a, b))))
            deg[a] += 1
            deg[b] += 1
    links = []
    for a, b in sorted(pairs):
        count = rnd.randint(1, 3)
        links.append(Link(a, b, "nvlink", count, count * rnd.choice([20.0, 25.0, 50.0])))
    return Topology(gpus=tuple(range(n)), links=tuple(links), name=f"mesh{n}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    print("| machine | GPUs | links | collective | wall s | cpu s | optimum GB/s | rate GB/s | trees |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.sizes.split(",")):
        topos = [machine("dgx2") if n == 16 else switch_machine(n), mesh_machine(n)]
        for topo in topos:
            for coll in ("broadcast", "allreduce"):
                t0, c0 = time.perf_counter(), time.process_time()
                plan = make_plan(topo, coll, channels=["nvlink"])
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                check_plan(plan.to_dict(), topo.to_dict())  # valid, and no link over capacity
                row = {"machine": topo.name, "n": n, "links": len(topo.links), "collective": coll, "wall_s": wall,
                       "cpu_s": cpu, "optimum": plan.optimum_gbps, "rate": plan.rate_gbps, "trees": len(plan.trees)}
                rows.append(row)
                print(f"| {topo.name} | {n} | {len(topo.links)} | {coll} | {wall:.2f} | {cpu:.2f} | {plan.optimum_gbps:.2f} | {plan.rate_gbps:.2f} | {len(plan.trees)} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
