"""Lower one rank's program to per-stream device commands: what a CUDA graph of the program holds.

Pure Python: no CUDA.  The GPU executor (:mod:`.executor`) captures these
commands into a CUDA graph once per (program, staging, dtype, op, epoch
residue); the reference interpreter (:mod:`.interpret`) runs them on numpy
for every rank, so the lowering is tested on machines without GPUs.

Why the shape is what it is (Blink, MLSys 2020, section 4: chunks pipelined
over spanning trees, one stream per link, reductions on the receiving GPU;
no per-chunk host work on GPUs):

Streams
    Stream 0 is the *origin* (the capture's origin stream, the collective's
    head and tail); program lane ``s`` runs on stream ``s + 1``.  Lanes fork
    from the origin after the header and join it before the footer: stream
    capture requires every forked stream to rejoin.

Flags with literal values
    A stream memory operation captured in a graph writes, and compares with,
    a *literal*; a replay cannot pass a new epoch.  So the executor keeps
    three graph variants, one per residue of the epoch modulo 3, and flags
    hold one-hot values ``1 << (epoch % 3)``: a post writes the value of its
    epoch, a wait is ``cuStreamWaitValue32(AND mask)`` accepting listed
    epochs.  Each graph starts with a device-side *barrier*: it waits until
    every rank (itself included) posted its DONE word for the previous epoch,
    then zeroes its own program flags.  Hence during epoch ``e`` a flag holds
    0, the value of ``e - 1`` or that of ``e`` (never ``e - 3``: every rank
    zeroed its flags at ``e - 1``'s start, and nobody can be at ``e + 1``
    before everyone finished ``e``), so masks of one epoch are unambiguous;
    DONE words are seen at ``e - 1`` or ``e`` when a barrier reads them, hence
    three residues.  Host work per collective stays O(1): pick the variant,
    launch it.  (Updating captured values per replay instead costs host time
    per node, and epochs kept in device memory cannot feed
    ``cuStreamWaitValue32``, whose operand is a literal.)

Order edges (no deadlock under any serialisation)
    Synchronisation through memory is invisible to CUDA's scheduler, which may
    map independent graph branches onto one hardware queue in any order
    consistent with the graph's edges (cuda-bindings' note on
    ``cuStreamWaitValue32``).  A wait queued before a post that it depends on
    through a peer would deadlock.  Every wait of step ``s`` therefore gets an
    edge from the last post of step ``< s`` on every other lane (unless
    already ordered after it): a wait can only depend, through peers, on this
    rank's posts of smaller steps (the program's step rule), and those are
    then always before it, whatever the queue mapping.

Staging
    The program runs on the rank's IPC-shared buffer.  The user's tensor is
    read and written only by the header's ``stage_in`` and the footer's
    ``stage_out`` commands, whose user pointer comes from an argument slot the
    host fills before each launch (the graph is reused for any tensor);
    ``average`` is finished inside ``stage_out``.

Memory words of a rank's flag array: word 0 is DONE (barrier), word ``1 + f``
is program flag ``f``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import BlinkInternalError
from ...schedule.program import Program

__all__ = [
    "DONE_WORD",
    "RESIDUES",
    "Cmd",
    "Lowered",
    "accept_mask",
    "epoch_value",
    "flag_word",
    "lower",
]

DONE_WORD = 0
RESIDUES = 3  # graph variants: epoch % 3 (module docstring)

# Command kinds.
WAIT = "wait"  # stream waits until (flags_peer[word] & mask(epoch, accept)) != 0
WRITE = "write"  # flags_own[word] = epoch_value(epoch)
RESET = "reset"  # flags_own[1:nwords] = 0
COPY = "copy"  # buf_own[offset:+count] = buf_peer[offset:+count]
REDUCE = "reduce"  # buf_own[offset:+count] = op(buf_own[...], buf_peer[...])
STAGE_IN = "stage_in"  # buf_own[offset:+count] = user[user_offset:+count]
STAGE_OUT = "stage_out"  # user[user_offset:+count] = buf_own[offset:+count] (average: / n)
RECORD = "record"  # record event `event` on the stream
JOIN = "join"  # the stream waits for event `event`
KINDS = (WAIT, WRITE, RESET, COPY, REDUCE, STAGE_IN, STAGE_OUT, RECORD, JOIN)


def flag_word(flag: int) -> int:
    """Word of program flag ``flag`` in a rank's flag array."""
    return 1 + flag


def epoch_value(epoch: int) -> int:
    """The literal a post of ``epoch`` writes: one-hot in the epoch's residue."""
    return 1 << (epoch % RESIDUES)


def accept_mask(epoch: int, accept: Sequence[int]) -> int:
    """AND mask of a wait in ``epoch`` accepting the relative epochs ``accept`` (e.g. ``(-1, 0)``)."""
    mask = 0
    for d in accept:
        mask |= epoch_value(epoch + d)
    return mask


@dataclass(frozen=True, slots=True)
class Cmd:
    """One device command (see the kind constants).

    ``peer`` is the rank read (wait, copy, reduce); ``word`` a flag word;
    ``accept`` the relative epochs a wait accepts; ``offset``/``count`` in
    elements of the shared buffer; ``user_offset`` in elements of the user's
    tensor; ``event`` an event index local to the lowering; ``op`` the index of
    the program op the command comes from (-1: header/footer).
    """

    kind: str
    stream: int
    peer: int = -1
    word: int = 0
    accept: tuple[int, ...] = (0,)
    offset: int = 0
    count: int = 0
    user_offset: int = 0
    event: int = -1
    op: int = -1


@dataclass(frozen=True)
class Lowered:
    """Rank ``rank``'s commands in issue (capture) order.

    ``nstreams`` counts the origin; ``nwords`` the flag words the program needs
    (DONE + program flags); ``nevents`` the events the capture records;
    ``order_edges`` how many edges were added for deadlock freedom.
    """

    rank: int
    nranks: int
    cmds: tuple[Cmd, ...]
    nstreams: int
    nwords: int
    nevents: int
    count: int
    order_edges: int = 0

    def by_stream(self) -> list[list[Cmd]]:
        out: list[list[Cmd]] = [[] for _ in range(self.nstreams)]
        for c in self.cmds:
            out[c.stream].append(c)
        return out


Run = tuple[int, int, int]  # (offset in the user's tensor, offset in the buffer, elements)


def _check(program: Program, rank: int) -> None:
    if not 0 <= rank < program.nranks:
        raise BlinkInternalError(f"lowering: rank {rank} is not in 0..{program.nranks - 1}")
    ops = program.ranks[rank]
    for i, o in enumerate(ops):
        if o.kind in ("copy", "reduce"):
            if not 0 <= o.peer < program.nranks or o.peer == rank:
                raise BlinkInternalError(f"lowering: op {i} of rank {rank} reads rank {o.peer}")
        elif o.kind != "post":
            raise BlinkInternalError(f"lowering: op {i} of rank {rank} has unknown kind {o.kind!r}")
        if o.count < 0 or o.offset < 0 or o.offset + o.count > program.count:
            raise BlinkInternalError(
                f"lowering: op {i} of rank {rank} covers [{o.offset}, {o.offset + o.count}) outside [0, {program.count})"
            )
        for j in o.after:
            if not 0 <= j < i:
                raise BlinkInternalError(f"lowering: op {i} of rank {rank} lists after={j}, not an earlier op")
        if i and o.step < ops[i - 1].step:
            raise BlinkInternalError(f"lowering: ops of rank {rank} are not sorted by step (op {i})")


def lower(
    program: Program,
    rank: int,
    stage_in: Sequence[Run] = (),
    stage_out: Sequence[Run] = (),
    order_edges: bool = True,
) -> Lowered:
    """The device commands of ``rank``'s ops of ``program`` (module docstring).

    Parameters
    ----------
    program : Program
        A compiled (and checked) program.
    rank : int
        The rank lowered.
    stage_in, stage_out : sequence of (user offset, buffer offset, elements)
        Regions copied from the user's tensor into the shared buffer before the
        ops, and back after them.
    order_edges : bool
        Add the edges that make any serialisation deadlock-free (only tests
        turn them off, to show they are needed).

    Returns
    -------
    Lowered

    Raises
    ------
    BlinkInternalError
        for a program the executor cannot run (bad peer, region or ``after``).
    """
    _check(program, rank)
    ops = program.ranks[rank]
    n = program.nranks
    nlanes = max((o.stream for o in ops), default=-1) + 1
    for run in list(stage_in) + list(stage_out):
        u, b, m = run
        if m < 0 or b < 0 or u < 0 or b + m > program.count:
            raise BlinkInternalError(f"lowering: staging run {run} outside the buffer of {program.count} elements")

    # Pass 1: decide the cross-lane edges (after lists + order edges) with vector clocks.
    # vc[x][y]: highest op index of lane y known to complete before lane x's next op.
    vc = [[-1] * nlanes for _ in range(nlanes)]
    snap: dict[int, list[int]] = {}  # op index -> vector clock of its lane right after it
    edges: list[list[int]] = [[] for _ in ops]  # op i waits for the events after these ops
    posts: list[list[tuple[int, int]]] = [[] for _ in range(nlanes)]  # lane -> [(step, op index)]
    added = 0

    def need(i: int, j: int) -> None:
        x, y = ops[i].stream, ops[j].stream
        if vc[x][y] >= j:
            return
        edges[i].append(j)
        for k in range(nlanes):
            vc[x][k] = max(vc[x][k], snap[j][k])

    for i, o in enumerate(ops):
        x = o.stream
        for j in o.after:
            if ops[j].stream != x:
                need(i, j)
        if o.kind != "post" and order_edges:
            for y in range(nlanes):
                if y == x:
                    continue
                last = -1
                for step, j in reversed(posts[y]):
                    if step < o.step:
                        last = j
                        break
                if last >= 0 and vc[x][y] < last:
                    need(i, last)
                    added += 1
        vc[x][x] = i
        snap[i] = list(vc[x])
        if o.kind == "post":
            posts[x].append((o.step, i))
    recorded = sorted({j for e in edges for j in e})
    event_of = {j: k for k, j in enumerate(recorded)}

    # Pass 2: emit in issue order.
    cmds: list[Cmd] = []
    for q in range(n):
        cmds.append(Cmd(WAIT, 0, peer=q, word=DONE_WORD, accept=(-1, 0)))
    cmds.append(Cmd(RESET, 0))
    for u, b, m in stage_in:
        if m:
            cmds.append(Cmd(STAGE_IN, 0, offset=b, count=m, user_offset=u))
    nevents = len(recorded)
    if nlanes:
        fork = nevents
        nevents += 1
        cmds.append(Cmd(RECORD, 0, event=fork))
        for s in range(nlanes):
            cmds.append(Cmd(JOIN, s + 1, event=fork))
    waited: list[set[tuple[int, int]]] = [set() for _ in range(nlanes)]
    for i, o in enumerate(ops):
        st = o.stream + 1
        for j in edges[i]:
            cmds.append(Cmd(JOIN, st, event=event_of[j], op=i))
        if o.kind == "post":
            cmds.append(Cmd(WRITE, st, word=flag_word(o.flag), op=i))
        else:
            key = (o.peer, o.flag)
            if key not in waited[o.stream]:
                waited[o.stream].add(key)
                cmds.append(Cmd(WAIT, st, peer=o.peer, word=flag_word(o.flag), op=i))
            if o.count:
                kind = COPY if o.kind == "copy" else REDUCE
                cmds.append(Cmd(kind, st, peer=o.peer, offset=o.offset, count=o.count, op=i))
        if i in event_of:
            cmds.append(Cmd(RECORD, st, event=event_of[i], op=i))
    for s in range(nlanes):
        ev = nevents
        nevents += 1
        cmds.append(Cmd(RECORD, s + 1, event=ev))
        cmds.append(Cmd(JOIN, 0, event=ev))
    for u, b, m in stage_out:
        if m:
            cmds.append(Cmd(STAGE_OUT, 0, offset=b, count=m, user_offset=u))
    cmds.append(Cmd(WRITE, 0, word=DONE_WORD))
    nflags = max(program.nflags) if program.nflags else 0
    return Lowered(rank, n, tuple(cmds), nlanes + 1, 1 + nflags, nevents, program.count, added)


def plain_runs(program: Program, has_input: bool, wants_output: bool, base: int = 0) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
    """Staging of a piece that maps the whole buffer at user offset ``base`` (allreduce, broadcast)."""
    whole: tuple[Run, ...] = ((base, 0, program.count),) if program.count else ()
    return (whole if has_input else ()), (whole if wants_output else ())
