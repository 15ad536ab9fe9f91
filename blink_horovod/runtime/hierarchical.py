"""The hierarchical allreduce and broadcast of several servers, over any cross-server stage.

The one implementation of the three stages (docs/architecture.md): Blink
plans each server's own topology, so servers may differ, and leaves the
cross-server stage to Horovod's rings.

1. intra-server: every local rank's 1/n segment is reduced up Blink's trees
   (:meth:`Communicator.reduce_to_roots`), so local rank i holds its server's
   reduction of segment i, the same element range on every server;
2. cross-server: ``cross_allreduce(segment, op)`` combines segment i with
   local rank i of every other server (a Horovod process set in practice);
3. intra-server: the segments go down the trees
   (:meth:`Communicator.broadcast_from_roots`).

``average`` sums in all stages and divides once by the job's rank count.  A
broadcast from a root on server S runs the other way round: the root's local
rank broadcasts across servers first, then every server broadcasts from that
local rank.

The callables keep this module free of Horovod: the caller binds them to its
process sets (``blink_horovod.ops.hierarchical.Hierarchy`` for ``hvd``
calls, ``blink perf`` for the raw communicator).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .communicator import Communicator
from .dtypes import check_op, dtype_name, finish_average

__all__ = ["CrossAllreduce", "CrossBroadcast", "hierarchical_allreduce", "hierarchical_broadcast"]

CrossAllreduce = Callable[[np.ndarray, str], None]  # (segment, op) -> None, in place
CrossBroadcast = Callable[[np.ndarray], None]  # (whole array) -> None, in place, from the root's server


def hierarchical_allreduce(comm: Communicator, arr: np.ndarray, op: str, cross_allreduce: CrossAllreduce,
                           total_ranks: int, name: str | None = None) -> np.ndarray:
    """Allreduce ``arr`` over every rank of every server, in place; returns ``arr``.

    ``total_ranks`` is the job's rank count (for ``average``).
    """
    op = check_op(op)
    stage_op = "sum" if op == "average" else op
    flat = arr.reshape(-1)
    start, end = comm.reduce_to_roots(arr, stage_op, name=name)
    if end > start:
        cross_allreduce(flat[start:end], stage_op)
    comm.broadcast_from_roots(arr, name=name)
    if op == "average":
        finish_average(flat, total_ranks, dtype_name(arr.dtype))
    return arr


def hierarchical_broadcast(comm: Communicator, arr: np.ndarray, root_local: int,
                           cross_broadcast: CrossBroadcast, name: str | None = None) -> np.ndarray:
    """Broadcast from local rank ``root_local`` of the root's server to every rank, in place.

    ``cross_broadcast(arr)`` runs on local rank ``root_local`` of every server
    (the root's process set) and leaves the root's data there.
    """
    if comm.local_rank == root_local:
        cross_broadcast(arr)
    comm.broadcast(arr, root_local, name=name)
    return arr
