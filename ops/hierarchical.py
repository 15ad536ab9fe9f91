"""The hierarchical allreduce and broadcast: Blink's trees within a server, Horovod's rings across.

../shared/DESIGN.md, "The flow of one allreduce" (after Blink, section 3.3,
and Horovod's hierarchical allreduce, which does the same with NCCL
reduce-scatter / MPI allreduce / NCCL allgather):

1. intra-server: each local rank's 1/n of the buffer is reduced up its trees
   to it -- ``Communicator.reduce_to_roots`` returns that rank's segment;
2. cross-server: each local rank allreduces its segment with the same local
   rank of every other server, on a Horovod process set (Horovod's rings over
   Gloo, MPI or NCCL).  Every local rank carries 1/n of the cross-server bytes,
   so all of a server's NICs / GPUs work at once;
3. intra-server: the segments are broadcast down the trees
   (``Communicator.broadcast_from_roots``).

Single-server jobs skip stage 2 and run ``Communicator.allreduce``.

A broadcast from global rank ``R`` = (server ``S``, local rank ``l``): ``R``
broadcasts to local rank ``l`` of every other server (the same process sets),
then every server broadcasts from its local rank ``l`` down its own trees.

The segment of local rank ``i`` is a byte range fixed by the plan contract
(FORMATS.md: "the i-th GPU the i-th contiguous 1/n"), so servers with
different topologies -- and so different trees -- still meet in stage 2.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .layout import Layout

__all__ = ["CrossTransport", "IntraCommunicator", "Hierarchy"]


class IntraCommunicator(Protocol):
    """The part of ``blink_horovod.runtime.communicator.Communicator`` used here."""

    def allreduce(self, arr: np.ndarray, op: str = "sum") -> None: ...
    def broadcast(self, arr: np.ndarray, root: int) -> None: ...
    def reduce_to_roots(self, arr: np.ndarray, op: str) -> tuple[int, int]: ...
    def broadcast_from_roots(self, arr: np.ndarray) -> None: ...
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
    """

    def __init__(self, layout: Layout, intra: IntraCommunicator | None, cross: CrossTransport | None) -> None:
        self.layout = layout
        self.intra = intra
        self.cross = cross if layout.multi_server else None

    def allreduce(self, flat: np.ndarray, op: str, tag: str) -> None:
        """Reduce ``flat`` (1-D, contiguous) over every rank of the job, in place.

        ``op`` is ``sum``, ``min``, ``max`` or ``product``; averaging and
        scaling are the caller's (:mod:`.scaling`), so that they follow
        Horovod's arithmetic exactly.
        """
        if flat.size == 0:
            return
        if self.cross is None:
            if self.intra is not None:
                self.intra.allreduce(flat, op)
            return
        if self.intra is None:  # one rank per server: the cross stage is the whole allreduce
            self.cross.allreduce(flat, op, self.layout.cross_ranks(), f"{tag}.x")
            return
        start, end = self.intra.reduce_to_roots(flat, op)
        if end > start:
            self.cross.allreduce(flat[start:end], op, self.layout.cross_ranks(), f"{tag}.x")
        self.intra.broadcast_from_roots(flat)

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
        if flat.size == 0:
            return
        root_server, root_local = self.layout.locate(root)
        if self.cross is not None and self.layout.local_rank == root_local:
            self.cross.broadcast(flat, root, self.layout.cross_ranks(), f"{tag}.x")
        if self.intra is not None:
            self.intra.broadcast(flat, root_local)
