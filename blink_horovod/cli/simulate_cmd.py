"""``blink simulate``: Blink's plans against the NCCL model, in the chunk-level simulator (docs/formats.md, Commands).

::

    blink simulate --topology NAME|FILE [--allocations all|0,1,4,5] --collective C
                   [--size 1G | -b MIN -e MAX -f FACTOR] [--channels ...]
                   [--json FILE] [--plot FILE.png]
                   [--chunk SIZE|miad] [--jobs N] [--lanes root|link|tree] [--no-progress]

``--allocations all`` sweeps every GPU subset of 3 GPUs or more; a list takes
one allocation (``0,1,4,5``) or several separated by ``;``.  Without it the
topology as given (``dgx1v``, or an allocation such as ``dgx1v:0,1,4,5``) is
the one allocation.  ``--collective`` is ``allreduce``, ``broadcast`` or
``both``.  The broadcast root is the first GPU of each allocation.  With
``--channels nvlink``, allocations NVLink does not connect are skipped with a
note on stderr; the NCCL model keeps its own PCIe fallback either way.

A table goes to stdout (to stderr when ``--json -`` puts the JSON on stdout);
progress and notes go to stderr.  ``--json`` writes ``{"rows": [...],
"geomean_speedup": X}`` with rows ``{"gpus", "collective", "size_bytes",
"blink_s", "nccl_s", "speedup", "trees", ...}``; ``--plot`` a PNG.
Extensions (optional): ``--chunk`` fixes the chunk size or, as ``miad``, tunes it
on the simulator with the MIAD tuner (default: chosen per
allocation, sim/blink.py), ``--jobs`` runs the sweep on several processes,
``--lanes`` picks the schedule compiler's lane policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..topology.machines import parse_gpu_list
from ..units import format_size, parse_number, parse_size
from .common import load_topology, write_output
from .plan_cmd import parse_channels

__all__ = ["parse_allocations", "parse_sizes", "register", "run"]

COLLECTIVE_CHOICES = ("allreduce", "broadcast", "both")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate Blink's collectives against NCCL on a topology (chunk-level simulator)",
        description=(
            "Plan, compile and simulate Blink's collectives chunk by chunk on a topology, and compare them with a "
            "model of NCCL's rings and trees. Links move bytes at their bandwidth_gbps; the simulator adds per-chunk "
            "costs, pipeline fill and drain, and contention."
        ),
    )
    p.add_argument("--topology", required=True, metavar="NAME|FILE",
                   help="built-in machine (dgx1p, dgx1v, dgx2, ...), NAME:0,1,4,5 or a blink-topology/1 file")
    p.add_argument("--allocations", metavar="all|0,1,4,5",
                   help="'all' (every subset of >= 3 GPUs) or GPU lists separated by ';' (default: the topology as given)")
    p.add_argument("--collective", required=True, choices=COLLECTIVE_CHOICES)
    p.add_argument("--size", metavar="SIZE", help="message size (K, M, G suffixes; default 1G)")
    p.add_argument("-b", "--minbytes", metavar="MIN", help="sweep sizes from MIN ...")
    p.add_argument("-e", "--maxbytes", metavar="MAX", help="... to MAX ...")
    p.add_argument("-f", "--stepfactor", metavar="FACTOR", help="... multiplying by FACTOR (default 2)")
    p.add_argument("--channels", metavar="nvlink|nvlink,pcie",
                   help="channels Blink plans on (default: every channel the topology has)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON ('-' for stdout)")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of the speedups")
    p.add_argument("--chunk", metavar="SIZE|miad",
                   help="fixed chunk size for Blink, or 'miad' to tune it on the simulator (default: chosen per allocation)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="worker processes for a sweep (default 1)")
    p.add_argument("--lanes", choices=("root", "link", "tree"),
                   help="the schedule compiler's lane policy (default: the compiler's own)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def parse_allocations(text: str | None, topology) -> list[tuple[int, ...]] | None:
    """``all`` -> every subset of >= 3 GPUs; ``0,1,4,5;2,3,6`` -> those; None -> None (the topology as given)."""
    from ..sim.sweep import gpu_subsets

    if text is None:
        return None
    if text.strip() == "all":
        subsets = gpu_subsets(topology)
        if not subsets:
            raise ConfigError(f"--allocations: topology {topology.name!r} has fewer than 3 GPUs, 'all' is empty")
        return subsets
    out = []
    for part in text.split(";"):
        gpus = parse_gpu_list(part.strip(), "--allocations")
        unknown = [g for g in gpus if g not in topology.gpus]
        if unknown:
            raise ConfigError(f"--allocations: GPU {unknown[0]} is not on {topology.name!r} (it has {list(topology.gpus)})")
        if len(gpus) < 2:
            raise ConfigError(f"--allocations: an allocation needs at least 2 GPUs, got {part.strip()!r}")
        out.append(tuple(gpus))
    return out


def parse_sizes(args: argparse.Namespace) -> list[int]:
    """``--size`` or ``-b/-e/-f`` (nccl-tests style), as byte counts."""
    sweep = any(v is not None for v in (args.minbytes, args.maxbytes, args.stepfactor))
    if args.size is not None and sweep:
        raise ConfigError("--size: give either --size or -b/-e/-f, not both")
    if not sweep:
        size = parse_size(args.size if args.size is not None else "1G", "--size")
        if size < 1:
            raise ConfigError(f"--size: must be at least 1 byte, got {args.size!r}")
        return [size]
    if args.minbytes is None or args.maxbytes is None:
        raise ConfigError("-b/-e: a size sweep needs both -b MIN and -e MAX")
    lo = parse_size(args.minbytes, "-b")
    hi = parse_size(args.maxbytes, "-e")
    if lo < 1:
        raise ConfigError(f"-b: must be at least 1 byte, got {args.minbytes!r}")
    if hi < lo:
        raise ConfigError(f"-e: {args.maxbytes!r} is below -b {args.minbytes!r}")
    factor_text = args.stepfactor if args.stepfactor is not None else "2"
    factor = parse_number(factor_text, "-f", int, "an integer factor >= 2", lambda v: v >= 2)
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def _fmt_time(t: float) -> str:
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def format_table(rows) -> str:
    """The human-readable table of ``blink simulate``."""
    head = f"{'gpus':<18} {'collective':<10} {'size':>6} {'blink':>11} {'nccl':>11} {'speedup':>8} {'trees':>5} {'vs bound':>8}  nccl"
    lines = [head, "-" * len(head)]
    for r in rows:
        over = f"{(r.blink_s / r.bound_s - 1) * 100:+.1f}%" if r.bound_s > 0 else "-"
        nccl = f"{r.nccl_algorithm}/{r.nccl_protocol} {r.nccl_rings}x{r.nccl_channel}"
        lines.append(
            f"{','.join(map(str, r.gpus)):<18} {r.collective:<10} {format_size(r.size_bytes):>6} {_fmt_time(r.blink_s):>11} "
            f"{_fmt_time(r.nccl_s):>11} {r.speedup:>7.2f}x {r.trees:>5} {over:>8}  {nccl}"
        )
    return "\n".join(lines) + "\n"


def _check_writable(path: str | None, flag: str) -> None:
    if path in (None, "-"):
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"{flag}: cannot write {path!r}: no such folder {str(folder)!r}")


def run(args: argparse.Namespace) -> int:
    topo = load_topology(args.topology)
    allocations = parse_allocations(args.allocations, topo)
    sizes = parse_sizes(args)
    channels = parse_channels(args.channels)
    if channels is not None and "pcie" in channels and topo.pcie is None and not topo.has_kind("pcie"):
        raise ConfigError(f"--channels: topology {topo.name!r} has no pcie channel, got {args.channels!r}")
    chunk: int | str | None = None
    if args.chunk is not None and args.chunk.strip().lower() == "miad":
        chunk = "miad"
    elif args.chunk is not None:
        chunk = parse_size(args.chunk, "--chunk")
        if chunk < 4:
            raise ConfigError(f"--chunk: must be at least 4 bytes (one element), got {args.chunk!r}")
    if args.jobs < 1:
        raise ConfigError(f"--jobs: expected a positive integer, got {args.jobs}")
    if allocations is None and topo.n < 2:
        raise ConfigError(f"--topology: {topo.name!r} has {topo.n} GPU; a collective needs at least 2")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot: expected a .png file name, got {args.plot!r}")
    _check_writable(args.json, "--json")
    _check_writable(args.plot, "--plot")
    collectives = ["allreduce", "broadcast"] if args.collective == "both" else [args.collective]

    from ..sim.sweep import sweep  # after the input checks: this imports the planner

    result = sweep(
        topo,
        allocations,
        collectives,
        sizes,
        channels=channels,
        chunk_bytes=chunk,
        progress=not args.no_progress,
        jobs=args.jobs,
        lanes=args.lanes,
    )
    table_out = sys.stderr if args.json == "-" else sys.stdout
    if result.rows:
        table_out.write(format_table(result.rows))
        best = max(result.rows, key=lambda r: r.speedup)
        for c in collectives:
            sel = [r for r in result.rows if r.collective == c]
            if sel:
                from ..sim.sweep import geomean

                table_out.write(
                    f"{c}: {len(sel)} rows, geomean speedup {geomean(r.speedup for r in sel):.2f}x, "
                    f"max {max(r.speedup for r in sel):.2f}x\n"
                )
        table_out.write(
            f"geomean speedup {result.geomean_speedup:.2f}x over {len(result.rows)} rows "
            f"(max {best.speedup:.2f}x on {','.join(map(str, best.gpus))} {best.collective})\n"
        )
    else:
        print("blink simulate: no allocation left to simulate", file=sys.stderr)
    if args.json is not None:
        write_output(json.dumps(result.to_dict(), indent=1) + "\n", args.json, "--json")
    if args.plot is not None and result.rows:
        from ..sim.plots import plot_rows

        plot_rows(result.rows, args.plot, title=f"{topo.name}: Blink vs NCCL (simulated)")
    return 0
