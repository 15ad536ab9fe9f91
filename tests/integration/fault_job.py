"""One rank (or server) submits a collective that differs from the others' (a Horovod script).

PyTorch by default; ``FAULT_FRAMEWORK=tf`` runs the same faults under ``horovod.tensorflow``,
collectives called eagerly, as a TF2 script calls them outside ``tf.function``.  ``FAULT_DEVICE=cuda``
puts the PyTorch tensors on the rank's GPU (local rank modulo the GPUs there), where Blink's GPU
runtime carries them.

Run under ``horovodrun`` / ``blinkrun`` with ``BLINK_ENABLE=1`` by the cross-server fault
tests and ``benchmarks/cross_server_faults.py``.  ``FAULT_JOB`` (JSON) says what differs:
``field`` (shape, dtype, op, root, prescale, postscale, collective, name; or stall, dead:
the odd ranks sleep, or SIGKILL themselves, instead of submitting) and ``odd`` (the global
ranks that submit the odd value).  Every rank prints one line
``@@reliability {"kind": "error", "rank": r, "type": ..., "message": ..., "seconds": ...}``
with the error it caught (or ``"kind": "no-error"``), also appended to ``rank<r>.events`` in the
folder ``events`` names, then exits 1 on an error.
"""

import json
import os
import signal
import sys
import time

TF = os.environ.get("FAULT_FRAMEWORK", "torch") == "tf"
if TF:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf
else:
    import horovod.torch as hvd
    import torch


def ones(n, wide=False):
    if TF:
        return tf.ones([n], dtype=tf.float64 if wide else tf.float32)
    return torch.ones(n, dtype=torch.float64 if wide else torch.float32, device=DEVICE)


if JOB_FIELD_DEAD := json.loads(os.environ["FAULT_JOB"])["field"] == "dead":
    # horovodrun ends the job as soon as a rank dies; a host lost for good, where nobody would, is
    # what this stands for: the survivors wait out its SIGTERM grace (5 s) and report first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

hvd.init()
RANK = hvd.rank()
DEVICE = "cpu"
if not TF and os.environ.get("FAULT_DEVICE") == "cuda":
    DEVICE = f"cuda:{hvd.local_rank() % torch.cuda.device_count()}"
    torch.cuda.set_device(DEVICE)
JOB = json.loads(os.environ["FAULT_JOB"])
FIELD, ODD = JOB["field"], RANK in JOB["odd"]
NAME = "mismatch"


def emit(kind, **fields):
    line = "@@reliability " + json.dumps(dict(kind=kind, rank=RANK, pid=os.getpid(), t=time.time(), **fields))
    print(line, flush=True)
    if JOB.get("events"):  # mpirun's tagged output may interleave the ranks' lines mid-line: a file each too
        with open(os.path.join(JOB["events"], f"rank{RANK}.events"), "a") as fh:
            fh.write(line + "\n")


def collective():
    x = ones(4097 if FIELD == "shape" and ODD else 4096, wide=FIELD == "dtype" and ODD)
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


hvd.allreduce(ones(16), name="warm-up")
start = time.time()
if FIELD == "stall" and ODD:
    time.sleep(JOB.get("sleep", 60))  # a rank stuck in its own code: it submits nothing meanwhile
elif FIELD == "dead" and ODD:
    os.kill(os.getpid(), 9)
try:
    collective()
    emit("no-error")
except Exception as exc:  # noqa: BLE001 - whatever it is, every rank reports it
    emit("error", type=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], message=str(exc),
         seconds=time.time() - start)
    # mpirun ends the whole job at the first rank's non-zero exit: linger a moment, so that it cannot
    # cut short a rank that raised the same error a few milliseconds later but has not printed it yet.
    time.sleep(JOB.get("linger", 1.0))
    sys.exit(1)
