"""One small table from a run of benchmarks/gpu_acceptance.sh: per allocation and dtype, busbw at 256 MB and
1 GB against the HBM bound of the same run, the latency at 8 B, #wrong, and the PyTorch two-shot.

    python benchmarks/gpu_summary.py OUT_DIR > summary.md
"""

from __future__ import annotations

import glob
import json
import os
import sys

NAMES = {"n2": "2, hgx-h200:0,1", "n4": "4, hgx-h200:0,1,2,3", "n8": "8, hgx-h200", "d4": "4, dgx1v:0,1,2,3",
         "d8": "8, dgx1v", "lat2": "2, hgx-h200:0,1, latency run", "lat8": "8, hgx-h200, latency run", "ops": "4, hgx-h200:0,1,2,3, every dtype and op", "bcast": "4, hgx-h200:0,1,2,3, broadcast"}


def _json(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _probe_row(head: tuple[str, str], rows: list[list[float]]) -> str:
    """One probe table row: the loop's and the host call's time, and the native call's phases where the
    probe printed them (columns 7 to 10; zero on the Python path)."""
    top = lambda i: max(r[i] for r in rows)
    phases = " / ".join(f"{top(i):.1f}" for i in range(6, 10)) if all(len(r) >= 10 for r in rows) and top(9) else "-"
    return f"| {head[0]} | {head[1]} | {top(0):.1f} | {top(1):.1f} | {phases} |"


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.readlines()


def main(out: str) -> int:
    ref = {}
    if os.path.exists(os.path.join(out, "ref.json")):
        for r in _json(os.path.join(out, "ref.json")):
            ref[(r["ranks"], r["size"])] = r["two_shot_busbw"]
    print("| ranks, topology | type | busbw 256 MB | bound | % | busbw 1 GB | bound | % | torch two-shot 1 GB "
          "| 8 B latency (us) | #wrong |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name == "ref" or name.startswith("lat"):  # (the latency runs have their own table below)
            continue
        rows = _json(path)["rows"]
        for t in sorted({r["type"] for r in rows}):
            rs = [r for r in rows if r["type"] == t]
            by = {r["size"]: r for r in rs if r["busbw"] is not None}

            def cell(size: int, by: dict = by) -> str:
                r = by.get(size)
                if r is None:
                    return "- | - | -"
                b = r.get("bound")
                return f"{r['busbw']:.1f} | {b:.0f} | {100 * r['busbw'] / b:.0f}%" if b else f"{r['busbw']:.1f} | - | -"

            small = min(by) if by else None
            lat = f"{by[small]['time_us']:.1f} ({small} B)" if small is not None else "-"
            wrong = sum(r["wrong"] or 0 for r in rs)
            n = rs[0]["ranks"]
            two = ref.get((n, 1 << 30))
            print(f"| {NAMES.get(name, name)} | {t} | {cell(256 << 20)} | {cell(1 << 30)} | "
                  f"{f'{two:.0f}' if two else '-'} | {lat} | {wrong} |")
    lats = sorted(glob.glob(os.path.join(out, "lat*.json")))
    if lats:  # the latency runs: 8 B .. 1 MB, many iterations a size
        tables = {os.path.basename(p)[:-5]: _json(p)["rows"] for p in lats}
        sizes = sorted({r["size"] for rows in tables.values() for r in rows})
        print("\n| latency (us), float32 sum | " + " | ".join(f"{s} B" for s in sizes) + " |")
        print("| --- |" + " --- |" * len(sizes))
        for name, rows in tables.items():
            by = {r["size"]: r for r in rows if r["type"] == "float" and r["time_us"] is not None}
            print(f"| {NAMES.get(name, name)} | " + " | ".join(f"{by[s]['time_us']:.1f}" if s in by else "-"
                                                              for s in sizes) + " |")
    probes = sorted(glob.glob(os.path.join(out, "probe*.log")))
    if probes:
        print("\n| probe | size, host path | per op in a loop (us, max over ranks) | host per call (us, max) | "
              "native check / post / wait / launch (us, max) |")
        print("| --- | --- | --- | --- | --- |")
        for path in probes:
            head = None
            rows: list[list[float]] = []
            for line in _lines(path):
                if "per rank" in line and line.strip().endswith(":"):
                    if head and rows:
                        print(_probe_row(head, rows))
                    parts = line.split(":")[0].split(",")  # "2 ranks, 8 B[, native]"
                    head, rows = (parts[0].strip(), ", ".join(p.strip() for p in parts[1:])), []
                elif line.strip().startswith("rank ") and head:
                    rows.append([float(v) for v in line.split(":")[1].split()])
            if head and rows:
                print(_probe_row(head, rows))
    tests = os.path.join(out, "tests.log")
    if os.path.exists(tests):
        lines = [ln.strip() for ln in _lines(tests) if ln.strip()]
        failed = [ln for ln in lines if ln.startswith("FAILED")]
        print("\nGPU tests: " + (lines[-1] if lines else "no output") + "".join(f"\n- {f}" for f in failed))
        # (the test's own lines; a failure's traceback also shows the print statement that writes them)
        host = [ln.split("HOSTTIME", 1)[1].strip() for ln in lines if ln.startswith("HOSTTIME ")]
        if host:  # test_host_time_is_flat_in_the_number_of_chunks, rank 0 (acceptance: total <= 20 us)
            print("\nHost time per repeated collective, 4 ranks: " + "; ".join(dict.fromkeys(host)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
