"""Where each intermediate value of a rank's program lives: its shared buffer, or the user's array.

On CPU the data movement *is* the cost: every pass over memory counts, and
the naive executor makes two extra ones, staging the whole input into the
shared buffer and copying the whole result back out.  But the shared buffer
is only needed where a peer reads it.  For one rank's op list this module
decides, per value of each region (a chunk), where it must be:

* the rank's *input* of a region is staged into the shared buffer only if a
  peer reads that region before the rank first overwrites it (a leaf of a
  reduce tree, whose ``START_FLAG`` a parent waits for); otherwise it stays
  in the user's array and the first reduction reads it from there
  (``np.add(user, peer, out=shared)``, no extra pass);
* a value a write produces goes to the shared buffer only if a peer reads it,
  i.e. waits for a flag this rank posts after the write and before the
  region's next write; otherwise (the leaves of a broadcast tree) it goes
  straight into the user's array;
* after the program, only regions whose final value sits in the shared
  buffer are copied out.

Why this is exact: a peer's read of region R waiting for flag f sees this
rank's buffer as it was when f was posted, because the symbolic checker
(:func:`blink_horovod.schedule.check_program`) proves that every later write
of R is ordered after that read.  So R must hold, in the shared buffer, the
value current at each such post, and nothing else is ever observed by a peer.

Programs whose regions overlap partially (not equal, not disjoint) get the
plain plan: stage everything in, everything out.

:func:`interleave` (allreduce pieces) then moves each staged region from
before the ops to just before a peer first reads it, under a flag of its own
(``STAGE`` ops), so that the reader finds it in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.program import Program

__all__ = ["COPY", "POST", "REDUCE", "SHARED", "STAGE", "USER", "Placement", "interleave", "place", "plain",
           "subtract"]

SHARED, USER = 0, 1
# Op kinds of a placement row (the fused steps and the executor use the same codes); STAGE only in
# interleaved placements: copy [start, stop) user -> shared.
COPY, REDUCE, POST, STAGE = 0, 1, 2, 3
_KINDS = {"copy": COPY, "reduce": REDUCE, "post": POST}


@dataclass(frozen=True)
class Placement:
    """One rank's ops with value locations, and its staging regions.

    ``ops`` rows: ``(kind, peer, flag, start, stop, src_loc, dst_loc)`` with
    kind COPY, REDUCE, POST (or STAGE, :func:`interleave`); for a reduce ``src_loc`` is where the
    current value of the region is (SHARED or USER), ``dst_loc`` where the
    result goes; for a copy only ``dst_loc`` matters.
    """

    ops: tuple[tuple[int, int, int, int, int, int, int], ...]
    stage_in: tuple[tuple[int, int], ...]  # [start, stop) copied user -> shared before the ops
    stage_out: tuple[tuple[int, int], ...]  # [start, stop) copied shared -> user after them
    direct: bool  # False: the plain plan


def _merge(regions: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(regions):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _kind(k: str) -> int:
    return _KINDS[k]


def plain(program: Program, rank: int, has_input: bool, wants_output: bool) -> Placement:
    """Everything in the shared buffer: stage the whole input in and the whole result out."""
    ops = tuple(
        (_kind(o.kind), o.peer, o.flag, o.offset, o.offset + o.count, SHARED, SHARED) for o in program.ranks[rank]
    )
    whole = ((0, program.count),) if program.count else ()
    return Placement(ops, whole if has_input else (), whole if wants_output else (), False)


def place(program: Program, rank: int, has_input: bool, wants_output: bool) -> Placement:
    """The placement of rank ``rank``'s ops (module docstring).

    ``has_input``: the user's array holds this rank's input (False for a
    broadcast's non-roots); ``wants_output``: the result must end up there
    (False for a broadcast's root, whose array must not change).
    """
    mine = program.ranks[rank]
    if not wants_output or not has_input:
        # Nothing to gain safely: such ranks either only feed others (root of a
        # broadcast: stage in, never write) or only receive (handled below).
        if not has_input and wants_output:
            return _receiver(program, rank)
        return plain(program, rank, has_input, wants_output)
    post_at: dict[int, int] = {}
    for i, o in enumerate(mine):
        if o.kind == "post":
            post_at.setdefault(o.flag, i)
    # Posts of this rank that a peer's read of each region depends on.
    readers: dict[tuple[int, int], list[int]] = {}
    intervals: set[tuple[int, int]] = set()
    for r, ops in enumerate(program.ranks):
        if r == rank:
            continue
        for o in ops:
            if o.kind != "post" and o.peer == rank and o.count > 0:
                key = (o.offset, o.offset + o.count)
                if o.flag not in post_at:
                    return plain(program, rank, has_input, wants_output)
                readers.setdefault(key, []).append(post_at[o.flag])
                intervals.add(key)
    writes: dict[tuple[int, int], list[int]] = {}
    for i, o in enumerate(mine):
        if o.kind != "post" and o.count > 0:
            key = (o.offset, o.offset + o.count)
            writes.setdefault(key, []).append(i)
            intervals.add(key)
    # Regions must be equal or disjoint for per-region reasoning.
    reach = -1
    for a, b in sorted(intervals):
        if a < reach:
            return plain(program, rank, has_input, wants_output)
        reach = max(reach, b)

    def needed(lo: int, hi: int, key: tuple[int, int]) -> bool:
        """Does a peer read region ``key`` through a post strictly between ops lo and hi?"""
        return any(lo < j < hi for j in readers.get(key, ()))

    dst_loc: dict[int, int] = {}
    src_loc: dict[int, int] = {}
    stage_in: list[tuple[int, int]] = []
    stage_out: list[tuple[int, int]] = []
    for key in intervals:
        idx = writes.get(key, [])
        bounds = [-1] + idx + [len(mine)]
        loc = SHARED if needed(-1, bounds[1], key) else USER
        if loc == SHARED:
            stage_in.append(key)
        for k, i in enumerate(idx):
            src_loc[i] = loc
            loc = SHARED if needed(i, bounds[k + 2], key) else USER
            dst_loc[i] = loc
        if loc == SHARED and idx:
            stage_out.append(key)
    ops = []
    for i, o in enumerate(mine):
        k = _kind(o.kind)
        if k == POST or o.count == 0:
            ops.append((k, o.peer, o.flag, o.offset, o.offset + o.count, SHARED, SHARED))
        else:
            ops.append((k, o.peer, o.flag, o.offset, o.offset + o.count, src_loc[i], dst_loc[i]))
    return Placement(tuple(ops), _merge(stage_in), _merge(stage_out), True)


def _receiver(program: Program, rank: int) -> Placement:
    """A rank without input that wants the result (a broadcast's non-root).

    Its copies go straight to the user's array unless a peer reads the region
    afterwards (it forwards the chunk down the tree); then to the shared
    buffer, and out at the end.
    """
    mine = program.ranks[rank]
    post_at: dict[int, int] = {}
    for i, o in enumerate(mine):
        if o.kind == "post":
            post_at.setdefault(o.flag, i)
    readers: dict[tuple[int, int], list[int]] = {}
    for r, ops in enumerate(program.ranks):
        if r == rank:
            continue
        for o in ops:
            if o.kind != "post" and o.peer == rank and o.count > 0:
                if o.flag not in post_at:
                    return plain(program, rank, False, True)
                readers.setdefault((o.offset, o.offset + o.count), []).append(post_at[o.flag])
    if any(o.kind == "reduce" for o in mine):
        return plain(program, rank, False, True)
    writes: dict[tuple[int, int], list[int]] = {}
    for i, o in enumerate(mine):
        if o.kind == "copy" and o.count > 0:
            writes.setdefault((o.offset, o.offset + o.count), []).append(i)
    keys = set(writes) | set(readers)
    reach = -1
    for a, b in sorted(keys):
        if a < reach:
            return plain(program, rank, False, True)
        reach = max(reach, b)
    dst_loc: dict[int, int] = {}
    stage_out = []
    for key, idx in writes.items():
        ends = idx[1:] + [len(mine)]
        loc = USER
        for i, end in zip(idx, ends):
            loc = SHARED if any(i < j < end for j in readers.get(key, ())) else USER
            dst_loc[i] = loc
        if loc == SHARED:
            stage_out.append(key)
    ops = tuple(
        (_kind(o.kind), o.peer, o.flag, o.offset, o.offset + o.count, SHARED, dst_loc.get(i, SHARED))
        for i, o in enumerate(mine)
    )
    return Placement(ops, (), _merge(stage_out), True)



def interleave(program: Program, rank: int, placements: list[Placement]) -> tuple[Placement, int] | None:
    """Rank ``rank``'s placement with its input staged chunk by chunk, just before a peer reads it.

    ``placements``: every rank's :func:`place` of an allreduce-like program
    (every rank has an input and wants the result).  Direct placement stages
    a rank's input wherever a peer reads it under ``START_FLAG`` ("my input is
    in my buffer"), all of it before the first op, so a leaf's staged chunks
    are written long before its parent reads them: on CPU, out of the cache
    by then (each rank's stage is two quarters of the message).  Here each
    such region (a *staged key*) gets a flag of its own, numbered after the
    program's flags the same way on every rank; the owner copies the region
    into its shared buffer and posts that flag right before its first op of
    the pipeline step at which a peer first reads it (or earlier, where its
    own first write of the region or another reader's post needs it), and the
    readers wait for that flag instead of ``START_FLAG``.

    Why it stays correct and deadlock-free: a reader of the region sees, as
    before, the owner's input (the copy precedes the post it waits for, and
    the owner's later writes of the region are ordered after the read by the
    checked program's own flags, unchanged); the owner's first write of the
    region finds it staged.  The owner's ops are sorted by step and the
    reader's op has step ``s``; the post comes after the owner's ops of steps
    below ``s`` only, which wait for posts of smaller steps only, so the
    program's step rule still orders every wait after its post.

    Returns the placement and the flags every rank needs (the program's and
    one per staged key), or None (keep the placements as they are, on every rank alike) when
    a placement is not direct, an op list is not sorted by step, or a read
    under ``START_FLAG`` is not of a staged key.
    """
    n = program.nranks
    if len(placements) != n or not all(p.direct for p in placements):
        return None
    for ops in program.ranks:
        if any(ops[i].step > ops[i + 1].step for i in range(len(ops) - 1)):
            return None
    # Each rank's staged keys: regions read under flag 0, with the smallest step of a reader.
    first_step: list[dict[tuple[int, int], int]] = [{} for _ in range(n)]
    for r, ops in enumerate(program.ranks):
        for o in ops:
            if o.kind in ("copy", "reduce") and o.flag == 0 and o.count > 0:
                key = (o.offset, o.offset + o.count)
                if not any(a <= key[0] and key[1] <= b for a, b in placements[o.peer].stage_in):
                    return None
                seen = first_step[o.peer].get(key)
                first_step[o.peer][key] = o.step if seen is None else min(seen, o.step)
            elif o.kind not in ("copy", "reduce", "post"):
                return None
    base = max(program.nflags) if program.nflags else 0
    flag_of: list[dict[tuple[int, int], int]] = []
    for r in range(n):
        order = sorted(first_step[r], key=lambda k: (first_step[r][k], k))
        flag_of.append({k: base + i for i, k in enumerate(order)})
    mine = program.ranks[rank]
    own = flag_of[rank]
    if not any(flag_of):
        return None
    # Where each own staged key must be in place: before the first op of the reader's step,
    # before this rank's first write of it, before any post another reader of it waits for.
    post_at: dict[int, int] = {}
    for i, o in enumerate(mine):
        if o.kind == "post":
            post_at.setdefault(o.flag, i)
    pos = {k: len(mine) for k in own}
    for k, s in first_step[rank].items():
        for i, o in enumerate(mine):
            if o.step >= s:
                pos[k] = i
                break
    for i, o in enumerate(mine):
        key = (o.offset, o.offset + o.count)
        if o.kind != "post" and key in pos:
            pos[key] = min(pos[key], i)
    for r, ops in enumerate(program.ranks):
        if r == rank:
            continue
        for o in ops:
            key = (o.offset, o.offset + o.count)
            if o.kind != "post" and o.peer == rank and o.flag != 0 and key in pos:
                if o.flag not in post_at:
                    return None
                pos[key] = min(pos[key], post_at[o.flag])
    at: dict[int, list[tuple[int, int]]] = {}
    for k in sorted(own, key=lambda k: (pos[k], own[k])):
        at.setdefault(pos[k], []).append(k)
    out = []
    placed = placements[rank].ops
    for i in range(len(placed) + 1):
        for a, b in at.get(i, ()):  # stage the key, then post its flag
            out.append((STAGE, -1, 0, a, b, USER, SHARED))
            out.append((POST, -1, own[(a, b)], a, b, SHARED, SHARED))
        if i == len(placed):
            break
        kind, peer, flag, start, stop, src, dst = placed[i]
        if kind != POST and flag == 0:
            flag = flag_of[peer].get((start, stop), 0)
        out.append((kind, peer, flag, start, stop, src, dst))
    rest = subtract(placements[rank].stage_in, set(own))
    nflags = base + max(len(f) for f in flag_of)
    return Placement(tuple(out), rest, placements[rank].stage_out, True), nflags


def subtract(regions: tuple[tuple[int, int], ...], cut: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``regions`` (sorted, disjoint) minus the intervals of ``cut``."""
    out: list[tuple[int, int]] = []
    cuts = sorted(cut)
    for a, b in regions:
        p = a
        for c, d in cuts:
            if d <= p or c >= b:
                continue
            if c > p:
                out.append((p, c))
            p = max(p, d)
        if p < b:
            out.append((p, b))
    return tuple(out)
