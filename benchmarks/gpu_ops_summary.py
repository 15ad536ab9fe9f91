"""The summary of benchmarks/gpu_ops_acceptance.sh: one small markdown file from the step logs.

    python benchmarks/gpu_ops_summary.py OUT_DIR > OUT_DIR/summary.md
    python benchmarks/gpu_ops_summary.py --differing OUT_DIR   # the reference suite's tests whose verdicts
                                                               # differ between stock and Blink, one per line
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path


def last_line(path: Path, pattern: str) -> str:
    if not path.exists():
        return "not run"
    hits = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if re.search(pattern, ln)]
    return hits[-1] if hits else "no result line"


def weights(out: Path, layout: str) -> str:
    import numpy as np

    a, b = out / f"w_{layout}_stock.npz", out / f"w_{layout}_blink.npz"
    if not any((out / f"train_{layout}_{impl}.log").exists() for impl in ("stock", "blink")):
        return "not run"
    if not (a.exists() and b.exists()):
        return "missing (a job failed: see its log)"
    wa, wb = dict(np.load(a)), dict(np.load(b))
    if wa.keys() != wb.keys():
        return "different parameters"
    return f"max abs difference {max(float(np.abs(wa[k] - wb[k]).max()) for k in wa):.3g}"


def stats(path: Path) -> str:
    if not path.exists():
        return "-"
    found = re.findall(r"STATS (\S+) (\{.*\})", path.read_text(errors="replace"))
    rows = [(r, json.loads(s)) for r, s in found]
    return "; ".join(f"rank {r}: allreduce {s['allreduce']}, broadcast {s['broadcast']}, fallback {s['fallback']}"
                     for r, s in sorted(rows)) or "no STATS lines"


def faults(path: Path) -> list[str]:
    """One line per fault case (tests/integration/test_reliability_servers.py -k cuda): case, outcome, behaviour."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    outcomes = data.get("outcomes", {})
    return [f"{r.get('case')}: {outcomes.get(r.get('test'), r.get('outcome', '?'))}: {str(r.get('behaviour', ''))[:300]}"
            for r in data.get("records", [])]


def main() -> None:
    out = Path(sys.argv[1])
    print("# CUDA tensors under horovodrun: acceptance summary\n")
    print(f"- build: {last_line(out / 'build.log', r'^rc=|^blink install')}")
    print(f"- steps: {last_line(out / 'steps.txt', 'build:')}")
    print(f"- GPU runtime tests (stages, dtypes): {last_line(out / 'runtime.log', r'passed|failed|error')}")
    print(f"- ops exact (1x2, 2x2): {last_line(out / 'exact.log', r'passed|failed|error')}")
    print(f"- faults across servers, CUDA tensors: {last_line(out / 'faults.log', r'passed|failed|error')}")
    for row in faults(out / "faults.json"):
        print(f"  - {row}")
    print("\n## Training, stock vs Blink (examples/torch_train.py --device cuda, 15 steps)\n")
    for layout in ("np2", "np4"):
        print(f"- {layout}: {weights(out, layout)}")
        print(f"  - Blink stats: {stats(out / f'train_{layout}_blink.log')}")
        probe = last_line(out / f"train_{layout}_blink.log", r"BLINK_TOPOLOGY unset|CUDA tensors on|topology")
        print(f"  - probe/plan log: {probe}")
    print("\n## Step time, ~100 M parameters, 2 ranks (stock stages CUDA tensors through host memory)\n")
    print("| dtype | impl | step ms | compute ms | comm ms | allreduce ms | note |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dt in ("float32", "bfloat16"):
        for blink, impl in (("0", "stock"), ("1", "blink"), ("share", "blink, BLINK_GPU_SM_SHARE=STEP_SHARE")):
            p = out / f"step_{dt}_{blink}.log"
            if blink == "share" and not p.exists():
                continue
            runs = [p, *sorted(out.glob(f"step_{dt}_{blink}.*.log"))]  # STEP_RUNS
            if len(runs) > 1:
                ended = sum(1 for q in runs if q.exists() and re.search(r'STEP \{"blink"', q.read_text(errors="replace")))
                impl += f" ({ended} of {len(runs)} runs ended)"
            m = re.findall(r"STEP (\{.*\})", p.read_text(errors="replace")) if p.exists() else []
            if not m:
                print(f"| {dt} | {impl} | - | - | - | - | {'no result' if p.exists() else 'not run'} |")
                continue
            s = json.loads(m[-1])
            if "error" in s:
                print(f"| {dt} | {impl} | - | - | - | - | {s['error']} |")
                continue
            print(f"| {dt} | {impl} | {s['step_ms']} | {s['compute_ms']} | {s['comm_ms']} | {s['allreduce_ms']} | "
                  f"{s['params'] / 1e6:.0f} M params |")
    runs = _hvdtest_runs(out)
    for mode, run in runs.items():
        print(f"\n- Horovod's test_torch.py, {mode} -np {run['np']} ({run['files']} file(s), shares "
              f"{', '.join(run['shards'])}): {run['counts']}")
    if len(runs) == 2:
        both, diff = _hvdtest_compared(runs)
        print(f"- verdicts compared (tests run both ways): {len(both)}; those that differ (stock, blink): "
              f"{diff or 'none'}")
    name = _reference_suite().short_name
    alone = {side: json.loads(p.read_text())["tests"] for side, p in
             (("stock", out / "alone.json"), ("blink", out / "alone_blink.json")) if p.exists()}
    if alone:
        print("- those run again alone, stock then Blink, one job per test and nothing else running "
              "(stock, blink): " + ", ".join(
                  f"{name(t)} ({alone.get('stock', {}).get(t, 'not run')}, "
                  f"{alone.get('blink', {}).get(t, 'not run')})"
                  for t in sorted(set().union(*alone.values()))))


def _hvdtest_compared(runs: dict[str, dict]) -> tuple[list[str], dict[str, tuple]]:
    """The tests with a verdict on both sides, and those whose verdicts differ: {test: (stock, blink)}."""
    va, vb = runs["stock"]["tests"], runs["BLINK_ENABLE=1"]["tests"]
    both = [k for k in sorted(set(va) | set(vb)) if "NOTRUN" not in (va.get(k, "NOTRUN"), vb.get(k, "NOTRUN"))]
    return both, {k: (va.get(k), vb.get(k)) for k in both if va.get(k) != vb.get(k)}

def _hvdtest_runs(out: Path) -> dict[str, dict]:
    """Every hvdtest*.json of the reference suite (shares run at once, or continued over calls), merged
    per mode ("stock", "BLINK_ENABLE=1"): a test's verdict is the last one other than NOTRUN."""
    runs: dict[str, dict] = {}
    for p in sorted(out.glob("hvdtest*.json")):
        r = json.loads(p.read_text())
        run = runs.setdefault(r["mode"], {"np": r["np"], "files": 0, "shards": [], "tests": {}})
        run["files"] += 1
        run["shards"].append(r.get("shard", "0/1"))
        for t, v in r["tests"].items():
            if v != "NOTRUN" or t not in run["tests"]:
                run["tests"][t] = v
    if runs:
        count = _reference_suite().count_verdicts
        for run in runs.values():
            run["counts"] = count(run["tests"].values())
    return runs


def _reference_suite():
    """tests/parallel/ops_reference_suite.py, the driver that wrote the hvdtest*.json (its verdict counting)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "parallel" / "ops_reference_suite.py"
    spec = importlib.util.spec_from_file_location("ops_reference_suite", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    if sys.argv[1:2] == ["--differing"]:
        found = _hvdtest_runs(Path(sys.argv[2]))
        if len(found) == 2:
            print("\n".join(map(_reference_suite().short_name, _hvdtest_compared(found)[1])))
    else:
        main()
