"""The CPU acceptance command, run as written, repeated, with the load beside every run.

    blinkrun -np 4 -H localhost:4 [--gloo] blink perf --impl both -b 1K -e 64M -f 4 -c 1   (-n 20 -w 5: the defaults)

Without ``--gloo`` horovodrun picks Horovod's MPI controller here (Horovod is
built with MPI and Gloo), so ``--configs default`` is the MPI case.  Each run
writes ``NAME.log`` (the table, ``uptime`` before and after) and ``NAME.json``
(every row) into ``--out``, and the summary prints per run: busbw of both at
64 MB and their ratio, CPU per rank per allreduce, 1 KiB latency of both,
``#wrong`` and the exit status.  ``--env K=V`` sets a variable for the runs of
that invocation (e.g. ``BLINK_MPI_YIELD=0`` to measure what it saves); it
reaches both implementations, which share the processes.

    .venv/bin/python benchmarks/cpu_acceptance.py --out build/cpu-acceptance --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "bin"
BIG, SMALL = 64 << 20, 1024
CONFIGS = {"default": [], "gloo": ["--gloo"], "mpi": ["--mpi"]}


def _row(rows: list[dict], impl: str, size: int) -> dict:
    return next((r for r in rows if r["impl"] == impl and r["size"] == size), {})


def run_once(out: Path, name: str, extra: list[str], env: dict[str, str]) -> dict:
    cmd = [str(VENV / "blinkrun"), "-np", "4", "-H", "localhost:4", *extra, str(VENV / "blink"), "perf",
           "--impl", "both", "-b", "1K", "-e", "64M", "-f", "4", "-c", "1", "-n", "20", "-w", "5",
           "--json", str(out / f"{name}.json")]
    before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    noise = ("I0000", "To enable the following", "WARNING: All log messages", "ops WARNING")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not any(n in ln for n in noise)]
    (out / f"{name}.log").write_text("\n".join([f"# {' '.join(cmd)}", f"# env: {json.dumps(_extra_env(env))}",
                                               f"# before: {before}", *lines, f"# rc={proc.returncode}",
                                               f"# after: {after}", ""]))
    rows = json.loads((out / f"{name}.json").read_text())["rows"] if (out / f"{name}.json").exists() else []
    b, h = _row(rows, "blink", BIG), _row(rows, "horovod", BIG)
    bs, hs = _row(rows, "blink", SMALL), _row(rows, "horovod", SMALL)
    return {"run": name, "rc": proc.returncode, "load_before": before.split("load average:")[-1].strip(),
            "blink_busbw": b.get("busbw"), "horovod_busbw": h.get("busbw"),
            "ratio": b["busbw"] / h["busbw"] if b.get("busbw") and h.get("busbw") else None,
            "blink_cpu_ms": (b.get("cpu_us") or 0) / 1e3, "horovod_cpu_ms": (h.get("cpu_us") or 0) / 1e3,
            "blink_1k_us": bs.get("time_us"), "horovod_1k_us": hs.get("time_us"),
            "wrong": sum(r["wrong"] or 0 for r in rows), "rows": len(rows)}


def _extra_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("BLINK_", "HOROVOD_", "OMPI_MCA"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="default,gloo", help="comma-separated: default (MPI here), gloo, mpi")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tag", default="", help="appended to the run names (e.g. -noyield)")
    ap.add_argument("--env", action="append", default=[], help="K=V for these runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_USE_LEGACY_KERAS="1")
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    results = []
    for i in range(args.repeats):
        for config in args.configs.split(","):
            name = f"{config}{args.tag}-{i + 1}"
            n = 1
            while (out / f"{name}.log").exists():  # never overwrite an earlier run's raw output
                n += 1
                name = f"{config}{args.tag}-{i + 1}.{n}"
            res = run_once(out, name, CONFIGS[config], env)
            results.append(res)
            print(json.dumps({k: v for k, v in res.items()}), flush=True)
    summary = out / "summary.jsonl"
    with summary.open("a") as fh:
        for res in results:
            fh.write(json.dumps({**res, "env": _extra_env(env)}) + "\n")
    return 0 if all(r["rc"] == 0 and r["wrong"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
