"""Gradient fusion: fixed buckets in one order on every rank, and the flat buffers they fill.

Horovod's tensor fusion packs the tensors that are ready in a cycle into one
buffer of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (default 128 MiB,
``horovod/common/operations.cc``); which tensors go together depends on
timing, which is fine there because Horovod negotiates by name.  Blink runs
collectives in submission order, so it fuses the way PyTorch DDP does
(``torch/csrc/distributed/c10d/reducer.cpp``): parameters are cut into
*fixed* buckets once, in reverse registration order (roughly the order
backward produces gradients), and a bucket is launched when all its
gradients are ready *and* every earlier bucket has been launched.  The
launch order is therefore the same on every rank, while backward still runs
for the later layers -- communication overlaps computation.

:class:`FlatBuffer` copies a list of arrays of one dtype into one contiguous
buffer and back (Horovod's ``MemcpyInFusionBuffer`` / ``MemcpyOutFusionBuffer``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..config import env_number

__all__ = [
    "DEFAULT_FUSION_THRESHOLD",
    "BucketTracker",
    "FlatBuffer",
    "fusion_threshold",
    "group_by_dtype",
    "plan_buckets",
]

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024


def fusion_threshold(env: Mapping[str, str] | None = None) -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes (0 disables fusion), default 128 MiB as Horovod's."""
    return env_number(os.environ if env is None else env, "HOROVOD_FUSION_THRESHOLD", int,
                      "bytes (an integer >= 0)", lambda v: v >= 0, DEFAULT_FUSION_THRESHOLD)


def plan_buckets(nbytes: Sequence[int], threshold: int) -> list[list[int]]:
    """Cut slots ``0..n-1`` (in the given order) into consecutive buckets of at most ``threshold`` bytes.

    A slot larger than the threshold gets a bucket of its own; ``threshold == 0``
    puts every slot alone (fusion off).

    >>> plan_buckets([4, 4, 4, 10, 1], 8)
    [[0, 1], [2], [3], [4]]
    """
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, b in enumerate(nbytes):
        if cur and (threshold == 0 or cur_bytes + b > threshold):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += int(b)
    if cur:
        buckets.append(cur)
    return buckets


class BucketTracker:
    """Which buckets may launch now: all slots ready, and all earlier buckets launched.

    >>> t = BucketTracker([[0, 1], [2]])
    >>> t.ready(2), t.ready(0), t.ready(1)
    ([], [], [0, 1])
    >>> t.pending()
    []
    """

    def __init__(self, buckets: Sequence[Sequence[int]]) -> None:
        self.buckets = [list(b) for b in buckets]
        self._bucket_of = {s: i for i, b in enumerate(self.buckets) for s in b}
        self.reset()

    def reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._ready: set[int] = set()
        self._next = 0

    def bucket_of(self, slot: int) -> int:
        return self._bucket_of[slot]

    def is_ready(self, slot: int) -> bool:
        return slot in self._ready

    def ready(self, slot: int) -> list[int]:
        """Mark ``slot`` ready; return the buckets that may launch now, in order."""
        if slot in self._ready:
            return []
        self._ready.add(slot)
        self._missing[self._bucket_of[slot]] -= 1
        out = []
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            out.append(self._next)
            self._next += 1
        return out

    def pending(self) -> list[int]:
        """Buckets not launched yet (``synchronize`` launches them, in order)."""
        out = list(range(self._next, len(self.buckets)))
        self._next = len(self.buckets)
        return out

    def launched_all(self) -> bool:
        return self._next == len(self.buckets)


def group_by_dtype(arrays: Sequence[np.ndarray]) -> list[tuple[np.dtype, list[int]]]:
    """Indices of ``arrays`` grouped by dtype, groups in order of first appearance."""
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    return list(groups.items())


class FlatBuffer:
    """One contiguous 1-D buffer holding several same-dtype arrays back to back.

    With a single contiguous array the buffer *is* that array (a flat view, no copy).
    """

    def __init__(self, arrays: Sequence[np.ndarray], copy_in: bool = True) -> None:
        if not arrays:
            raise ValueError("FlatBuffer: expected at least one array")
        dt = arrays[0].dtype
        for a in arrays:
            if a.dtype != dt:
                raise ValueError(f"FlatBuffer: mixed dtypes {dt} and {a.dtype}")
        self.arrays = list(arrays)
        self.sizes = [int(a.size) for a in arrays]
        self.view = len(arrays) == 1 and arrays[0].flags.c_contiguous
        if self.view:
            self.flat = arrays[0].reshape(-1)
        else:
            self.flat = np.empty(sum(self.sizes), dtype=dt)
            if copy_in:
                self.copy_in()

    def copy_in(self) -> None:
        if self.view:
            return
        off = 0
        for a, n in zip(self.arrays, self.sizes):
            self.flat[off:off + n] = a.reshape(-1)
            off += n

    def copy_out(self) -> None:
        if self.view:
            return
        off = 0
        for a, n in zip(self.arrays, self.sizes):
            a[...] = self.flat[off:off + n].reshape(a.shape)
            off += n
