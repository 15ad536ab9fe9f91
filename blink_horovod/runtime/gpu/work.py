"""A plan as the tree kernel's work: items (one tree's range of elements) and each rank's view of the trees.

Blink (MLSys 2020, section 4) splits each tree's share of the buffer into chunks and pipelines them
down and up the tree.  Here a chunk is an *item*; block ``b`` of every rank takes items ``b, b + B,
b + 2B, ...`` in order (``trees.cu``), so the same block index moves item ``i`` on every rank, and a
block waits only for flags posted by blocks of the same index.  Items of one tree are consecutive, so
a tree's chunks spread over consecutive blocks and move in parallel.

Tree ranges come from :func:`~blink_horovod.schedule.compile.tree_ranges`, the same split the CPU
runtime executes (an allreduce's local rank ``i`` roots exactly the ``i``-th 1/n of the elements).

Pure numpy: the tables are built and tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ...planner.plan import Plan
from ...schedule.compile import tree_ranges

__all__ = ["ITEM_DTYPE", "MAX_ITEMS", "MAX_RANKS", "TREE_DTYPE", "Work", "chunk_elements", "make_work"]

MAX_RANKS = 16  # BLINK_MAXR in trees.cu: ranks of one server, and a node's fan-in
MAX_ITEMS = 8192  # items per collective: the flag words a rank keeps per phase
MIN_CHUNK_BYTES = 256 << 10  # below this an item is all flag latency
ITEMS_PER_BLOCK = 8  # enough items per block that blocks finish together (a block's share varies by one item)

ITEM_DTYPE = np.dtype([("lo", "<i8"), ("hi", "<i8"), ("tree", "<i4"), ("pad0", "<i4"), ("pad1", "<i8")])
TREE_DTYPE = np.dtype([("parent", "<i4"), ("nchild", "<i4"), ("child", "<i4", (MAX_RANKS,))])


@dataclass(frozen=True)
class Work:
    """The tables of one (plan, count, rank, blocks): ``items`` (ITEM_DTYPE) and ``trees`` (TREE_DTYPE,
    this rank's parent and children in each tree, as local ranks; parent -1 at the root)."""

    items: np.ndarray
    trees: np.ndarray
    blocks: int  # blocks to launch: min(blocks asked, items), at least 1

    @property
    def nitems(self) -> int:
        return int(self.items.shape[0])


def chunk_elements(count: int, itemsize: int, blocks: int, ntrees: int) -> int:
    """Elements per item: about ITEMS_PER_BLOCK items per block over the whole buffer, at least
    MIN_CHUNK_BYTES, a multiple of 16 bytes, and few enough that every tree fits in MAX_ITEMS."""
    vec = max(1, 16 // itemsize)
    target = -(-count // max(1, blocks * ITEMS_PER_BLOCK))
    floor_items = -(-count // max(1, MAX_ITEMS - ntrees))  # ceil splits add at most one item per tree
    chunk = max(target, MIN_CHUNK_BYTES // itemsize, floor_items, 1)
    return -(-chunk // vec) * vec


def make_work(plan: Plan, count: int, itemsize: int, rank: int, blocks: int) -> Work:
    """The items and this rank's tree table for ``count`` elements of ``itemsize`` bytes."""
    n = plan.n
    if n > MAX_RANKS:
        raise ConfigError(f"plan: {n} ranks in one server; the GPU executor takes at most {MAX_RANKS}")
    if not 0 <= rank < n:
        raise ConfigError(f"rank: {rank} is not in 0..{n - 1}")
    rank_of = {g: i for i, g in enumerate(plan.gpus)}
    ranges, _ = tree_ranges(plan, count)
    trees = np.zeros(len(plan.trees), TREE_DTYPE)
    for t, tree in enumerate(plan.trees):
        parent = -1
        kids: list[int] = []
        for p, c in tree.edges:
            pr, cr = rank_of[p], rank_of[c]
            if cr == rank:
                parent = pr
            if pr == rank:
                kids.append(cr)
        trees[t]["parent"] = parent
        trees[t]["nchild"] = len(kids)
        trees[t]["child"][: len(kids)] = kids
    chunk = chunk_elements(count, itemsize, blocks, len(plan.trees))
    rows = []
    for t, (lo, hi) in enumerate(ranges):
        for a in range(lo, hi, chunk):
            rows.append((a, min(hi, a + chunk), t, 0, 0))
    if len(rows) > MAX_ITEMS:  # chunk_elements keeps this from happening
        raise ConfigError(f"work: {len(rows)} items exceed {MAX_ITEMS}")
    items = np.array(rows, ITEM_DTYPE) if rows else np.zeros(0, ITEM_DTYPE)
    return Work(items, trees, max(1, min(blocks, len(rows))))
