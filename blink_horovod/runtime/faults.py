"""Fault injection for the reliability tests: ``BLINK_FAULT=ACTION:after=K[:rank=R]``.

Every fault must end in a clear error, never a hang; to prove it,
the tests make the runtime fail on purpose, at a chosen chunk operation of a
chosen rank, through this hook (used only by tests; unset, it costs one
attribute test per chunk).

``ACTION`` is one of

``kill``     the rank SIGKILLs itself (a crash: no cleanup code runs),
``raise``    the rank raises ``BlinkInternalError`` (an error in one rank),
``stall``    the rank stops (sleeps) until a peer gives up on it, or
             ``seconds=S`` pass (default 3600),
``corrupt``  the rank flips one bit of the chunk it just received (wrong data,
             which ``blink perf -c`` must count).

``after=K``: the fault acts at this rank's (K+1)-th chunk operation (a copy
or reduce) since the process started, i.e. after K completed ones; ``kill``,
``raise`` and ``stall`` act instead of it, ``corrupt`` after it.  ``rank=R``
(a local rank) limits it to one rank; without it every rank faults.  It fires
once per process; ``corrupt:...:count=N`` corrupts the N consecutive chunk
operations from there (``blink perf`` checks only one step after its timed
ones, as nccl-tests does, so a test that cannot know which chunk operation
falls in that step corrupts them all).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from ..config import BLINK_FAULT
from ..errors import BlinkInternalError, ConfigError
from ..units import parse_number

__all__ = ["FAULT_ACTIONS", "FaultInjector", "FaultSpec", "parse_fault"]

FAULT_ACTIONS = ("kill", "raise", "stall", "corrupt")


@dataclass(frozen=True)
class FaultSpec:
    action: str
    after: int
    rank: int | None = None
    seconds: float = 3600.0
    count: int = 1  # corrupt: this many consecutive chunk operations


def parse_fault(text: str) -> FaultSpec:
    """Parse ``"kill:after=3:rank=1"``; bad input raises ConfigError naming BLINK_FAULT."""
    parts = [p.strip() for p in str(text).strip().split(":")]
    action = parts[0].lower()
    if action not in FAULT_ACTIONS:
        raise ConfigError(f"{BLINK_FAULT}: unknown action {parts[0]!r} in {text!r} (expected one of {', '.join(FAULT_ACTIONS)})")
    fields: dict[str, str] = {}
    for p in parts[1:]:
        key, sep, value = p.partition("=")
        if not sep or key not in ("after", "rank", "seconds", "count") or key in fields:
            raise ConfigError(f"{BLINK_FAULT}: bad field {p!r} in {text!r} (expected after=K, rank=R, seconds=S, count=N)")
        fields[key] = value
    if "after" not in fields:
        raise ConfigError(f"{BLINK_FAULT}: missing after=K in {text!r}")

    def _int(key: str) -> int:
        return parse_number(fields[key], f"{BLINK_FAULT}: {key}", int, "a non-negative integer", lambda v: v >= 0)

    seconds = 3600.0
    if "seconds" in fields:
        seconds = parse_number(fields["seconds"], f"{BLINK_FAULT}: seconds", float, "a finite number >= 0",
                               lambda v: math.isfinite(v) and v >= 0)
    count = _int("count") if "count" in fields else 1
    if count < 1:
        raise ConfigError(f"{BLINK_FAULT}: count must be a positive integer, got {fields['count']!r}")
    return FaultSpec(action, _int("after"), _int("rank") if "rank" in fields else None, seconds, count)


class FaultInjector:
    """Counts this rank's chunk operations and fires the fault at the chosen one.

    ``peer_failed`` (from the executor) lets a stalled rank notice that its
    peers gave up, so that the stall ends in their error, not in a hang.
    """

    def __init__(self, spec: FaultSpec, rank: int, peer_failed: Callable[[], bool] | None = None) -> None:
        self.spec = spec
        self.active = spec.rank is None or spec.rank == rank
        self.rank = rank
        self.done = 0
        self.fired = False
        self.peer_failed = peer_failed or (lambda: False)

    @classmethod
    def from_config(cls, fault: str | None, rank: int, peer_failed: Callable[[], bool] | None = None) -> FaultInjector | None:
        if not fault:
            return None
        return cls(parse_fault(fault), rank, peer_failed)

    def before_op(self) -> None:
        """Called before each chunk operation."""
        if not self.active or self.fired or self.done != self.spec.after:
            return
        action = self.spec.action
        if action == "kill":
            self.fired = True
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            self.fired = True
            raise BlinkInternalError(f"fault injected by {BLINK_FAULT}: rank {self.rank} raised at chunk op {self.done + 1}")
        elif action == "stall":
            self.fired = True
            end = time.monotonic() + self.spec.seconds
            while time.monotonic() < end and not self.peer_failed():
                time.sleep(0.05)

    def after_op(self, region: np.ndarray) -> None:
        """Called after each chunk operation with the region it wrote."""
        self.done += 1
        spec = self.spec
        if self.active and not self.fired and spec.action == "corrupt" and spec.after < self.done <= spec.after + spec.count:
            self.fired = self.done == spec.after + spec.count
            if region.size:
                # Flip a high-order bit of the first element (an exponent bit of a float):
                # a flipped lowest mantissa bit can be rounded away by the next reduction
                # (3.0000002 + 3 == 6.0 in float32), and then no check could see it.
                top = region.itemsize - 1 if sys.byteorder == "little" else 0
                region.view(np.uint8)[top : top + 1] ^= np.uint8(0x40)
