"""User tensors registered for peer access: one CUDA IPC handle per allocation, cached by base address.

The tree kernel reads and writes the caller's tensor in place and the peers' tensors through their
IPC mappings, so no staging pass copies data in or out (as vLLM's custom allreduce registers the
buffers of its CUDA graphs, and as PyTorch's SymmetricMemory allocates shared buffers).  A tensor of a
caching allocator (PyTorch, CuPy) lies inside a larger ``cudaMalloc`` block; the block's base and size
come from ``cuMemGetAddressRange``, its identity from ``CU_POINTER_ATTRIBUTE_BUFFER_ID`` (unique per
allocation, so a block freed and reallocated at the same address is a new registration), and its
``cudaIpcGetMemHandle`` is taken once.

What travels to the peers with each collective's metadata is ``(serial, offset)``, plus the handle the
first time a serial is used; a peer opens each (rank, serial) once (``cudaIpcOpenMemHandle`` maps a
given allocation only once per process) and keeps the mapping.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

from ...errors import BlinkInternalError

__all__ = ["Registry"]


class Registry:
    """This rank's registered allocations and its mappings of the peers' ones.

    ``cuda`` provides ``address_range(ptr) -> (base, size)``, ``buffer_id(ptr)``,
    ``ipc_handle(base)``, ``ipc_open(handle)`` and ``ipc_close(ptr)``.
    """

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self._bases: list[int] = []  # sorted bases of known allocations
        self._own: dict[int, tuple[int, int, int, bytes]] = {}  # base -> (end, buffer id, serial, handle)
        self._serial = 0
        self._peers: dict[tuple[int, int], int] = {}  # (rank, serial) -> mapped base

    def own(self, ptr: int) -> tuple[int, int, bytes | None]:
        """``(serial, offset, handle)`` of the tensor at ``ptr``; ``handle`` only on a new registration."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base = self._bases[i]
            end, bid, serial, _ = self._own[base]
            if ptr < end and self.cuda.buffer_id(ptr) == bid:
                return serial, ptr - base, None
        base, size = self.cuda.address_range(ptr)
        bid = self.cuda.buffer_id(ptr)
        handle = self.cuda.ipc_handle(base)
        self._serial += 1
        if base not in self._own:
            bisect.insort(self._bases, base)
        self._own[base] = (base + size, bid, self._serial, handle)
        return self._serial, ptr - base, handle

    def peer(self, rank: int, serial: int, offset: int, handle: bytes | None) -> int:
        """Rank ``rank``'s tensor ``(serial, offset)`` in this process's address space."""
        base = self._peers.get((rank, serial))
        if base is None:
            if handle is None:
                raise BlinkInternalError(f"rank {rank}'s registered buffer {serial} arrived without its IPC handle")
            base = self._peers[(rank, serial)] = self.cuda.ipc_open(handle)
        return base + offset

    def close(self) -> None:
        """Unmap every peer allocation (the own ones belong to their allocators)."""
        for base in self._peers.values():
            with contextlib.suppress(Exception):  # closing at exit: nothing left to protect
                self.cuda.ipc_close(base)
        self._peers.clear()
