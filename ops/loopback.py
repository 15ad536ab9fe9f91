"""An in-process cross-server transport: threads standing for servers (tests and tools).

The runtime keeps a loopback transport so that every layer above it runs in
one process (a transport seam, as httpx's ``MockTransport``);
this is the same for the cross-server stage of :mod:`.hierarchical`:
:class:`LoopbackCrossWorld` holds the state of the "network", and each
thread's :class:`LoopbackCross` performs Horovod-like collectives on
numpy arrays with its peers, keyed by the collective's name (as Horovod keys
them), with a timeout on every wait.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ..errors import BlinkTimeoutError

__all__ = ["LoopbackCross", "LoopbackCrossWorld"]

_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


class LoopbackCrossWorld:
    """Shared state of the in-process "network" of ``size`` ranks."""

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[tuple[str, tuple[int, ...]], dict[int, np.ndarray]] = {}
        self._done: dict[tuple[str, tuple[int, ...]], int] = {}

    def transport(self, rank: int) -> LoopbackCross:
        return LoopbackCross(self, rank)

    def exchange(self, rank: int, name: str, ranks: Sequence[int], value: np.ndarray) -> list[np.ndarray]:
        """Every member's ``value`` for collective ``name``, in rank order."""
        key = (name, tuple(ranks))
        with self._cond:
            slot = self._slots.setdefault(key, {})
            if rank in slot:
                raise ValueError(f"loopback: rank {rank} submitted {name!r} twice")
            slot[rank] = np.array(value, copy=True)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self._slots[key]) == len(ranks), self.timeout):
                missing = sorted(set(ranks) - set(self._slots[key]))
                raise BlinkTimeoutError(f"loopback cross {name!r}: ranks {missing} did not arrive")
            out = [self._slots[key][r] for r in ranks]
            self._done[key] = self._done.get(key, 0) + 1
            if self._done[key] == len(ranks):
                del self._slots[key], self._done[key]
            return out


class LoopbackCross:
    """:class:`~.hierarchical.CrossTransport` of one thread of a :class:`LoopbackCrossWorld`."""

    def __init__(self, world: LoopbackCrossWorld, rank: int) -> None:
        self.world = world
        self.rank = rank

    def allreduce(self, arr: np.ndarray, op: str, ranks: Sequence[int], name: str) -> None:
        parts = self.world.exchange(self.rank, name, ranks, arr)
        acc = parts[0].copy()
        for p in parts[1:]:
            _UFUNC[op](acc, p, out=acc)
        arr[...] = acc

    def broadcast(self, arr: np.ndarray, root: int, ranks: Sequence[int], name: str) -> None:
        parts = self.world.exchange(self.rank, name, ranks, arr)
        arr[...] = parts[list(ranks).index(root)]

    def allgather_rows(self, row: np.ndarray, ranks: Sequence[int], name: str) -> np.ndarray:
        return np.stack(self.world.exchange(self.rank, name, ranks, row))
