"""Which shared resources a transfer between two GPUs loads, and their capacities.

The machine model of docs/formats.md, Topology file, made into the
capacitated resources of a fluid (flow-level) simulation:

- a direct NVLink bundle ``u - v`` is two resources, ``u -> v`` and
  ``v -> u``, each of the bundle's ``bandwidth_gbps`` (full duplex; repeated
  pairs add up);
- a GPU pair without a direct link that shares a switch is routed through it:
  ``u -> switch`` and ``switch -> v`` (docs/formats.md, Plan file);
- the PCIe channel (``topology.pcie``): every GPU has an uplink and a downlink
  of ``pcie.bandwidth_gbps``; GPUs of one switch group talk through their PCIe
  switch, others also load their groups' uplinks to the host (one x16 each,
  shared by the group's GPUs), which is how a DGX-1's PLX switches hang off
  the CPUs.  The CPU-to-CPU link (QPI) is not modelled;
- a GPU's reductions: ``hbm_gbps / 2`` (params.py).

Capacities are in bytes per second.
"""

from __future__ import annotations

from ..errors import ScheduleError
from ..topology.model import Topology
from .params import SimParams

__all__ = ["ResourceMap"]

GB = 1e9


class ResourceMap:
    """Resources of one topology: ``route(src, dst, channel)`` -> resource ids.

    Resource ids are small integers indexing :attr:`capacity` (bytes/s) and
    :attr:`names` (for reports).  Routes are cached.
    """

    def __init__(self, topology: Topology, params: SimParams) -> None:
        self.topology = topology
        self.params = params
        self.names: list[str] = []
        self.capacity: list[float] = []
        self._ids: dict[tuple, int] = {}
        self._routes: dict[tuple[int, int, str], tuple[int, ...]] = {}
        # Direct NVLink bundles (one direction each) and GPU-switch ports.
        self._direct: dict[tuple[int, int], float] = {}
        self._ports: dict[int, dict[str, float]] = {}
        for (a, b), cap in topology.capacities("nvlink").items():
            if isinstance(a, int) and isinstance(b, int):
                self._direct[(a, b)] = self._direct[(b, a)] = cap
            else:
                g, s = (a, b) if isinstance(a, int) else (b, a)
                self._ports.setdefault(g, {})[s] = cap  # type: ignore[index]
        pcie = topology.pcie
        self.pcie_gbps = pcie.bandwidth_gbps if pcie is not None else params.default_pcie_gbps
        self._group = {}
        if pcie is not None:
            for i, grp in enumerate(pcie.switch_groups):
                for g in grp:
                    self._group[g] = i

    def _rid(self, key: tuple, name: str, gbps: float) -> int:
        rid = self._ids.get(key)
        if rid is None:
            rid = len(self.capacity)
            self._ids[key] = rid
            self.names.append(name)
            self.capacity.append(gbps * GB)
        return rid

    def reducer(self, gpu: int) -> int:
        """The reduction resource of ``gpu``."""
        return self._rid(("reduce", gpu), f"reduce@{gpu}", self.params.reduce_gbps)

    def nvlink_connected(self, u: int, v: int) -> bool:
        """Whether NVLink joins ``u`` and ``v`` directly or through a shared switch."""
        if (u, v) in self._direct:
            return True
        return bool(set(self._ports.get(u, ())) & set(self._ports.get(v, ())))

    def route(self, src: int, dst: int, channel: str = "nvlink") -> tuple[int, ...]:
        """Resources loaded by bytes moving from GPU ``src`` to GPU ``dst``.

        Raises
        ------
        ScheduleError
            when ``channel`` is nvlink and no direct link or shared switch joins them.
        """
        key = (src, dst, channel)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        if src == dst:
            raise ScheduleError(f"transfer from GPU {src} to itself")
        if channel == "nvlink":
            if (src, dst) in self._direct:
                out = (self._rid(("nv", src, dst), f"nvlink {src}->{dst}", self._direct[(src, dst)]),)
            else:
                shared = sorted(set(self._ports.get(src, ())) & set(self._ports.get(dst, ())))
                if not shared:
                    raise ScheduleError(
                        f"no NVLink between GPU {src} and GPU {dst} on {self.topology.name!r} (no direct link, no shared switch)"
                    )
                s = shared[0]
                out = (
                    self._rid(("up", src, s), f"nvlink {src}->{s}", self._ports[src][s]),
                    self._rid(("down", s, dst), f"nvlink {s}->{dst}", self._ports[dst][s]),
                )
        elif channel == "pcie":
            bw = self.pcie_gbps
            res = [self._rid(("pcie_up", src), f"pcie {src}->sw", bw)]
            gs, gd = self._group.get(src), self._group.get(dst)
            if gs is None or gd is None or gs != gd:
                # Across switch groups (or ungrouped GPUs): through the host.
                ks = ("g", gs) if gs is not None else ("gpu", src)
                kd = ("g", gd) if gd is not None else ("gpu", dst)
                res.append(self._rid(("host_up",) + ks, f"pcie group {ks[1]}->host", bw))
                res.append(self._rid(("host_down",) + kd, f"pcie host->group {kd[1]}", bw))
            res.append(self._rid(("pcie_down", dst), f"pcie sw->{dst}", bw))
            out = tuple(res)
        else:
            raise ScheduleError(f"channel: expected nvlink or pcie, got {channel!r}")
        self._routes[key] = out
        return out
