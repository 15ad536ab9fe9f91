"""Which ranks form a server, and the cross-server process sets of the hierarchical stage.

Blink plans one server at a time (the paper, section 3: trees within a DGX-1,
rings or trees of servers above it).  The hierarchical allreduce of
docs/architecture.md needs, on every rank, the same answer to "which ranks
share my server, and which ranks hold the same local index on the others":
local rank ``i`` owns the ``i``-th 1/n of every buffer after the intra-server
reduce, and allreduces it with the local rank ``i`` of every other server.

Servers come from Horovod's local rank and size (hostnames), or from
``BLINK_LOCAL_SIZE`` where hostnames cannot tell (tests, containers,
``--mpi`` on one host): then server ``s`` is ranks ``s*L .. s*L+L-1``.
Horovod numbers ranks host by host (``horovodrun -H a:2,b:2``: 0,1 on a and
2,3 on b; Open MPI's default by-slot mapping does the same), which
:func:`verify_contiguous` checks once after ``hvd.init``.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence

from ..config import BLINK_LOCAL_SIZE, env_number
from ..errors import ConfigError

__all__ = ["Layout", "layout_from_env", "layout_from_horovod", "verify_contiguous"]


@dataclass(frozen=True)
class Layout:
    """The server structure of a job: ``num_servers`` servers of ``local_size`` ranks each.

    Ranks are numbered server by server: server ``s`` holds ranks
    ``s*local_size .. (s+1)*local_size - 1``.
    """

    rank: int
    size: int
    local_size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ConfigError(f"size: expected a positive number of ranks, got {self.size}")
        if self.local_size <= 0 or self.size % self.local_size:
            raise ConfigError(
                f"{BLINK_LOCAL_SIZE}: {self.local_size} ranks per server do not divide the job's "
                f"{self.size} ranks"
            )
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank: expected 0..{self.size - 1}, got {self.rank}")

    @property
    def num_servers(self) -> int:
        return self.size // self.local_size

    @property
    def server(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def multi_server(self) -> bool:
        return self.num_servers > 1

    def locate(self, rank: int) -> tuple[int, int]:
        """``(server, local_rank)`` of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank: expected 0..{self.size - 1}, got {rank}")
        return divmod(rank, self.local_size)

    def server_ranks(self, server: int | None = None) -> list[int]:
        """The global ranks of ``server`` (default: this rank's)."""
        s = self.server if server is None else server
        return list(range(s * self.local_size, (s + 1) * self.local_size))

    def cross_ranks(self, local_rank: int | None = None) -> list[int]:
        """The ranks holding local index ``local_rank`` (default: this rank's) on every server."""
        i = self.local_rank if local_rank is None else local_rank
        return [s * self.local_size + i for s in range(self.num_servers)]

    def all_cross_sets(self) -> list[list[int]]:
        """One rank list per local index: the process sets of the cross-server stage."""
        return [self.cross_ranks(i) for i in range(self.local_size)]

    def covers_whole_servers(self, ranks: Sequence[int]) -> list[int] | None:
        """The servers ``ranks`` consists of, if it is exactly a union of whole servers; else None."""
        rs = sorted(set(int(r) for r in ranks))
        if not rs or len(rs) % self.local_size:
            return None
        servers = sorted({r // self.local_size for r in rs})
        if sorted(r for s in servers for r in self.server_ranks(s)) != rs:
            return None
        return servers


def _int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` set in ``env``, as an integer."""
    name = next((n for n in names if env.get(n, "").strip()), None)
    return None if name is None else env_number(env, name, int, "an integer", lambda v: True)


def _blink_local_size(env: Mapping[str, str]) -> int | None:
    return env_number(env, BLINK_LOCAL_SIZE, int, "a positive integer", lambda v: v > 0)


def layout_from_env(env: Mapping[str, str]) -> Layout | None:
    """The layout as the launcher's variables tell it *before* ``hvd.init`` (None if they don't).

    Reads ``BLINK_LOCAL_SIZE``, then horovodrun's Gloo variables
    (``HOROVOD_RANK``/``SIZE``/``LOCAL_SIZE``), then Open MPI's and PMI's.
    Used to create the cross-server process sets statically in ``hvd.init``.
    """
    rank = _int(env, "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    size = _int(env, "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    local = _blink_local_size(env)
    if local is None:
        local = _int(env, "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if rank is None or size is None or local is None:
        return None
    return Layout(rank=rank, size=size, local_size=local)


def layout_from_horovod(rank: int, size: int, local_size: int, homogeneous: bool,
                        env: Mapping[str, str]) -> Layout | None:
    """The layout after ``hvd.init``; None when servers differ in size (Blink then stays out).

    ``BLINK_LOCAL_SIZE`` wins over Horovod's ``local_size``.
    """
    local = _blink_local_size(env)
    if local is None:
        if not homogeneous:
            return None
        local = local_size
    return Layout(rank=rank, size=size, local_size=local)


def verify_contiguous(layout: Layout, gathered: Sequence[Sequence[int]]) -> bool:
    """Check Horovod's numbering: ``gathered[r] == (local_rank, cross_rank)`` of rank ``r``."""
    for r, (local, cross) in enumerate(gathered):
        if (cross, local) != layout.locate(r):
            return False
    return True
