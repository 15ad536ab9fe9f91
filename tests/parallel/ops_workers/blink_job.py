"""The start every horovod.torch worker of the ops tests shares: ``hvd.init()``, Blink engaged, the servers expected."""

import os

import horovod.torch as hvd
from blink_horovod.ops import torch_ops


def start(default_servers: int):
    """``(rank, size, Blink's context)`` after ``hvd.init()``; fails unless Blink carries the job on
    ``EXPECT_SERVERS`` servers (default ``default_servers``)."""
    hvd.init()
    ctx = torch_ops.context()
    assert ctx is not None, torch_ops.disabled_reason()
    servers = int(os.environ.get("EXPECT_SERVERS", str(default_servers)))
    assert ctx.layout.num_servers == servers, (ctx.layout, servers)
    return hvd.rank(), hvd.size(), ctx
