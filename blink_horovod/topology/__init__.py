"""Topology layer: the machine model, built-in machines, ``blink-topology/1`` I/O, probing.

Knows nothing of planning, runtimes or frameworks (docs/architecture.md).
"""

from .machines import MACHINES, machine, parse_gpu_list, resolve
from .model import FORMAT, Link, PCIeChannel, Topology

__all__ = ["FORMAT", "MACHINES", "Link", "PCIeChannel", "Topology", "machine", "parse_gpu_list", "resolve"]
