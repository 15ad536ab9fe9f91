"""``blink plan``: a ``blink-plan/1`` plan for a topology (docs/formats.md, Commands).

::

    blink plan --topology NAME|FILE [--gpus 0,1,2] --collective broadcast|allreduce
               [--root R] [--channels nvlink|nvlink,pcie] [--output FILE]

The plan comes from :func:`blink_horovod.planner.cache.get_plan` (so from
``BLINK_PLAN_CACHE`` when it was made before); the JSON goes to stdout or
``--output``, one summary line to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from .common import load_topology, write_output

__all__ = ["parse_channels", "register", "run"]

COLLECTIVES = ("broadcast", "allreduce")
CHANNEL_NAMES = ("nvlink", "pcie")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan spanning-tree collectives for a topology (blink-plan/1 JSON)",
        description="Plan Blink's weighted spanning trees for one collective on a topology or an allocation of one.",
    )
    p.add_argument("--topology", required=True, metavar="NAME|FILE",
                   help="built-in machine (dgx1p, dgx1v, dgx2, hgx-h100, hgx-h200, pcie, ...), NAME:0,1,4,5, "
                        "'local' (probe this machine) or a blink-topology/1 file")
    p.add_argument("--gpus", metavar="0,1,2", help="the allocation: GPU ids of the machine")
    p.add_argument("--collective", required=True, choices=COLLECTIVES)
    p.add_argument("--root", type=int, metavar="R", help="broadcast root, a GPU id of the allocation (default: the first)")
    p.add_argument("--channels", metavar="nvlink|nvlink,pcie",
                   help="channels to plan on (default: every channel the topology has); 'nvlink' turns the hybrid PCIe share off")
    p.add_argument("--output", metavar="FILE", help="write the plan here (atomically) instead of stdout")
    p.set_defaults(func=run)


def parse_channels(text: str | None) -> list[str] | None:
    """``"nvlink,pcie"`` -> ``["nvlink", "pcie"]``; None stays None; junk raises naming ``--channels``."""
    if text is None:
        return None
    parts = [c.strip() for c in text.split(",")]
    if not text.strip() or any(c not in CHANNEL_NAMES for c in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"--channels: expected nvlink or nvlink,pcie, got {text!r}")
    return sorted(parts, key=CHANNEL_NAMES.index)


def run(args: argparse.Namespace) -> int:
    topo = load_topology(args.topology, args.gpus)
    channels = parse_channels(args.channels)
    if channels is not None and "pcie" in channels and topo.pcie is None and not topo.has_kind("pcie"):
        raise ConfigError(f"--channels: topology {topo.name!r} has no pcie channel, got {args.channels!r}")
    root = args.root
    if args.collective == "allreduce":
        if root is not None:
            raise ConfigError(f"--root: an allreduce has no root (every GPU roots 1/n of the bytes), got {root}")
    else:
        if root is None:
            root = topo.gpus[0]
        elif root not in topo.gpus:
            raise ConfigError(f"--root: GPU {root} is not in the allocation {list(topo.gpus)}")

    if args.output not in (None, "-"):
        # Fail before planning, not after, when the plan could not be written.
        folder = Path(args.output).parent
        if not folder.is_dir():
            raise ConfigError(f"--output: cannot write {args.output!r}: no such folder {str(folder)!r}")

    # Imported after the input checks; only a cache miss imports the solvers.
    from ..planner.cache import get_plan

    result = get_plan(topo, args.collective, root, channels)
    plan = result.plan
    write_output(plan.to_json() + "\n", args.output)
    where = f" from GPU {plan.root}" if plan.root is not None else ""
    print(
        f"blink plan: {plan.topology} {plan.collective}{where}: {len(plan.trees)} trees, "
        f"{plan.rate_gbps:.2f} GB/s (optimum {plan.optimum_gbps:.2f} GB/s)"
        f"{', from the plan cache' if result.hit else ''}",
        file=sys.stderr,
    )
    return 0
