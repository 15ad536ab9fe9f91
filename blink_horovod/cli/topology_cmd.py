"""``blink topology``: a ``blink-topology/1`` JSON (docs/formats.md, Commands).

::

    blink topology NAME|local [--gpus ...] [--output FILE]
    blink topology --from-nvidia-smi FILE|- [--link-gbps G] [--pcie-gbps G] [--gpus ...] [--output FILE]

``local`` probes this machine through NVML (:mod:`blink_horovod.topology.probe`);
``--from-nvidia-smi`` reads a saved ``nvidia-smi topo -m`` output
(:mod:`blink_horovod.topology.nvsmi`).  ``--pcie-gbps`` (an optional addition
to the contract) sets the PCIe channel's bandwidth, which the matrix does not
show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from ..topology.nvsmi import DEFAULT_LINK_GBPS, DEFAULT_PCIE_GBPS, parse_topo_matrix
from .common import load_topology, positive_gbps, write_output

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "topology",
        help="print a topology (built-in, probed, or from nvidia-smi topo -m) as blink-topology/1 JSON",
        description="Print a machine's topology as blink-topology/1 JSON.",
    )
    p.add_argument("name", nargs="?", metavar="NAME|local",
                   help="built-in machine (dgx1v, NAME:0,1,4,5, ...), a topology file, or 'local' to probe this machine")
    p.add_argument("--gpus", metavar="0,1,2", help="the allocation: GPU ids of the machine")
    p.add_argument("--from-nvidia-smi", dest="nvsmi", metavar="FILE|-",
                   help="read a saved `nvidia-smi topo -m` output ('-' for stdin) instead")
    p.add_argument("--link-gbps", type=positive_gbps("--link-gbps"), metavar="G",
                   help=f"with --from-nvidia-smi: GB/s per NVLink per direction (default {DEFAULT_LINK_GBPS:g})")
    p.add_argument("--pcie-gbps", type=positive_gbps("--pcie-gbps"), metavar="G",
                   help=f"with --from-nvidia-smi: GB/s of the PCIe channel per GPU (default {DEFAULT_PCIE_GBPS:g})")
    p.add_argument("--output", metavar="FILE", help="write the topology here (atomically) instead of stdout")
    p.set_defaults(func=run)


def _read_text(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"--from-nvidia-smi: cannot read {source!r}: {reason}") from None


def run(args: argparse.Namespace) -> int:
    if args.nvsmi is not None:
        if args.name is not None:
            raise ConfigError(f"--from-nvidia-smi: give a machine NAME or --from-nvidia-smi, not both (got NAME {args.name!r})")
        text = _read_text(args.nvsmi)
        name = "nvidia-smi" if args.nvsmi == "-" else Path(args.nvsmi).stem
        topo = parse_topo_matrix(
            text,
            link_gbps=DEFAULT_LINK_GBPS if args.link_gbps is None else args.link_gbps,
            pcie_gbps=DEFAULT_PCIE_GBPS if args.pcie_gbps is None else args.pcie_gbps,
            name=name,
        )
        if args.gpus is not None:
            from ..topology import parse_gpu_list

            topo = topo.allocate(parse_gpu_list(args.gpus, "--gpus"))
    else:
        for flag, value in (("--link-gbps", args.link_gbps), ("--pcie-gbps", args.pcie_gbps)):
            if value is not None:
                raise ConfigError(f"{flag}: only applies with --from-nvidia-smi, got {value:g}")
        if args.name is None:
            raise ConfigError("topology: expected a machine NAME, 'local' or --from-nvidia-smi FILE")
        topo = load_topology(args.name, args.gpus, flag="topology")
    write_output(topo.to_json() + "\n", args.output)
    return 0
