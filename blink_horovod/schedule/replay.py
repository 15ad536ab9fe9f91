"""Execute a program on numpy arrays in one process: the IR's reference semantics.

Every rank's buffer is a numpy array; the executor runs one op at a time,
picking at random among the ops the IR allows to run (the head of some lane,
its ``after`` ops done, its peer's flag posted), so repeated runs with
different seeds walk different interleavings of the lanes.  It is the numeric
counterpart of :mod:`blink_horovod.schedule.check` (which proves a program for
every interleaving symbolically) and the reference the real runtimes are
compared with.  Pure numpy: no processes, no shared memory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from ..errors import ScheduleError
from .program import Program

__all__ = ["REDUCE_OPS", "replay"]

REDUCE_OPS = {
    "sum": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
}


def replay(program: Program, inputs: Sequence[np.ndarray], op: str = "sum", seed: int | None = 0) -> list[np.ndarray]:
    """Run ``program`` on copies of ``inputs`` (one 1-D array of ``program.count`` per rank).

    Parameters
    ----------
    program : Program
    inputs : sequence of numpy.ndarray
        ``inputs[r]`` is rank r's input; not modified.
    op : str
        ``sum``, ``min``, ``max`` or ``product``: what ``reduce`` and ``fanin`` ops apply.
    seed : int or None
        Seed of the random choice among runnable ops; None: lists order per
        rank, ranks round-robin (a sequential executor per rank).

    Returns
    -------
    list of numpy.ndarray
        Every rank's buffer at the end.

    Raises
    ------
    ScheduleError
        when the inputs do not fit the program, or no op can run before the end
        (run :func:`~blink_horovod.schedule.check_program` for the reason).
    """
    if op not in REDUCE_OPS:
        raise ScheduleError(f"op: expected one of {', '.join(REDUCE_OPS)}, got {op!r}")
    if len(inputs) != program.nranks:
        raise ScheduleError(f"inputs: {len(inputs)} arrays for {program.nranks} ranks")
    bufs = []
    for r, x in enumerate(inputs):
        a = np.array(x, copy=True).reshape(-1)
        if a.size != program.count:
            raise ScheduleError(f"inputs[{r}]: {a.size} elements, the program moves {program.count}")
        bufs.append(a)
    fn = REDUCE_OPS[op]
    n = program.nranks
    posted: set[tuple[int, int]] = set()
    # Per rank: lanes as queues of op indices, in list order.
    lanes: list[dict[int, list[int]]] = []
    for ops in program.ranks:
        d: dict[int, list[int]] = {}
        for i, o in enumerate(ops):
            d.setdefault(o.stream, []).append(i)
        lanes.append({s: q[::-1] for s, q in d.items()})  # reversed: pop() takes the head
    done = [bytearray(len(ops)) for ops in program.ranks]
    left = sum(len(ops) for ops in program.ranks)
    rng = random.Random(seed) if seed is not None else None

    def runnable(r: int, i: int) -> bool:
        o = program.ranks[r][i]
        if any(not done[r][j] for j in o.after):
            return False
        return all(src in posted for src in o.sources())

    while left:
        cands = [(r, s) for r in range(n) for s, q in lanes[r].items() if q and runnable(r, q[-1])]
        if not cands:
            raise ScheduleError(f"replay: stuck with {left} ops left (deadlock); check_program names the waits")
        if rng is None:
            picks = cands
        else:
            picks = [cands[rng.randrange(len(cands))]]
        for r, s in picks:
            q = lanes[r][s]
            if not q or not runnable(r, q[-1]):
                continue
            i = q.pop()
            o = program.ranks[r][i]
            if o.kind == "post":
                posted.add((r, o.flag))
            else:
                dst = bufs[r][o.offset : o.offset + o.count]
                if o.kind == "copy":
                    dst[...] = bufs[o.peer][o.offset : o.offset + o.count]
                else:  # reduce, or fanin: every source in one op
                    for q, _ in o.sources():
                        fn(dst, bufs[q][o.offset : o.offset + o.count], out=dst)
            done[r][i] = 1
            left -= 1
    return bufs
