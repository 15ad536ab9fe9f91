"""Per-rank programs: the contract between the schedule compiler, the symbolic
checker, the simulator and the runtimes.

The model is *pull over shared buffers*, which fits both runtimes: each rank
owns one buffer of ``count`` elements that every peer of the server can read
(POSIX shared memory on CPU, a CUDA IPC mapping on GPU), and a small array of
flags in the same shared memory.  A rank never writes a peer's memory except
by setting its *own* flags; it reads a peer's buffer only after waiting for the
peer's flag that says the region is ready.

Operations (:class:`Op`), executed by rank ``r`` on its own buffer ``B_r``:

``post``   set ``flags_r[flag] = epoch``: "every op I listed in ``after`` (and,
           for a sequential executor, every op before this one) is done".
``copy``   wait until ``flags_peer[flag] >= epoch``, then
           ``B_r[offset:offset+count] = B_peer[offset:offset+count]``.
``reduce`` wait as for ``copy``, then
           ``B_r[offset:offset+count] = op(B_r[...], B_peer[...])``.
``fanin``  a reduce from several peers in one op (one kernel that reads them
           all, as Blink's one-hop trees on an NVSwitch do): wait until
           ``flags_p[f] >= epoch`` for every ``(p, f)`` in ``peers``, then
           ``B_r[...] = op(B_r[...], B_p1[...], B_p2[...], ...)``; ``peer`` and
           ``flag`` repeat the first pair.  Compiled only on request
           (``compile_program(..., fanin=True)``); the runtimes do not execute
           it yet and refuse programs that contain it.

``epoch`` is the sequence number of the collective, the same on every rank, so
flags never need resetting.  ``step`` is the pipeline step of the op: every op
waits only for posts of strictly smaller steps, so executing each rank's ops in
list order (sorted by step) cannot deadlock, and an executor with several
lanes may run ops concurrently as long as it honours ``stream`` order and the
``after`` indices (ops of the same rank that must complete first: the writes a
post covers, or an earlier write to the same region).

Between collectives an executor must not overwrite its buffer with new input
while a peer may still read it: :meth:`Program.readers` says who reads whom,
and the executor waits for their "done" of the previous epoch first.

Two flags of every rank have fixed meanings in compiled programs
(:func:`blink_horovod.schedule.compile_program`):

``START_FLAG`` (0)  posted first, at step 0, by a rank whose *input* a peer reads
                    ("my input is in my buffer"); it replaces per-chunk posts of
                    leaves.  The executor places the input before running the ops.
``DONE_FLAG`` (1)   posted last by every rank that reads peers, after all its
                    reads (``after`` lists the last op of each other lane): the
                    "done" the next epoch waits for before overwriting a buffer
                    that rank reads.
Other flags (2, 3, ...) each mark one event (a chunk of a tree reduced, or
final) and are posted exactly once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DONE_FLAG", "PROGRAM_KINDS", "START_FLAG", "Op", "OpKind", "Program", "make_op"]

OpKind = Literal["post", "copy", "reduce", "fanin"]

# allreduce: reduce up then broadcast down, pipelined (single server).
# reduce:    up only; tree roots end with their share reduced (hierarchical stage 1).
# broadcast: down only, from each tree's root (broadcast plans, and hierarchical stage 3).
PROGRAM_KINDS = ("allreduce", "reduce", "broadcast")

# Flags with fixed meanings (module docstring).
START_FLAG = 0
DONE_FLAG = 1


@dataclass(frozen=True, slots=True)
class Op:
    """One step of one rank's program (see the module docstring)."""

    kind: OpKind
    peer: int = -1  # rank index (position in plan.gpus) read from; -1 for post
    flag: int = 0  # post: own flag set; copy/reduce: the peer's flag awaited
    offset: int = 0  # first element of the region (same on both sides)
    count: int = 0  # elements in the region
    tree: int = -1  # index into plan.trees (-1: not tree-specific, e.g. the start post)
    chunk: int = -1  # chunk index within the tree's share
    step: int = 0  # pipeline step: waits only for posts of smaller steps
    stream: int = 0  # lane on this rank (GPU stream); ops of one lane run in order
    channel: str = "nvlink"  # nvlink or pcie: which channel moves the bytes
    after: tuple[int, ...] = ()  # indices of this rank's ops that must finish first
    peers: tuple[tuple[int, int], ...] = ()  # fanin: every (peer, flag) read; empty for other kinds

    def sources(self) -> tuple[tuple[int, int], ...]:
        """The ``(peer, flag)`` pairs this op reads after waiting for (empty for a post)."""
        if self.kind == "post":
            return ()
        return self.peers if self.kind == "fanin" else ((self.peer, self.flag),)


_new_op = object.__new__
# Op's slot setters, in field order: the frozen dataclass's __init__ calls object.__setattr__ by name per field.
(_s_kind, _s_peer, _s_flag, _s_offset, _s_count, _s_tree, _s_chunk, _s_step, _s_stream, _s_channel, _s_after,
 _s_peers) = (getattr(Op, name).__set__ for name in Op.__dataclass_fields__)


def make_op(kind: OpKind, peer: int, flag: int, offset: int, count: int, tree: int, chunk: int, step: int,
            stream: int, channel: str, after: tuple[int, ...], peers: tuple[tuple[int, int], ...]) -> Op:
    """``Op(...)`` with every field given, in half the time: the compiler makes ~10^5 per program."""
    op = _new_op(Op)
    _s_kind(op, kind)
    _s_peer(op, peer)
    _s_flag(op, flag)
    _s_offset(op, offset)
    _s_count(op, count)
    _s_tree(op, tree)
    _s_chunk(op, chunk)
    _s_step(op, step)
    _s_stream(op, stream)
    _s_channel(op, channel)
    _s_after(op, after)
    _s_peers(op, peers)
    return op


@dataclass(frozen=True)
class Program:
    """A compiled collective for every rank of one server.

    ``ranks[r]`` lists rank r's ops in execution order; rank r is the r-th GPU
    of the plan (``plan.gpus[r]``).  ``segments[r]`` is the element range that
    rank r roots (allreduce/reduce plans: the i-th contiguous 1/n; broadcast:
    the whole buffer on the root), which the cross-server stage reduces.
    """

    kind: str
    nranks: int
    count: int  # elements per rank buffer
    chunk_elems: int
    ranks: tuple[tuple[Op, ...], ...]
    nflags: tuple[int, ...]  # flags each rank uses (indices 0 .. nflags-1)
    nstreams: tuple[int, ...]  # lanes each rank uses
    segments: tuple[tuple[int, int], ...] = ()
    root: int | None = None  # broadcast plans: rank index of the root
    meta: dict = field(default_factory=dict, compare=False)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """Every ``(rank, index, op)``."""
        for r, ops in enumerate(self.ranks):
            for i, op in enumerate(ops):
                yield r, i, op

    def readers(self) -> tuple[frozenset[int], ...]:
        """``readers()[r]``: the ranks that read rank r's buffer."""
        out: list[set[int]] = [set() for _ in range(self.nranks)]
        for r, _, op in self.ops():
            for q, _ in op.sources():
                out[q].add(r)
        return tuple(frozenset(s) for s in out)

    def num_ops(self) -> int:
        return sum(len(ops) for ops in self.ranks)
