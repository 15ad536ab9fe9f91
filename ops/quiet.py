"""Horovod's own threads kept off the cores while a Blink collective runs.

Horovod's background thread (and, with the MPI controller, Open MPI's
progress loop inside it) keeps working while Blink's ranks move data on the
same cores.  Two remedies, each for the duration of one Blink collective
only, so that stock Horovod runs as before in between:

- :mod:`.mpi_yield` (``BLINK_MPI_YIELD``): Open MPI's idle polling yields;
- :mod:`.background` (``BLINK_BACKGROUND_IDLE``): the threads Horovod's
  ``init`` started run at ``SCHED_IDLE``.

:class:`Quiet` is the pair of switches; :class:`QuietCommunicator` wraps a
Blink communicator so that each of its collectives runs quieted.  The ops
layer applies it (:class:`.hierarchical.Hierarchy`); the runtime below it
knows nothing of Horovod.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .background import idled
from .mpi_yield import yielding

__all__ = ["COLLECTIVES", "Quiet", "QuietCommunicator"]

COLLECTIVES = frozenset({"allreduce", "broadcast", "reduce_to_roots", "broadcast_from_roots", "allgather_object",
                         "barrier"})


@dataclass(frozen=True)
class Quiet:
    """Which of the two remedies apply (both by default, as the variables' defaults)."""

    mpi_yield: bool = True
    background_idle: bool = True

    @classmethod
    def of(cls, config: Any) -> Quiet:
        """The switches of a :class:`~blink_horovod.config.Config` (defaults where it is None)."""
        if config is None:
            return cls()
        return cls(config.mpi_yield, config.background_idle)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Quiet for the duration of the block (nested and concurrent uses count)."""
        with yielding(self.mpi_yield), idled(self.background_idle):
            yield


class QuietCommunicator:
    """A Blink communicator whose collectives (:data:`COLLECTIVES`) each run under ``quiet``;
    its other attributes (``transport``, ``topology``, ``close``, ...) pass through."""

    def __init__(self, comm: Any, quiet: Quiet) -> None:
        self.comm = comm
        self.quiet = quiet
        self.local_rank: int = comm.local_rank

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.comm, name)
        if name not in COLLECTIVES:
            return attr

        def quieted(*args: Any, **kwargs: Any) -> Any:
            with self.quiet.held():
                return attr(*args, **kwargs)

        return quieted
