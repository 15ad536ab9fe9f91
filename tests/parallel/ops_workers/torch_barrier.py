"""One rank of the barrier job: ``hvd.barrier()`` under BLINK_ENABLE=1 while one rank is slow to wake.

Horovod's test_global_barrier_op (0.28.1 test_torch.py) times the barrier
from the end of the allreduce before it, with rank 0 sleeping 5 s, and
wants >= 5 s on every rank.  The round that decides a barrier tells the
rank that arrives last at once, but each peer only when it is next
scheduled; a barrier that let the others go as soon as they saw the round
could release them before a descheduled peer had even noticed it (on a
loaded machine such a peer also leaves the allreduce before it late, so its
own timing of the barrier came out short: the -np 4 FAILED of that test).
Here rank SLOW is made slow to wake on purpose: its engine sleeps DELAY
after every round that decided a barrier, before doing its part.  Every
rank must leave the barrier only after that (Horovod runs a Gloo/MPI
barrier after negotiating one; Blink's barrier stage does the same), and,
as in Horovod's test, no earlier than rank 0's SLEEP after the allreduce.

Prints "RANK r OK <stats json>" at the end; any failure raises (non-zero exit).
"""

import json
import time

import horovod.torch as hvd
import torch
from blink_job import start

SLOW = 1
DELAY = 1.0
SLEEP = 2.0

r, n, ctx = start(1)

seen: list[float] = []  # when rank SLOW got round to a barrier's round
if r == SLOW:
    engine = ctx.engine
    execute = engine._execute

    def slow_execute(decision):
        head = decision.head
        if decision.action == "run" and head is not None and head.kind == "barrier" and not seen:
            time.sleep(DELAY)
            seen.append(time.time())
        return execute(decision)

    engine._execute = slow_execute

# Horovod's test_global_barrier_op, with rank SLOW slow to wake and SLEEP for its 5 s
i = 0
while hvd.allreduce_(torch.IntTensor([int(hvd.is_initialized())]), None, f"is_initialized{i}", hvd.Sum) != n:
    i += 1
start = time.time()
if r == 0:
    time.sleep(SLEEP)
entered = time.time()
hvd.barrier()
left = time.time()

rows = hvd.allgather_object({"rank": r, "start": start, "entered": entered, "left": left, "seen": seen})
slow_seen = rows[SLOW]["seen"]
assert len(slow_seen) == 1, rows
for row in rows:
    # nobody leaves before the slow rank has seen the barrier's round ...
    assert row["left"] >= slow_seen[0], ("left the barrier before rank SLOW saw its round", row, slow_seen)
    # ... nor before rank 0 arrived; and the Horovod test's own check
    assert row["left"] >= rows[0]["entered"], ("left the barrier before rank 0 arrived", row, rows[0])
    assert row["left"] - row["start"] >= SLEEP, ("barrier shorter than rank 0's sleep", row)

hvd.barrier()
print(f"RANK {r} OK " + json.dumps({"barrier_seconds": round(left - start, 3), "slow_seen": slow_seen[0]}), flush=True)
