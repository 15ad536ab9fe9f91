"""The planner's acceptance sweep: every NVLink-connected DGX-1 allocation and 50 random machines.

For every NVLink-connected allocation of 3..8 GPUs of ``dgx1p`` and ``dgx1v``
(181 each) and 50 seeded random heterogeneous machines (tests/unit/
plan_checker.py's ``random_machine``), both collectives (broadcast from the
first GPU), it plans with ``make_plan`` and checks the plan with the
independent checker (tests/support/plan_checker.py): validity, no link over
capacity at ``rate_gbps``, and ``rate_gbps >= 0.999 x`` the checker's own
optimum.  It prints tree counts, planning times and any failure.

Usage::

    python benchmarks/planner_sweep.py [--channels nvlink|nvlink,pcie] [--random 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.plan_checker import (
    check_plan,
    connected_subsets,
    independent_optimum,
    random_machine,
)

from blink_horovod.planner import make_plan
from blink_horovod.topology import Topology, machine


def cases(random_count: int):
    """(label, Topology) for every allocation of the sweep."""
    for name in ("dgx1p", "dgx1v"):
        whole = machine(name)
        for sub in connected_subsets(whole.to_dict(), range(3, 9)):
            yield f"{name}:{','.join(map(str, sub))}", whole.allocate(sub)
    for seed in range(random_count):
        yield f"random{seed}", Topology.from_dict(random_machine(seed))


def run(channels: list[str] | None, random_count: int) -> dict:
    rows = []
    for label, topo in cases(random_count):
        td = topo.to_dict()
        for coll in ("broadcast", "allreduce"):
            root = topo.gpus[0] if coll == "broadcast" else None
            chans = channels if channels is not None else (["nvlink", "pcie"] if topo.pcie is not None else ["nvlink"])
            t0 = time.perf_counter()
            c0 = time.process_time()
            plan = make_plan(topo, coll, root=root, channels=chans)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            pd = plan.to_dict()
            error = None
            try:
                check_plan(pd, td)
                opt = independent_optimum(td, coll, root, list(chans))
                if plan.rate_gbps < 0.999 * opt:
                    error = f"rate {plan.rate_gbps} < 0.999 x optimum {opt}"
                if abs(plan.optimum_gbps - opt) > 1e-6 * max(opt, 1.0):
                    error = f"optimum_gbps {plan.optimum_gbps} != checker's {opt}"
            except AssertionError as exc:
                error, opt = str(exc), 0.0
            rows.append(
                {
                    "case": label,
                    "n": topo.n,
                    "collective": coll,
                    "optimum": opt,
                    "rate": plan.rate_gbps,
                    "trees": len(plan.trees),
                    "distinct": plan.extras.get("distinct_trees"),
                    "mwu_trees": plan.extras.get("trees_before_refinement"),
                    "refinement": {c: i["refinement"] for c, i in plan.extras.get("refinement", {}).items()},
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "error": error,
                }
            )
    return {"rows": rows}


def summarise(result: dict) -> str:
    rows = result["rows"]
    out = []
    bad = [r for r in rows if r["error"]]
    out.append(f"plans: {len(rows)}  failures: {len(bad)}")
    for r in bad[:20]:
        out.append(f"  FAIL {r['case']} {r['collective']}: {r['error']}")
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        fam = r["case"].split(":")[0] if ":" in r["case"] else "random"
        groups.setdefault((fam, r["collective"]), []).append(r)
    out.append("")
    out.append("| machine | collective | plans | min rate/optimum | trees (plan entries) mean / max | distinct trees mean / max | MWU trees mean | wall s mean / max | cpu s mean / max |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (fam, coll), rs in sorted(groups.items()):
        ratio = min((r["rate"] / r["optimum"]) if r["optimum"] else 1.0 for r in rs)
        out.append(
            f"| {fam} | {coll} | {len(rs)} | {ratio:.6f} | {statistics.mean(r['trees'] for r in rs):.1f} / {max(r['trees'] for r in rs)} "
            f"| {statistics.mean(r['distinct'] for r in rs):.1f} / {max(r['distinct'] for r in rs)} "
            f"| {statistics.mean(r['mwu_trees'] for r in rs):.1f} "
            f"| {statistics.mean(r['wall_s'] for r in rs):.3f} / {max(r['wall_s'] for r in rs):.3f} "
            f"| {statistics.mean(r['cpu_s'] for r in rs):.3f} / {max(r['cpu_s'] for r in rs):.3f} |"
        )
    out.append("")
    for (fam, coll), rs in sorted(groups.items()):
        if fam == "random":
            continue
        by_n: dict[int, Counter] = {}
        for r in rs:
            by_n.setdefault(r["n"], Counter())[r["trees"]] += 1
        hist = "; ".join(f"n={n}: " + ", ".join(f"{k} trees x{v}" for k, v in sorted(c.items())) for n, c in sorted(by_n.items()))
        out.append(f"{fam} {coll} tree counts: {hist}")
    total_wall = sum(r["wall_s"] for r in rows)
    out.append("")
    out.append(f"total planning wall time {total_wall:.1f} s, cpu {sum(r['cpu_s'] for r in rows):.1f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", default="nvlink", help="nvlink, nvlink,pcie, or 'all' (every channel a machine has)")
    ap.add_argument("--random", type=int, default=50, help="number of random machines")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    channels = None if args.channels == "all" else args.channels.split(",")
    t0 = time.perf_counter()
    result = run(channels, args.random)
    print(summarise(result))
    print(f"sweep wall time (with checking) {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if any(r["error"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
