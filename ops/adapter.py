"""What the PyTorch and TensorFlow adapters share: Blink's life between ``hvd.init`` and ``hvd.shutdown``.

Each adapter (:mod:`.torch_ops`, :mod:`.tf_ops`) keeps one :class:`Adapter`
for its Horovod package and leaves to it, written once here:

- ``init``: stock ``hvd.init`` first (with the process sets Blink's
  cross-server stage needs, noting the threads Horovod starts so that they
  can be kept idle while a Blink collective runs), then the Blink context
  for the job (:func:`.context.create_context`), or the reason Blink stays
  out, after which stock Horovod runs every collective;
- ``shutdown``: the context closed before stock ``hvd.shutdown`` (and on
  exit), so ``init``/``shutdown`` cycles leave nothing behind;
- what decides whether a call can be Blink's at all: a live context, the
  whole job as process set, no timeline recording.

Only the tensors (and how the cross-server stage calls Horovod) differ
between frameworks; those stay in the adapters.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..config import Config, load_config
from .background import forget as forget_threads
from .background import noting_new_threads
from .context import (
    BlinkContext,
    add_missing_sets,
    create_context,
    cross_sets_after_init,
    plan_init,
)
from .hierarchical import CrossTransport
from .patching import bypass

__all__ = ["Adapter", "StockView"]

log = logging.getLogger("blink_horovod.ops")


class StockView:
    """A stock Horovod package as :class:`.context.HorovodView` (``allgather_object`` bypasses Blink)."""

    def __init__(self, m: Any, allgather_object: Callable[..., Any]) -> None:
        self.m = m
        self._allgather_object = allgather_object

    def rank(self) -> int:
        return self.m.rank()

    def size(self) -> int:
        return self.m.size()

    def local_rank(self) -> int:
        return self.m.local_rank()

    def local_size(self) -> int:
        return self.m.local_size()

    def is_homogeneous(self) -> bool:
        return bool(self.m.is_homogeneous())

    def allgather_object(self, obj: Any) -> Any:
        with bypass():
            return self._allgather_object(obj, name="blink.setup")


class Adapter:
    """One framework's Blink state: the context, why Blink stays out, whether the timeline records."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.ctx: BlinkContext | None = None
        self.reason = "hvd.init() has not been called"
        self.recording = False
        self.cross_sets: dict[tuple[int, ...], Any] = {}
        self._atexit_registered = False

    def context(self) -> BlinkContext | None:
        """The live Blink context (None before ``init`` or when Blink stays out)."""
        return self.ctx

    def disabled_reason(self) -> str:
        """Why Blink is not carrying collectives right now ("" when it is)."""
        return "" if self.ctx is not None else self.reason

    def pset_key(self, process_set: Any) -> tuple[int, ...] | None:
        """() for the whole job, None for a process set Blink leaves to Horovod."""
        if process_set is None or getattr(process_set, "process_set_id", None) == 0:
            return ()
        ranks = getattr(process_set, "ranks", None)
        if ranks is not None and self.ctx is not None and sorted(ranks) == list(range(self.ctx.layout.size)):
            return ()
        return None

    def replacements(self, original: Callable[[str], Any]) -> dict[str, Callable[..., Any]]:
        """The functions every adapter replaces alike: the timeline switches and ``shutdown``.

        ``original(name)`` is stock Horovod's function of that name.  While the
        timeline records, stock Horovod runs every collective (it draws them).
        """

        def start_timeline(file_path, mark_cycles=False):
            result = original("start_timeline")(file_path, mark_cycles)
            self.recording = True
            return result

        def stop_timeline():
            result = original("stop_timeline")()
            self.recording = False
            return result

        def shutdown(*args, **kwargs):
            """``hvd.shutdown()``: Blink's context first, then stock Horovod's."""
            self.close()
            forget_threads()
            return original("shutdown")(*args, **kwargs)

        return {"start_timeline": start_timeline, "stop_timeline": stop_timeline, "shutdown": shutdown}

    def init(self, orig_init: Callable[..., Any], m: Any, args: tuple, kwargs: dict, view: StockView,
             make_cross: Callable[[dict, Config], CrossTransport],
             make_devices: Callable[[Any], Any] | None = None) -> Any:
        """``hvd.init(comm=None, process_sets=None)`` with Blink underneath.

        ``m`` is the framework's ``mpi_ops`` module; ``make_cross(sets,
        config)`` builds the cross-server stage over the process sets;
        ``make_devices(context)`` the engine's GPU stages (adapters that carry
        GPU tensors).
        """
        with self.lock:
            if self.ctx is not None and m.is_initialized():
                return orig_init(*args, **kwargs)
            if self.ctx is not None:  # Horovod was shut down behind our back (its atexit): start afresh
                self.close()
            comm = args[0] if len(args) > 0 else kwargs.get("comm")
            process_sets = args[1] if len(args) > 1 else kwargs.get("process_sets")
            cfg = load_config()
            plan = plan_init(m.ProcessSet, comm, process_sets)
            with noting_new_threads():  # Horovod's background thread: idle during Blink's collectives
                orig_init(comm, process_sets=plan.process_sets)
            timeline = os.environ.get("HOROVOD_TIMELINE")
            self.recording = bool(timeline) and timeline != "DYNAMIC"
            if plan.custom_comm:
                self.reason = "hvd.init(comm=...) with a custom communicator"
                return None
            self.cross_sets.clear()
            self.cross_sets.update(cross_sets_after_init(plan))

            def cross_factory(layout):
                if not add_missing_sets(layout, self.cross_sets, m.add_process_set,
                                        getattr(m, "global_process_set", None)):
                    return None
                return make_cross(self.cross_sets, cfg)

            self.ctx, self.reason = create_context(view, cross_factory, cfg)
            if self.ctx is not None and make_devices is not None:
                self.ctx.engine.devices = make_devices(self.ctx)
            if self.ctx is None:
                log.warning("blink: Blink stays out of this job, stock Horovod runs every collective: %s", self.reason)
            if not self._atexit_registered:
                atexit.register(self.close)
                self._atexit_registered = True
            return None

    def close(self) -> None:
        """Close the Blink context (idempotent)."""
        with self.lock:
            ctx, self.ctx = self.ctx, None
            self.reason = "Horovod has been shut down"
        if ctx is not None:
            ctx.close()
