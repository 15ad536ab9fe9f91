"""One rank (or server) submits a collective that differs from the others' (a Horovod TensorFlow script).

The ``horovod.tensorflow`` twin of ``fault_job.py``: the same ``FAULT_JOB`` (JSON: ``field``
-- shape, dtype, op, root, prescale, postscale, collective, name; or stall, dead -- ``odd``,
``sleep``, ``events``, ``linger``), the same ``@@reliability`` lines (also appended to
``rank<r>.events``), the same exit status.  Collectives are called eagerly, as a TF2
script calls them outside ``tf.function``.  Run under ``horovodrun`` / ``blinkrun`` with
``BLINK_ENABLE=1`` by the cross-server fault tests.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import tensorflow as tf

if JOB_FIELD_DEAD := json.loads(os.environ["FAULT_JOB"])["field"] == "dead":
    # As in fault_job.py: the survivors wait out horovodrun's SIGTERM grace (5 s) and report first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

hvd.init()
RANK = hvd.rank()
JOB = json.loads(os.environ["FAULT_JOB"])
FIELD, ODD = JOB["field"], RANK in JOB["odd"]
NAME = "mismatch"


def emit(kind, **fields):
    line = "@@reliability " + json.dumps(dict(kind=kind, rank=RANK, pid=os.getpid(), t=time.time(), **fields))
    print(line, flush=True)
    if JOB.get("events"):
        with open(os.path.join(JOB["events"], f"rank{RANK}.events"), "a") as fh:
            fh.write(line + "\n")


def collective():
    x = tf.ones([4097 if FIELD == "shape" and ODD else 4096],
                dtype=tf.float64 if FIELD == "dtype" and ODD else tf.float32)
    if FIELD == "root":
        return hvd.broadcast(x, root_rank=1 if ODD else 0, name=NAME)
    if FIELD == "collective" and ODD:
        return hvd.broadcast(x, root_rank=0, name=NAME)
    if FIELD == "op":
        return hvd.allreduce(x, op=hvd.Average if ODD else hvd.Sum, name=NAME)
    if FIELD in ("prescale", "postscale"):
        return hvd.allreduce(x, op=hvd.Sum, name=NAME, **{f"{FIELD}_factor": 0.5 if ODD else 1.0})
    if FIELD == "name":
        return hvd.allreduce(x, op=hvd.Sum, name="grad.b" if ODD else "grad.w")
    return hvd.allreduce(x, op=hvd.Sum, name=NAME)


hvd.allreduce(tf.ones([16]), name="warm-up")
start = time.time()
if FIELD == "stall" and ODD:
    time.sleep(JOB.get("sleep", 60))
elif FIELD == "dead" and ODD:
    os.kill(os.getpid(), 9)
try:
    collective()
    emit("no-error")
except Exception as exc:  # noqa: BLE001 - whatever it is, every rank reports it
    emit("error", type=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], message=str(exc),
         seconds=time.time() - start)
    time.sleep(JOB.get("linger", 1.0))
    sys.exit(1)
