"""Chunk size per message-size bucket: fixed by ``BLINK_CHUNK_BYTES``, else tuned online (MIAD).

Blink (section 4, "Automatic chunk size selection") picks the chunk size
online during the first iterations: multiplicative increase while the
throughput rises, additive decrease after it falls.  The controller is the
schedule layer's :class:`~blink_horovod.schedule.miad.MiadTuner`; this module
runs one per size bucket (the next power of two of the message's bytes) and
feeds it a throughput *every rank agrees on*: each rank puts the throughput of
its previous message of the bucket into the collective's metadata extras,
and the slowest rank's is used, so every rank takes the same step and
compiles the same program.  Only the data-moving part of a collective is
timed (compiling, checking and buffer growth are one-time costs that would
otherwise make every new size look slow).
"""

from __future__ import annotations

from ..schedule.miad import MiadTuner

__all__ = ["DEFAULT_CHUNK_BYTES", "MIN_CHUNK_BYTES", "ChunkChooser", "bucket_of"]

# MIAD starts from the paper's 1 MB (or the whole message, when smaller).
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096


def bucket_of(nbytes: int) -> int:
    """The size bucket of a message: the next power of two of its bytes."""
    return 1 << max(0, int(nbytes - 1).bit_length())


class ChunkChooser:
    """The chunk size of each size bucket, the same on every rank.

    Parameters
    ----------
    fixed_bytes : int, optional
        ``BLINK_CHUNK_BYTES``: always this size (tuning off).
    """

    def __init__(self, fixed_bytes: int | None = None) -> None:
        self.fixed = fixed_bytes
        self._tuners: dict[tuple[str, int], MiadTuner] = {}
        self._last: dict[tuple[str, int], int] = {}  # (kind, bucket) -> chunk bytes of its previous message

    def chunk_bytes(self, nbytes: int, agreed_throughput: float | None, kind: str = "allreduce") -> int:
        """Chunk bytes for a message of ``nbytes`` of collective ``kind``.

        ``agreed_throughput``: the slowest rank's throughput (bytes/s) of the
        previous message of this kind and bucket, None when there is none (or
        it must not count).
        """
        if self.fixed is not None:
            return self.fixed
        size = bucket_of(nbytes)
        bucket = (kind, size)
        tuner = self._tuners.get(bucket)
        if tuner is None:
            cap = max(MIN_CHUNK_BYTES, size)
            tuner = self._tuners[bucket] = MiadTuner(
                start_bytes=min(DEFAULT_CHUNK_BYTES, cap), min_bytes=MIN_CHUNK_BYTES, max_bytes=cap,
                align_bytes=MIN_CHUNK_BYTES, tolerance=0.03,
            )
        elif agreed_throughput is not None and agreed_throughput > 0 and bucket in self._last:
            tuner.observe(self._last[bucket], float(agreed_throughput))
        chunk = tuner.propose()
        self._last[bucket] = chunk
        return chunk

    def converged(self, nbytes: int, kind: str = "allreduce") -> bool:
        """Whether MIAD has settled for this kind and size (always, with a fixed size)."""
        tuner = self._tuners.get((kind, bucket_of(nbytes)))
        return self.fixed is not None or (tuner is not None and tuner.converged)

    def settled(self) -> dict[tuple[str, int], int]:
        """(kind, bucket) -> chunk bytes in use (MIAD's best so far, or the fixed size)."""
        if self.fixed is not None:
            return {b: self.fixed for b in self._last}
        return {b: t.best if t.history else t.propose() for b, t in self._tuners.items()}
