"""The start every horovod.torch worker of the ops tests shares: ``hvd.init()``, Blink engaged, the servers expected."""

import faulthandler
import os
import sys

import horovod.torch as hvd
from blink_horovod.ops import torch_ops


def start(default_servers: int):
    """``(rank, size, Blink's context)`` after ``hvd.init()``; fails unless Blink carries the job on
    ``EXPECT_SERVERS`` servers (default ``default_servers``)."""
    # A hung rank shows where every thread of it waits before Gloo's own timeout (120 s in these jobs)
    # aborts it without a Python stack.
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "90")), exit=False,
                                      file=sys.stderr)
    hvd.init()
    ctx = torch_ops.context()
    assert ctx is not None, torch_ops.disabled_reason()
    servers = int(os.environ.get("EXPECT_SERVERS", str(default_servers)))
    assert ctx.layout.num_servers == servers, (ctx.layout, servers)
    return hvd.rank(), hvd.size(), ctx
