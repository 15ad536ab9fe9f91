"""The hierarchical allreduce and broadcast of a Horovod job: Blink's trees within a server, Horovod's rings across.

The three stages themselves are written once, in
:mod:`blink_horovod.runtime.hierarchical` (docs/architecture.md has the whole
flow); this module binds them to the job: which ranks form a server
(:mod:`.layout`), this server's communicator, and the cross-server stage on a
Horovod process set of the same local rank on every server (a
:class:`CrossTransport` a framework adapter provides).  Single-server jobs run
``Communicator.allreduce``; servers of one rank run the cross stage alone.

Each Blink collective it runs on the server's communicator runs quieted
(:mod:`.quiet`): Horovod's own threads keep off the cores meanwhile.

The segment of local rank ``i`` is a byte range fixed by the plan format
(docs/formats.md: the i-th GPU roots the i-th contiguous 1/n), so servers
with different topologies, and so different trees, still meet in stage 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..runtime.hierarchical import hierarchical_allreduce, hierarchical_broadcast
from .layout import Layout
from .quiet import Quiet, QuietCommunicator

__all__ = ["CrossTransport", "Hierarchy", "IntraCommunicator"]


class IntraCommunicator(Protocol):
    """The part of ``blink_horovod.runtime.communicator.Communicator`` used here."""

    local_rank: int

    def allreduce(self, arr: np.ndarray, op: str = "sum", name: str | None = None) -> np.ndarray: ...
    def broadcast(self, arr: np.ndarray, root: int = 0, name: str | None = None) -> np.ndarray: ...
    def reduce_to_roots(self, arr: np.ndarray, op: str = "sum", name: str | None = None) -> tuple[int, int]: ...
    def broadcast_from_roots(self, arr: np.ndarray, name: str | None = None) -> np.ndarray: ...
    def barrier(self) -> None: ...


class CrossTransport(Protocol):
    """Horovod collectives on a process set of ranks, on numpy arrays in place (framework adapters)."""

    def allreduce(self, arr: np.ndarray, op: str, ranks: Sequence[int], name: str) -> None: ...
    def broadcast(self, arr: np.ndarray, root: int, ranks: Sequence[int], name: str) -> None: ...
    def allgather_rows(self, row: np.ndarray, ranks: Sequence[int], name: str) -> np.ndarray: ...


class Hierarchy:
    """Runs allreduce and broadcast over the job: ``intra`` within the server, ``cross`` across.

    Parameters
    ----------
    layout:
        The job's servers.
    intra:
        This server's Blink communicator (None when the server has one rank).
    cross:
        Horovod on the cross-server process sets (None for a single-server job).
    quiet:
        How Horovod's threads are kept quiet during ``intra``'s collectives
        (default: as ``intra.config`` says, ``BLINK_MPI_YIELD`` and
        ``BLINK_BACKGROUND_IDLE``).
    settle:
        Called before each cross-server stage: makes the intra stage's results
        visible to Horovod (CUDA tensors: waits for the launched kernels; on
        CPU the intra stage has finished when it returns, so None).

    The buffers are 1-D numpy arrays, or CUDA tensors when ``intra`` is a
    communicator on ``device="cuda"`` (:mod:`.torch_cuda`).
    """

    def __init__(self, layout: Layout, intra: IntraCommunicator | None, cross: CrossTransport | None,
                 quiet: Quiet | None = None, settle: Callable[[], None] | None = None) -> None:
        self.layout = layout
        self.settle = settle
        self.intra: IntraCommunicator | None = None
        if intra is not None:
            q = quiet if quiet is not None else Quiet.of(getattr(intra, "config", None))
            self.intra = QuietCommunicator(intra, q)  # type: ignore[assignment]
        self.cross = cross if layout.multi_server else None

    def allreduce(self, flat: np.ndarray, op: str, tag: str) -> None:
        """Reduce ``flat`` (1-D, contiguous) over every rank of the job, in place.

        ``op`` is ``sum``, ``min``, ``max`` or ``product``; averaging and
        scaling are the caller's (:mod:`.scaling`), so that they follow
        Horovod's arithmetic exactly.
        """
        if len(flat) == 0:
            return
        if self.cross is None:
            if self.intra is not None:
                self.intra.allreduce(flat, op)
            return
        cross, ranks, settle = self.cross, self.layout.cross_ranks(), self.settle

        def across(seg: Any, o: str) -> None:
            if settle is not None:
                settle()
            cross.allreduce(seg, o, ranks, f"{tag}.x")

        if self.intra is None:  # one rank per server: the cross stage is the whole allreduce
            across(flat, op)
            return
        hierarchical_allreduce(self.intra, flat, op, across, self.layout.size)

    def barrier(self, tag: str) -> None:
        """The data stage of ``hvd.barrier``: no rank leaves before every rank has finished the round.

        The engine's round that decides a barrier already tells every rank
        that every rank has arrived, but the last rank to arrive learns it at
        once while each peer learns it only when it is next scheduled.  This
        stage -- as Horovod runs its BarrierOp (a Gloo / MPI barrier) after
        the coordinator's response -- holds every rank until every rank has
        seen that round: the server's ranks meet in the shared metadata
        slots, then each local rank meets the same local rank of the other
        servers (so every rank of every server has met).  A peer that wakes
        late from the round now holds the others back, instead of them
        running ahead of it out of the barrier.
        """
        if self.intra is not None:
            self.intra.barrier()
        if self.cross is not None:
            self.cross.allgather_rows(np.zeros(1, np.int64), self.layout.cross_ranks(), f"{tag}.x")

    def broadcast(self, flat: np.ndarray, root: int, tag: str) -> None:
        """Broadcast ``flat`` from global rank ``root`` to every rank of the job, in place."""
        if len(flat) == 0:
            return
        _, root_local = self.layout.locate(root)
        cross, ranks, settle = self.cross, self.layout.cross_ranks(), self.settle

        def across(arr: Any) -> None:
            if cross is not None:
                if settle is not None:
                    settle()
                cross.broadcast(arr, root, ranks, f"{tag}.x")

        if self.intra is None:
            if self.layout.local_rank == root_local:
                across(flat)
            return
        hierarchical_broadcast(self.intra, flat, root_local, across)
