"""CPU speed: Blink against stock Horovod in the same ``blink perf --impl both`` run.

Acceptance: busbw at 64 MB >= 4x stock Horovod's in the same run, small-message
latency reported.  Each configuration launches 4 ranks on this host and runs
``blink perf --impl both -b 8 -e 64M -f 2`` (every power of two, so 8 B, 1 KB
and 64 MB are all rows), repeated ``--repeats`` times:

``gloo``     ``blinkrun -np 4 -H localhost:4 --gloo``: Horovod's Gloo controller and ring (TCP loopback);
``mpi``      ``blinkrun -np 4 -H localhost:4 --mpi``: Open MPI, told the host has 4 slots, so it
             busy-polls (Horovod's background threads spin in MPI while they wait for each other);
``mpirun``   ``mpirun --oversubscribe -np 4``: Open MPI knowing the host is oversubscribed, so
             it yields while waiting (``mpi_yield_when_idle``), with its shared-memory transport.

In ``--impl both`` the timed loops of the two implementations alternate in
rounds, so both see the same load of this shared machine.  Re-run with::

    .venv/bin/python benchmarks/cpu_speed.py --out build/cpu_speed --repeats 3

The summary (stdout, and ``summary.json``) has per run: busbw of both and their
ratio at 64 MB, time at 8 B and 1 KB of both, CPU time per rank per collective
at 64 MB, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from perf_runs import ROOT, VENV, run_perf

CONFIGS = ("gloo", "mpi", "mpirun")
BIG = 64 << 20


def launch(config: str, np_: int) -> list[str]:
    if config == "gloo":
        return [str(VENV / "blinkrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo"]
    if config == "mpi":
        return [str(VENV / "blinkrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--mpi"]
    if config == "mpirun":
        mpirun = shutil.which("mpirun") or "mpirun"
        exports = []
        for k in ("PATH", "PYTHONPATH", "BLINK_PLAN_CACHE", "BLINK_TOPOLOGY", "BLINK_CHUNK_BYTES", "OMP_NUM_THREADS"):
            if k in os.environ or k in ("PYTHONPATH",):
                exports += ["-x", k]
        return [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np_), *exports]
    raise SystemExit(f"--configs: unknown configuration {config!r} (expected {', '.join(CONFIGS)})")


def row(rows: list[dict], impl: str, size: int) -> dict | None:
    return next((r for r in rows if r["impl"] == impl and r["size"] == size), None)


def digest(rows: list[dict]) -> dict:
    out: dict = {}
    b, h = row(rows, "blink", BIG), row(rows, "horovod", BIG)
    if b and h and b.get("busbw") and h.get("busbw"):
        out.update(blink_busbw=b["busbw"], horovod_busbw=h["busbw"], ratio=b["busbw"] / h["busbw"],
                   blink_time_us=b["time_us"], horovod_time_us=h["time_us"],
                   blink_cpu_us=b.get("cpu_us"), horovod_cpu_us=h.get("cpu_us"))
    for size in (8, 1024):
        bs, hs = row(rows, "blink", size), row(rows, "horovod", size)
        if bs and hs:
            out[f"blink_us_{size}"] = bs["time_us"]
            out[f"horovod_us_{size}"] = hs["time_us"]
    out["wrong"] = sum(r["wrong"] or 0 for r in rows)
    return out


def table(rows: list[dict]) -> str:
    """One run's rows as markdown: size, time, algbw, busbw of both implementations, and ratios."""

    def fmt_size(n: int) -> str:
        for unit, k in (("G", 30), ("M", 20), ("K", 10)):
            if n >= 1 << k and n % (1 << k) == 0:
                return f"{n >> k} {unit}B"
        return f"{n} B"

    lines = ["| size | blink time (us) | algbw (GB/s) | busbw (GB/s) | horovod time (us) | algbw (GB/s) | "
             "busbw (GB/s) | busbw ratio | #wrong (blink, horovod) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for size in sorted({r["size"] for r in rows}):
        b, h = row(rows, "blink", size), row(rows, "horovod", size)
        if not b or not h or b.get("time_us") is None or h.get("time_us") is None:
            continue
        ratio = b["busbw"] / h["busbw"] if h["busbw"] else float("nan")
        lines.append(f"| {fmt_size(size)} | {b['time_us']:.1f} | {b['algbw']:.4f} | {b['busbw']:.4f} | "
                     f"{h['time_us']:.1f} | {h['algbw']:.4f} | {h['busbw']:.4f} | {ratio:.2f}x | "
                     f"{b['wrong']}, {h['wrong']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", metavar="RUN.json", help="only print one run's per-size table (markdown) and exit")
    p.add_argument("--out", default="build/cpu_speed")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--factor", default="2")
    p.add_argument("-n", "--iters", default="20")
    p.add_argument("-w", "--warmup", default="5")
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    summary: dict = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "runs": []}
    failed = 0
    for k in range(args.repeats):
        for config in args.configs.split(","):
            js, log = out / f"{config}-{k}.json", out / f"{config}-{k}.log"
            cmd = launch(config, args.np) + [str(VENV / "python"), "-m", "blink_horovod", "perf", "--impl", "both",
                                             "-b", args.minbytes, "-e", args.maxbytes, "-f", args.factor,
                                             "-n", args.iters, "-w", args.warmup, "--json", str(js)]
            load = os.getloadavg()
            print(f"[cpu_speed] {config} #{k}: {' '.join(cmd)}", flush=True)
            t0 = time.monotonic()
            rc, rows = run_perf(cmd, env, log, js, args.timeout)
            run = {"config": config, "repeat": k, "exit": rc, "seconds": round(time.monotonic() - t0, 1),
                   "load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
                   "command": cmd, **digest(rows)}
            failed += rc != 0 or "ratio" not in run
            summary["runs"].append(run)
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print(f"[cpu_speed]   exit {rc}: " + ", ".join(f"{k2} {v:.4g}" if isinstance(v, float) else f"{k2} {v}"
                                                        for k2, v in run.items() if k2 not in ("command",)), flush=True)
    print(render(summary))
    return 1 if failed else 0


def render(summary: dict) -> str:
    """Per-run rows and the median ratio per configuration, as markdown."""
    lines = ["| config | run | load (1 min) | busbw 64 MB blink | horovod | ratio | CPU/rank 64 MB blink | horovod | "
             "8 B blink | horovod | 1 KB blink | horovod |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "n/a"

    for r in summary["runs"]:
        lines.append(
            f"| {r['config']} | {r['repeat']} | {r['load_before'][0]:.1f} | {f(r.get('blink_busbw'), '.3f')} GB/s | "
            f"{f(r.get('horovod_busbw'), '.3f')} GB/s | **{f(r.get('ratio'), '.2f')}x** | "
            f"{f((r.get('blink_cpu_us') or 0) / 1e3, '.1f')} ms | {f((r.get('horovod_cpu_us') or 0) / 1e3, '.1f')} ms | "
            f"{f(r.get('blink_us_8'), '.0f')} us | {f(r.get('horovod_us_8'), '.0f')} us | "
            f"{f(r.get('blink_us_1024'), '.0f')} us | {f(r.get('horovod_us_1024'), '.0f')} us |")
    lines.append("")
    for config in dict.fromkeys(r["config"] for r in summary["runs"]):
        ratios = [r["ratio"] for r in summary["runs"] if r["config"] == config and "ratio" in r]
        if ratios:
            lines.append(f"- {config}: busbw ratio at 64 MB, median of {len(ratios)}: {statistics.median(ratios):.2f}x "
                         f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
