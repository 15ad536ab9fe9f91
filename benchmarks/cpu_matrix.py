"""The CPU correctness matrix: ``blink perf -c 1`` on every topology, collective, dtype and op.

The acceptance command is
``blinkrun -np 4 -H localhost:4 blink perf --impl both -b 1K -e 64M -f 4 -c 1``;
this script runs it for

* three topologies (``BLINK_TOPOLOGY``): ``flat`` (unset: the ranks form
  ``cpu``, fully connected, equal links), a DGX-1V allocation
  (``dgx1v:0,1,2,3``, heterogeneous NVLink bundles) and a random machine file
  (``tests/support/plan_checker.random_machine``, seed 4: a switch, a PCIe
  channel, so hybrid plans, and a GPU pair without a direct link, so even
  small messages go through the trees),
* allreduce (every op of ``-o all``: sum, average, min, max, product) and
  broadcast (from root 0 and from root 3, ``--roots``),
* every dtype (``-d all``: float, double, half, bfloat16, int32, int64, int8,
  uint8, int16),

with ``--json`` per run, and summarises rows checked and ``#wrong`` (every
size is checked twice, before and after the timed loop).  Re-run it with::

    .venv/bin/python benchmarks/cpu_matrix.py --out build/cpu_matrix
    .venv/bin/python benchmarks/cpu_matrix.py --out build/cpu_matrix -n 2 -w 1   # quicker, same checks

It exits non-zero if any run failed or any element was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from perf_runs import ROOT, VENV, run_perf

RANDOM_SEED = 4
TOPOLOGIES = ("flat", "dgx1v:0,1,2,3", "random")
COLLECTIVES = ("allreduce", "broadcast")


def random_machine_file(folder: Path) -> Path:
    """The random machine as a ``blink-topology/1`` file (the tests' seeded generator)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.plan_checker import random_machine  # noqa: E402 - the project's own generator

    path = folder / f"random{RANDOM_SEED}.json"
    path.write_text(json.dumps(random_machine(RANDOM_SEED, 4), indent=2) + "\n")
    return path


def perf_command(args: argparse.Namespace, collective: str, json_path: Path, root: int = 0) -> list[str]:
    cmd = [str(VENV / "blinkrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", *args.launcher_args,
           str(VENV / "blink"), "perf", "--impl", args.impl, "-b", args.minbytes, "-e", args.maxbytes, "-f",
           args.factor, "-c", "1", "--collective", collective, "-d", args.dtypes, "--json", str(json_path)]
    if collective == "allreduce":
        cmd += ["-o", args.ops]
    else:
        cmd += ["-r", str(root)]
    if args.iters:
        cmd += ["-n", str(args.iters)]
    if args.warmup is not None:
        cmd += ["-w", str(args.warmup)]
    return cmd


def summarise(rows: list[dict]) -> dict:
    out: dict = {}
    for impl in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == impl]
        checked = [r for r in mine if r.get("wrong") is not None]
        out[impl] = {"rows": len(mine), "checked": len(checked), "not_run": len(mine) - len(checked),
                     "wrong": sum(r["wrong"] for r in checked),
                     "types": sorted({r["type"] for r in checked}),
                     "ops": sorted({r["op"] for r in checked if r.get("op")}),
                     "sizes": sorted({r["size"] for r in checked})}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/cpu_matrix", help="folder for the JSON files and the summary")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--topologies", default=",".join(TOPOLOGIES).replace("dgx1v:0,1,2,3", "dgx1v:0-3"),
                   help="comma list of flat, dgx1v:0-3 (written with a dash here), random, or topology files")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--impl", default="both")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--factor", default="4")
    p.add_argument("-d", "--dtypes", default="all")
    p.add_argument("-o", "--ops", default="all")
    p.add_argument("--roots", default="0,3", help="broadcast roots, one run each (default 0,3)")
    p.add_argument("-n", "--iters", type=int, default=None, help="timed iterations (default: perf's, 20)")
    p.add_argument("-w", "--warmup", type=int, default=None, help="warm-up iterations (default: perf's, 5)")
    p.add_argument("--launcher-args", default="--gloo",
                   help="passed to blinkrun before the command (default --gloo; '' for horovodrun's default)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per perf run")
    args = p.parse_args(argv)
    args.launcher_args = args.launcher_args.split()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "cpus": os.cpu_count(), "runs": []}
    failed = 0
    for topo in args.topologies.split(","):
        topo = topo.strip().replace("dgx1v:0-3", "dgx1v:0,1,2,3")
        env = dict(os.environ)
        env.pop("BLINK_TOPOLOGY", None)
        if topo == "random":
            env["BLINK_TOPOLOGY"] = str(random_machine_file(out))
        elif topo != "flat":
            env["BLINK_TOPOLOGY"] = topo
        runs = [(c, 0) for c in args.collectives.split(",") if c == "allreduce"]
        runs += [(c, int(r)) for c in args.collectives.split(",") if c == "broadcast" for r in args.roots.split(",")]
        for coll, root in runs:
            what = coll if coll == "allreduce" else f"{coll} root {root}"
            tag = f"{topo.replace(':', '_').replace(',', '')}-{coll}" + ("" if coll == "allreduce" else f"-r{root}")
            js, log = out / f"{tag}.json", out / f"{tag}.log"
            cmd = perf_command(args, coll, js, root)
            start = time.monotonic()
            print(f"[cpu_matrix] {topo} {what}: {' '.join(cmd)}", flush=True)
            rc, rows = run_perf(cmd, env, log, js, args.timeout)
            seconds = time.monotonic() - start
            run = {"topology": topo, "collective": what, "exit": rc, "seconds": round(seconds, 1),
                   "env_topology": env.get("BLINK_TOPOLOGY"), "command": cmd, "summary": summarise(rows)}
            summary["runs"].append(run)
            failed += rc != 0 or any(s["wrong"] for s in run["summary"].values()) or not rows
            blink = run["summary"].get("blink", {})
            print(f"[cpu_matrix]   exit {rc}, {seconds:.0f} s; blink rows checked {blink.get('checked')}, "
                  f"#wrong {blink.get('wrong')}; horovod {run['summary'].get('horovod', {}).get('checked')} "
                  f"checked, #wrong {run['summary'].get('horovod', {}).get('wrong')}", flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render(summary))
    return 1 if failed else 0


def render(summary: dict) -> str:
    """The summary as a markdown table (for docs/benchmarks.md)."""
    lines = ["| topology | collective | dtypes x ops x sizes | Blink rows checked | Blink #wrong | "
             "Horovod rows checked | Horovod #wrong | exit |", "|---|---|---|---|---|---|---|---|"]
    for run in summary["runs"]:
        b = run["summary"].get("blink", {})
        h = run["summary"].get("horovod", {})
        shape = f"{len(b.get('types', []))} x {max(1, len(b.get('ops', [])))} x {len(b.get('sizes', []))}"
        lines.append(f"| {run['topology']} | {run['collective']} | {shape} | {b.get('checked', 0)} | "
                     f"{b.get('wrong', 'n/a')} | {h.get('checked', 0)} | {h.get('wrong', 'n/a')} | {run['exit']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
