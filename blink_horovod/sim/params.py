"""Every cost the simulator adds to the links' bandwidth, in one dataclass, with its source.

Links move bytes at the topology's ``bandwidth_gbps`` (docs/formats.md,
section 3: "what the simulator adds is per-chunk costs, pipeline fill and drain,
and contention").  The costs below are what a Blink program pays on top of
that, and what the NCCL model pays on top of its rings.  Each field's comment
gives its source:

- Blink (Wang et al., MLSys 2020), section 1: PCIe 3.0 delivers 8-12 GB/s
  against 20-25 GB/s per NVLink; section 4: each chunk costs "at least three
  CUDA commands"; section 3.4: hybrid transfers pay a peer-access-disable
  latency; appendix A.1.2: reduction kernels cost 1-2 GB/s in fan-in tests.
- a probe on an H200: a captured CUDA graph of
  K chunk copies (or adds) on 8 streams replays with 4-6 us of host time for
  one node and 11-18 us for 16-256 nodes; 256 copies of 64 KB (32 in sequence
  per stream) took 59.6 us on the device, ~1.9 us per node in sequence (adds:
  62.8 us, ~2.0 us).
- a probe on the same H200: issuing one op from
  Python costs ~9 us of host time and a chunk step with a stream switch and an
  event ~30 us -- the costs the GPU runtime avoids by replaying whole graphs
  (docs/architecture.md), so they are *not* charged per chunk here.
- NCCL 2.x ``src/graph/tuning.cc`` (the latency table NCCL uses to choose its
  algorithm and protocol): base latencies and per-hop latencies per protocol,
  and the protocols' bandwidth factors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import ConfigError

__all__ = ["DEFAULT_PARAMS", "NcclParams", "SimParams"]


@dataclass(frozen=True)
class NcclParams:
    """NCCL's own cost model (NCCL 2.x ``tuning.cc``), latencies in microseconds.

    Indexed by protocol ``"LL"``, ``"LL128"``, ``"Simple"``.  NCCL picks, per
    collective and size, the algorithm/protocol with the least
    ``latency + bytes / algbw``; the model does the same.
    """

    # baseLat[Ring] and baseLat[Tree]: launch + set-up per collective (us).
    ring_base_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 3.6, "LL128": 10.0, "Simple": 8.4})
    tree_base_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 4.4, "LL128": 4.4, "Simple": 0.0})
    # hwLat[NVLINK] and hwLat[PCI]: per ring step / tree hop (us).
    ring_hop_nvlink_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 0.47, "LL128": 1.9, "Simple": 3.4})
    tree_hop_nvlink_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 0.52, "LL128": 1.25, "Simple": 28.0})
    ring_hop_pcie_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 1.0, "LL128": 2.5, "Simple": 5.7})
    tree_hop_pcie_us: Mapping[str, float] = field(default_factory=lambda: {"LL": 1.0, "LL128": 1.9, "Simple": 28.0})
    # Bandwidth refinements of tuning.cc: LL moves 8 data bytes per 16-byte
    # line and is thread-bound (ring: 1/4 of the link for allreduce, 1/3 for
    # broadcast, at most 39 GB/s on Volta); LL128 reaches 120/128 of the link,
    # capped per channel (GB/s: broadcast 18.8, allreduce 16.7 on Volta).
    ll_ring_factor_allreduce: float = 1.0 / 4.0
    ll_ring_factor_broadcast: float = 1.0 / 3.0
    ll_max_gbps: float = 39.0
    ll128_factor: float = 0.92
    ll128_max_per_channel_gbps: Mapping[str, float] = field(default_factory=lambda: {"broadcast": 18.8, "allreduce": 16.7})
    tree_factor: float = 0.92
    tree_max_per_channel_gbps: float = 26.5
    tree_ll_factor: float = 1.0 / 3.8
    tree_ll128_factor: float = 7.0 / 9.0
    # Ring chunking (Simple): a 4 MiB buffer per channel in NCCL_STEPS = 8 slots,
    # so a ring pipelines 512 KiB steps; the fill it pays is (hops - 1) steps.
    step_bytes: int = 512 * 1024
    max_channels: int = 16  # MAXCHANNELS of NCCL 2.4-2.11
    protocols: tuple[str, ...] = ("LL", "LL128", "Simple")

    def to_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class SimParams:
    """Costs the simulator charges on top of link bandwidth (module docstring for sources).

    Times are seconds, rates GB/s (10^9 bytes/s).
    """

    # Host cost of launching one collective: one CUDA-graph replay,
    # 11-18 us for 16-256 nodes (h200-cuda-graph-probe.json, replay_host_us).
    launch_s: float = 12e-6
    # Device cost of one chunk copy before its bytes flow: ~1.9 us per node in
    # sequence on one stream (h200-cuda-graph-probe.json: 256 x 64 KB copies on
    # 8 streams in 59.6 us); Blink section 4: "CUDA op overheads".
    copy_s: float = 2.0e-6
    # Extra fixed cost of a reduction over a copy: a kernel launch instead of a
    # copy node (probe: adds 2.0 us vs copies 1.9 us per node in sequence;
    # Blink A.1.2: reduction launches cost fan-in 1-2 GB/s).  Assumed 0.5 us.
    reduce_extra_s: float = 0.5e-6
    # A flag post (cuStreamWriteValue32 node); not probed in isolation,
    # assumed half a copy node.
    post_s: float = 1.0e-6
    # Reductions read the local and the peer's chunk and write the local one:
    # two bytes of HBM traffic per byte reduced, so a GPU reduces at most at
    # hbm_gbps / 2 (V100 HBM2: 900 GB/s; H200 HBM3e: 4800 GB/s).
    hbm_gbps: float = 900.0
    # Hybrid transfers (Blink 3.4): PCIe between GPUs that have NVLink needs
    # peer access disabled first; the paper measures this latency but does not
    # print it.  Assumed 50 us per GPU pair of the PCIe trees that NVLink also
    # joins (others use PCIe anyway), paid once per collective before any PCIe
    # byte moves, serialized on the host driver (so it grows with the GPU
    # count, as the paper reports).
    pcie_switch_s: float = 50e-6
    # Used for a topology without a ``pcie`` object (PCIe 3.0 x16, Blink 1).
    default_pcie_gbps: float = 12.0
    # Bytes per element when a size in bytes becomes a program's count (float32).
    itemsize: int = 4
    nccl: NcclParams = field(default_factory=NcclParams)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("nccl",):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"SimParams.{f.name}: expected a finite number >= 0, got {v!r}")
        if self.hbm_gbps <= 0 or self.default_pcie_gbps <= 0:
            raise ConfigError("SimParams: hbm_gbps and default_pcie_gbps must be > 0")
        if not isinstance(self.itemsize, int) or self.itemsize < 1:
            raise ConfigError(f"SimParams.itemsize: expected a positive integer, got {self.itemsize!r}")

    @property
    def reduce_gbps(self) -> float:
        """The GPU's reduction rate: HBM bandwidth over the two bytes it moves per byte."""
        return self.hbm_gbps / 2.0

    def with_(self, **changes: Any) -> SimParams:
        """A copy with ``changes`` applied (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "nccl"}
        out["nccl"] = self.nccl.to_dict()
        return out

    @classmethod
    def zero_cost(cls) -> SimParams:
        """No fixed costs at all: the pure bandwidth model (tests, bounds)."""
        return cls(launch_s=0.0, copy_s=0.0, reduce_extra_s=0.0, post_s=0.0, pcie_switch_s=0.0, hbm_gbps=1e12)


DEFAULT_PARAMS = SimParams()
