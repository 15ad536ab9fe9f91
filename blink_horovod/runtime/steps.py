"""Execution steps: a rank's placed ops with consecutive reductions of one region fused.

On CPU every pass over memory is the cost (the placement module's reason to
exist), and two passes are left after placement that are not needed:

* **Chains of reductions.**  A tree root (or a middle node) with ``k``
  children reduces the same chunk ``k`` times in a row: ``dst = src + c1``,
  ``dst += c2``, ... .  Done op by op, each pass streams the whole chunk
  through memory again.  Done *block by block* (a block of
  :data:`BLOCK_BYTES`, which stays in the core's L2 cache), the chunk's
  current value is read from memory once and written once, whatever ``k``.
  This is what the paper's receiving GPU does in one kernel per chunk
  (Blink, section 4: reductions on the receiving GPU, fused with the copy);
  on a star (one-hop trees, Blink's choice on fully connected machines,
  section 5) it turns the root's ``n-1`` reductions into one pass.
* **Values that must end in two places.**  A region a peer reads after the
  rank's last write of it (a tree root's reduced chunk, a middle node's
  forwarded one) must sit in the shared buffer, and, as the result, in the
  user's array: placement writes the shared buffer and copies it out after
  the program, a second pass over memory.  Here the last write of such a
  region writes both, block by block, while the block is in cache
  (``dual``), and the region leaves the copy-out list.

* **Averages divided where they are made.**  ``average`` is a sum divided
  by the rank count.  Dividing every rank's whole result afterwards costs
  each rank a pass over the whole message (expensive for 16-bit floats and
  integers, whose division widens); the reduction that is a region's last
  write on a rank is that region's final sum (a tree root of an allreduce:
  every other rank only copies it down), so the executor divides there,
  block by block while it is in cache, and the copies carry the average.
  Each element is divided exactly once, by the same arithmetic
  (:func:`~blink_horovod.runtime.dtypes.finish_average`), so the bits are
  those of dividing afterwards.

Why it is exact: no post of this rank falls inside a fused chain (the ops
are consecutive), so no peer can observe the intermediate values, which
are skipped; the final value lands where placement put it, at the same
point of the op list.  A dual write of the user's array happens earlier
than the copy-out would, but that array is private to the rank and the
region's later ops (none write it; reads of its value go to the shared
buffer, where placement says the value is) never read the user's copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from .placement import COPY, POST, REDUCE, SHARED, STAGE, Placement, subtract

__all__ = ["BLOCK_BYTES", "STEP_COPY", "STEP_POST", "STEP_REDUCE", "STEP_STAGE", "Step", "Steps", "fuse"]

STEP_COPY, STEP_REDUCE, STEP_POST, STEP_STAGE = COPY, REDUCE, POST, STAGE  # the placement's op kinds
BLOCK_BYTES = 128 << 10  # a block of every operand fits a core's L2 with room to spare


@dataclass(frozen=True, slots=True)
class Step:
    """``kind``; ``peers``/``flags``: the peers read (and the flag awaited of each), in order;
    ``[start, stop)``; ``src_loc``: where the region's current value is (reductions);
    ``dst_loc``: where the result goes; ``dual``: also write the user's array; ``ops``: the
    placed ops this step stands for (chunk-op accounting); ``final``: a reduction that is the
    last write of its region (direct placement only), so it computes the region's final
    value: an allreduce's tree root, where an average divides once (module docstring)."""

    kind: int
    peers: tuple[int, ...]
    flags: tuple[int, ...]
    start: int
    stop: int
    src_loc: int
    dst_loc: int
    dual: bool
    ops: int
    final: bool = False


@dataclass(frozen=True)
class Steps:
    steps: tuple[Step, ...]
    stage_in: tuple[tuple[int, int], ...]
    stage_out: tuple[tuple[int, int], ...]


def _covered(region: tuple[int, int], regions: tuple[tuple[int, int], ...]) -> bool:
    a, b = region
    return any(c <= a and b <= d for c, d in regions)


def fuse(pl: Placement, fuse_chains: bool = True) -> Steps:
    """The steps of a placement (module docstring); ``fuse_chains=False``: one step per op."""
    ops = pl.ops
    steps: list[Step] = []
    i = 0
    while i < len(ops):
        kind, peer, flag, start, stop, src, dst = ops[i]
        if kind == STEP_POST or kind == STEP_STAGE:
            steps.append(Step(kind, (), (flag,), start, stop, src, dst, False, 0))
            i += 1
            continue
        peers, flags = [peer], [flag]
        j = i + 1
        if kind == STEP_REDUCE and fuse_chains and stop > start:
            # The chain: the next reduction of the same region, starting from where this one wrote.
            while j < len(ops):
                k2, p2, f2, s2, e2, src2, dst2 = ops[j]
                if k2 != STEP_REDUCE or (s2, e2) != (start, stop) or src2 != dst:
                    break
                peers.append(p2)
                flags.append(f2)
                dst = dst2
                j += 1
        steps.append(Step(kind, tuple(peers), tuple(flags), start, stop, src, dst, False, j - i))
        i = j
    stage_out = pl.stage_out
    if pl.direct:
        # Dual writes: the last write of a region whose final value is in the shared buffer.
        last: dict[tuple[int, int], int] = {}
        for k, s in enumerate(steps):
            if s.kind != STEP_POST and s.kind != STEP_STAGE and s.stop > s.start:
                last[(s.start, s.stop)] = k
        dual: set[tuple[int, int]] = set()
        for region, k in last.items():
            s = steps[k]
            both = s.dst_loc == SHARED and _covered(region, pl.stage_out)
            final = s.kind == STEP_REDUCE
            if both or final:
                steps[k] = Step(s.kind, s.peers, s.flags, s.start, s.stop, s.src_loc, s.dst_loc, both, s.ops, final)
            if both:
                dual.add(region)
        if dual:
            stage_out = subtract(pl.stage_out, dual)
    return Steps(tuple(steps), pl.stage_in, stage_out)
