"""The Keras adapter: ``horovod.tensorflow.keras`` with Blink underneath, and a communication callback.

Horovod's Keras API is built on ``horovod.tensorflow`` (its
``DistributedOptimizer`` calls ``hvd._make_allreduce_grads_fn``, its callbacks
``hvd.broadcast_variables`` and ``hvd.allreduce``), so once
:mod:`.tf_ops` has patched that, the callbacks (``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback``, ``LearningRateWarmupCallback``) and the optimizer
run through Blink unchanged.  This module adds two things:

- a clear error under Keras 3: Horovod 0.28 needs ``tf.keras`` to be Keras 2
  (``tf_keras``, selected by ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is
  imported); under Keras 3 its ``DistributedOptimizer`` silently stops
  averaging gradients (seen when building Horovod 0.28.1 here), so Blink
  refuses to run there instead of training divergent replicas;
- :class:`CommunicationCallback`, which logs per epoch how many collectives
  Blink carried, their bytes and their time (from :func:`blink_horovod.stats`),
  available as ``hvd.callbacks.BlinkCommunicationCallback``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .._stats import stats
from ..errors import BlinkError

__all__ = ["CommunicationCallback", "check_legacy_keras", "install"]


def check_legacy_keras(keras: Any) -> None:
    """Raise :class:`BlinkError` if ``tf.keras`` is Keras 3 (Horovod's Keras API needs Keras 2)."""
    version = str(getattr(keras, "__version__", "") or "")
    if version.startswith("3"):
        raise BlinkError(
            f"horovod.tensorflow.keras needs Keras 2 (tf_keras), but tf.keras is Keras {version}: under Keras 3 "
            f"Horovod's DistributedOptimizer silently stops averaging gradients. Set TF_USE_LEGACY_KERAS=1 before "
            f"TensorFlow is first imported (blinkrun sets it when unset; TF_USE_LEGACY_KERAS is now "
            f"{os.environ.get('TF_USE_LEGACY_KERAS', 'unset')!r}) and install tf-keras")


def _make_callback_class(keras: Any) -> type:
    class CommunicationCallback(keras.callbacks.Callback):
        """Logs Blink's communication of each epoch: collectives, bytes, seconds, fallbacks.

        The numbers go into the epoch's ``logs`` (``blink_comm_seconds``,
        ``blink_comm_bytes``, ``blink_collectives``, ``blink_fallbacks``) and,
        with ``verbose`` on rank 0, to stdout.
        """

        def __init__(self, verbose: int = 1) -> None:
            super().__init__()
            self.verbose = verbose
            self._start: dict = {}
            self.history: list[dict] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = stats()

        def on_epoch_end(self, epoch, logs=None):
            now = stats()
            d = {k: now[k] - self._start.get(k, 0) for k in now}
            row = {"epoch": epoch, "blink_comm_seconds": float(d["seconds"]), "blink_comm_bytes": int(d["bytes"]),
                   "blink_collectives": int(d["allreduce"] + d["broadcast"]), "blink_fallbacks": int(d["fallback"])}
            self.history.append(row)
            if logs is not None:
                logs.update({k: v for k, v in row.items() if k != "epoch"})
            if self.verbose and _rank() == 0:
                print(f"[blink] epoch {epoch}: {row['blink_collectives']} collectives, "
                      f"{row['blink_comm_bytes'] / 1e6:.3f} MB in {row['blink_comm_seconds'] * 1e3:.1f} ms; "
                      f"{row['blink_fallbacks']} to stock Horovod", flush=True)

    return CommunicationCallback


def _rank() -> int:
    try:
        import horovod.tensorflow as hvd

        return hvd.rank()
    except Exception:
        return 0


CommunicationCallback: Any = None


def install(module: Any = None) -> None:
    """Check the Keras version and add the callback to ``horovod.tensorflow.keras.callbacks``."""
    global CommunicationCallback
    from tensorflow import keras

    check_legacy_keras(keras)
    if "horovod.tensorflow" in sys.modules:  # normally patched already, by its own import
        from . import tf_ops

        tf_ops.install(sys.modules["horovod.tensorflow"])
    if CommunicationCallback is None:
        CommunicationCallback = _make_callback_class(keras)
    mod = module if module is not None else sys.modules.get("horovod.tensorflow.keras")
    if mod is not None and hasattr(mod, "callbacks"):
        mod.callbacks.BlinkCommunicationCallback = CommunicationCallback
