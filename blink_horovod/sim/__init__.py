"""Sim layer: a chunk-level simulator of programs on topologies, the NCCL baseline, the paper's figures.

- :mod:`.engine` -- discrete-event, flow-level (fluid) simulation of task graphs over shared links;
- :mod:`.execute` -- a compiled :class:`~blink_horovod.schedule.program.Program` as such a task graph;
- :mod:`.params` -- every fixed cost the simulator adds, with its source;
- :mod:`.resources` -- which link directions, switch ports and PCIe lanes a transfer loads;
- :mod:`.nccl` -- NCCL's ring search and cost model (the baseline);
- :mod:`.blink` -- plan, choose a chunk, compile, simulate;
- :mod:`.sweep` -- Blink vs NCCL over allocations and sizes (``blink simulate``);
- :mod:`.multiserver` -- the hierarchical multi-server allreduce;
- :mod:`.paper` -- ``make paper``: docs/paper/ (markdown + PNG).

Never imports the runtime (docs/architecture.md).
"""

from .engine import EngineResult, TaskGraph, run
from .execute import SimResult, simulate_program
from .nccl import NcclEstimate, RingSet, nccl_estimate, nccl_rings
from .params import DEFAULT_PARAMS, NcclParams, SimParams

__all__ = [
    "DEFAULT_PARAMS",
    "EngineResult",
    "NcclEstimate",
    "NcclParams",
    "RingSet",
    "SimParams",
    "SimResult",
    "TaskGraph",
    "nccl_estimate",
    "nccl_rings",
    "run",
    "simulate_program",
]
