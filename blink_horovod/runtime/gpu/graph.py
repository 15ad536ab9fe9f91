"""Capture one rank's lowered commands into an executable CUDA graph.

Each :class:`~.lowering.Cmd` becomes one captured call on its stream
(:mod:`.lowering` explains the protocol): ``wait``/``write`` are
``cuStreamWaitValue32(AND)``/``cuStreamWriteValue32`` on flag words,
``copy`` a device-to-device ``cudaMemcpyAsync`` from the peer's IPC-mapped
buffer, ``reduce``/``stage_*`` the generated kernels (:mod:`.kernels`),
``record``/``join`` ``cudaEventRecord``/``cudaStreamWaitEvent`` (graph edges
under capture), ``reset`` a ``cudaMemsetAsync`` of the flag words.  The graph
first copies the launch's argument slot (the user tensor's address) from
pinned host memory into device memory, so the staging kernels read it at
run time and one graph serves any tensor.

Captured values are literals of the epoch *residue* (``epoch % 3``); the
executor keeps one graph per residue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BlinkInternalError
from .device import Cuda
from .kernels import BLOCK, grid_for, kernel_name
from .lowering import (
    COPY,
    JOIN,
    RECORD,
    REDUCE,
    RESET,
    STAGE_IN,
    STAGE_OUT,
    WAIT,
    WRITE,
    Lowered,
    accept_mask,
    epoch_value,
)

__all__ = ["Memory", "abandon_capture", "capture", "instantiate_capture"]


@dataclass(frozen=True)
class Memory:
    """Addresses one graph uses: every rank's flag words and data buffer (own and IPC-mapped),
    this rank's flag capacity, and the argument slot (pinned host and device) of the residue."""

    flags: Sequence[int]  # per rank: address of word 0
    data: Sequence[int]  # per rank: address of element 0
    flag_words: int  # own flag capacity (reset clears words 1..flag_words-1)
    args_host: int
    args_device: int


def capture(cuda: Cuda, lw: Lowered, mem: Memory, residue: int, dtype: str, itemsize: int, op: str,
            kernels: Any, streams: Sequence[Any], events: Sequence[int]) -> int:
    """Capture ``lw`` for epochs ``= residue (mod 3)``; returns the instantiated graph exec.

    ``kernels`` is the dtype's RawModule, ``streams`` CuPy streams (at least
    ``lw.nstreams``), ``events`` capture-only events (at least ``lw.nevents``).
    """
    if len(streams) < lw.nstreams or len(events) < lw.nevents:
        raise BlinkInternalError(f"capture: {len(streams)} streams/{len(events)} events for {lw.nstreams}/{lw.nevents}")
    r = lw.rank
    e = residue + 3  # any epoch of the residue; +3 keeps e-1 non-negative
    value = epoch_value(e)
    reduce_fn = kernels.get_function(kernel_name("reduce", dtype, op))
    stage_in_fn = kernels.get_function(kernel_name("stage_in", dtype))
    stage_out_fn = kernels.get_function(kernel_name("stage_out", dtype))
    average_n = np.int32(lw.nranks if op == "average" else 0)
    u64, i64 = np.uint64, np.int64
    own_flags, own_data = mem.flags[r], mem.data[r]
    origin = streams[0].ptr
    cuda.begin_capture(origin)
    try:
        cuda.copy_async(mem.args_device, mem.args_host, 8, origin, kind="h2d")
        for c in lw.cmds:
            st = streams[c.stream]
            sp = st.ptr
            k = c.kind
            if k == WAIT:
                cuda.wait_value_and(sp, mem.flags[c.peer] + 4 * c.word, accept_mask(e, c.accept))
            elif k == WRITE:
                cuda.write_value(sp, own_flags + 4 * c.word, value)
            elif k == RESET:
                if mem.flag_words > 1:
                    cuda.memset_async(own_flags + 4, 0, 4 * (mem.flag_words - 1), sp)
            elif k == COPY:
                off = c.offset * itemsize
                cuda.copy_async(own_data + off, mem.data[c.peer] + off, c.count * itemsize, sp)
            elif k == REDUCE:
                off = c.offset * itemsize
                with st:
                    reduce_fn((grid_for(c.count),), (BLOCK,),
                              (u64(own_data + off), u64(own_data + off), u64(mem.data[c.peer] + off), i64(c.count)))
            elif k == STAGE_IN:
                with st:
                    stage_in_fn((grid_for(c.count),), (BLOCK,),
                                (u64(mem.args_device), i64(c.user_offset), u64(own_data + c.offset * itemsize),
                                 i64(c.count)))
            elif k == STAGE_OUT:
                with st:
                    stage_out_fn((grid_for(c.count),), (BLOCK,),
                                 (u64(mem.args_device), i64(c.user_offset), u64(own_data + c.offset * itemsize),
                                  i64(c.count), average_n))
            elif k == RECORD:
                cuda.record(events[c.event], sp)
            elif k == JOIN:
                cuda.join(sp, events[c.event])
            else:  # pragma: no cover - lowering only makes the kinds above
                raise BlinkInternalError(f"capture: unknown command {c}")
    except BaseException:
        abandon_capture(cuda, origin)
        raise
    return instantiate_capture(cuda, origin)


def abandon_capture(cuda: Cuda, stream: int) -> None:
    """End a capture that failed: a stream left capturing poisons all later work on it."""
    try:
        cuda.destroy_graph(cuda.end_capture(stream))
    except Exception:  # noqa: BLE001, S110 - the first error is the one to report
        pass


def instantiate_capture(cuda: Cuda, stream: int) -> int:
    """End the capture on ``stream``; the instantiated, uploaded graph exec (the graph itself freed)."""
    graph = cuda.end_capture(stream)
    try:
        exe = cuda.instantiate(graph)
    finally:
        cuda.destroy_graph(graph)
    cuda.upload(exe, stream)
    return exe
