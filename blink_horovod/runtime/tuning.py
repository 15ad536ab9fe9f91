"""Chunk size per message-size bucket: fixed by ``BLINK_CHUNK_BYTES``, else tuned online (MIAD).

Blink (section 4, "chunk size") picks the chunk size online with a
multiplicative-increase, additive-decrease search during the first
iterations: larger chunks amortise per-chunk costs, smaller ones fill the
pipeline sooner.  The search itself is the schedule layer's
(:mod:`blink_horovod.schedule.miad`); this module only feeds it, per size
bucket (the next power of two of the message's bytes), with a time *every
rank agrees on*: each rank puts its last measured time into the collective's
metadata extras and the slowest rank's time is used, so every rank takes the
same decision and compiles the same program.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger("blink_horovod.runtime")

__all__ = ["ChunkChooser", "bucket_of", "DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES"]

# Without a tuner: 1 MiB, the paper's MIAD starting point.  Python's cost per
# chunk operation (~10 us) stays small against a 1 MiB copy (~100 us).
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096


def bucket_of(nbytes: int) -> int:
    """The size bucket of a message: the next power of two of its bytes."""
    return 1 << max(0, int(nbytes - 1).bit_length())


def _load_miad() -> Any | None:
    try:
        return importlib.import_module("blink_horovod.schedule.miad")
    except ImportError:
        return None


class ChunkChooser:
    """The chunk size of each size bucket, the same on every rank.

    Parameters
    ----------
    fixed_bytes : int, optional
        ``BLINK_CHUNK_BYTES``: always this size (tuning off).
    """

    def __init__(self, fixed_bytes: int | None = None) -> None:
        self.fixed = fixed_bytes
        self._tuners: dict[int, Any] = {}
        self._chosen: dict[int, int] = {}
        self._miad = None if fixed_bytes is not None else _load_miad()

    def chunk_bytes(self, nbytes: int, agreed_seconds: float | None) -> int:
        """Chunk bytes for a message of ``nbytes``; ``agreed_seconds`` is the slowest
        rank's time of the previous message of this bucket (None for the first)."""
        if self.fixed is not None:
            return self.fixed
        bucket = bucket_of(nbytes)
        tuner = self._tuners.get(bucket)
        if self._miad is None:
            return self._chosen.setdefault(bucket, DEFAULT_CHUNK_BYTES)
        if tuner is None:
            tuner = self._tuners[bucket] = self._new_tuner(bucket)
            if tuner is None:
                return self._chosen.setdefault(bucket, DEFAULT_CHUNK_BYTES)
        elif agreed_seconds is not None and agreed_seconds > 0:
            tuner.observe(bucket / agreed_seconds)
        return max(MIN_CHUNK_BYTES, int(tuner.current()))

    def _new_tuner(self, bucket: int) -> Any | None:
        factory = getattr(self._miad, "MIAD", None) or getattr(self._miad, "MiadTuner", None)
        if factory is None:
            return None
        try:
            return factory(start=min(DEFAULT_CHUNK_BYTES, bucket))
        except TypeError:  # pragma: no cover - interface drift; keep working without tuning
            log.info("MIAD tuner has an unexpected interface; using %d-byte chunks", DEFAULT_CHUNK_BYTES)
            return None

    def settled(self) -> dict[int, int]:
        """Bucket -> chunk bytes in use (kept with the plan by the communicator)."""
        out = dict(self._chosen)
        for bucket, tuner in self._tuners.items():
            if tuner is not None:  # None: no MIAD tuner could be made, the default size is in _chosen
                out[bucket] = int(tuner.current())
        return out
