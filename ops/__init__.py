"""Horovod integration: Blink's collectives behind Horovod's API (installed as ``blink_horovod.ops``).

Blink (Wang et al., MLSys 2020) replaced NCCL inside existing frameworks by
preloading a library (``LD_PRELOAD``) so that unmodified training scripts got
its collectives.  This package is the Python counterpart: with
``BLINK_ENABLE=1``, an import hook (:mod:`.hook`, installed with the package as
a ``.pth`` file) patches ``horovod.torch``, ``horovod.tensorflow`` and
``horovod.tensorflow.keras`` right after they are imported, so that
allreduce, broadcast and the distributed optimizers run the hierarchical
Blink collective (:mod:`.hierarchical`):

1. intra-server: each local rank's 1/n of the buffer is reduced up Blink's
   trees to it (``Communicator.reduce_to_roots``);
2. cross-server: each local rank allreduces its segment with the ranks of the
   same local rank on the other servers (a Horovod process set: Horovod's own
   rings over Gloo, MPI or NCCL);
3. intra-server: the segments are broadcast down the trees
   (``Communicator.broadcast_from_roots``).

Module map (one idea each):

- :mod:`.hook`          the ``sys.meta_path`` finder that patches Horovod after import
  (``blink_horovod_hook.pth`` runs it at start-up when ``BLINK_ENABLE`` is set)
- :mod:`.patching`      replacing a function in every module that imported it; ``bypass()``
- :mod:`.layout`        which ranks form a server; the cross-server process sets
- :mod:`.context`       what lives between ``hvd.init`` and ``hvd.shutdown``
- :mod:`.scaling`       Horovod's exact prescale / postscale / average arithmetic
- :mod:`.negotiation`   the name-keyed agreement across ranks per round (mismatches, ``join``)
- :mod:`.engine`        the background thread, handles, ``poll`` / ``synchronize``
- :mod:`.hierarchical`  the three-stage allreduce and the two-stage broadcast
- :mod:`.quiet`         Horovod's threads kept quiet during each Blink collective
  (:mod:`.mpi_yield`, :mod:`.background`, :mod:`.outermost`)
- :mod:`.fusion`        fixed gradient buckets (DDP-style) and flat buffers
- :mod:`.fallback`      what goes to stock Horovod, counted and logged once per kind
- :mod:`.errors_bridge` Blink's errors raised as Horovod's ``HorovodInternalError``
- :mod:`.torch_ops`, :mod:`.torch_optimizer`, :mod:`.torch_cross`   the PyTorch adapter
- :mod:`.tf_ops`, :mod:`.keras_ops`             the TensorFlow / Keras adapters
- :mod:`.loopback`      an in-process cross-server transport (tests)

Importing this package imports neither a framework nor Horovod.
"""

from __future__ import annotations

from .patching import bypass

__all__ = ["bypass"]
