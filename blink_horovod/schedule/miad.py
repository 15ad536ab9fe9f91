"""MIAD chunk-size tuning: multiplicative increase, additive decrease.

Blink (Wang et al., MLSys 2020), section 4, "Automatic chunk size selection":
the best chunk size balances pipelining (small chunks fill the trees sooner)
against the fixed cost of each chunk's CUDA operations, and depends on the data
size, the number of trees and their depth, so Blink explores it during the
first iterations: it *increases the chunk size multiplicatively while the
throughput rises and decreases it additively after the throughput falls*.  In
the paper a four-GPU broadcast stabilised after four iterations, starting at
1 MB with 2x steps.

:class:`MiadTuner` is the controller, one measurement at a time
(``propose()`` / ``observe()``), so the runtime can feed it the throughput of
real collectives as training runs; :func:`tune` drives it with any measuring
callable (the simulator, or a benchmark loop).

The walk, for throughput ``f(x)`` of chunk size ``x``:

1. increase: ``x, factor*x, factor^2*x, ...`` while ``f`` rises by more than
   ``tolerance`` (relative) over the previous size;
2. at the first size where it does not, decrease from that size additively
   (``x - d, x - 2d, ...``) while ``f`` keeps rising, never going back to or
   below the last size of the increase phase, which is already measured;
3. converge on the best size measured.

Sizes are kept within ``[min_bytes, max_bytes]`` and to multiples of
``align_bytes``.  After convergence ``propose()`` returns the best size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = ["MiadTuner", "tune"]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected a positive integer number of bytes, got {value!r}")
    return value


class MiadTuner:
    """Chunk-size controller (see the module docstring).

    Parameters
    ----------
    start_bytes : int
        First size proposed (paper: 1 MB).
    factor : float
        Multiplicative increase (> 1; paper: 2).
    decrease_bytes : int, optional
        Additive decrease; default ``start_bytes``.
    min_bytes, max_bytes : int
        Bounds of the sizes proposed.
    tolerance : float
        Relative gain that counts as "throughput rises" (noise guard).
    align_bytes : int
        Proposed sizes are multiples of this (e.g. the element size).

    Examples
    --------
    >>> t = MiadTuner(start_bytes=1 << 20)
    >>> curve = {1: 10.0, 2: 14.0, 4: 16.0, 8: 15.0}
    >>> while not t.converged:
    ...     x = t.propose()
    ...     t.observe(x, curve.get(x >> 20, 15.5))
    >>> [x >> 20 for x, _ in t.history]  # 8 MB fell, 7 MB rose again, 6 MB did not
    [1, 2, 4, 8, 7, 6]
    >>> t.best >> 20
    4
    """

    def __init__(
        self,
        start_bytes: int = 1 << 20,
        factor: float = 2.0,
        decrease_bytes: int | None = None,
        min_bytes: int = 4 << 10,
        max_bytes: int = 1 << 30,
        tolerance: float = 0.01,
        align_bytes: int = 1,
    ) -> None:
        self.min_bytes = _positive_int(min_bytes, "min_bytes")
        self.max_bytes = _positive_int(max_bytes, "max_bytes")
        if self.max_bytes < self.min_bytes:
            raise ConfigError(f"max_bytes: {max_bytes} is below min_bytes {min_bytes}")
        self.align_bytes = _positive_int(align_bytes, "align_bytes")
        start = _positive_int(start_bytes, "start_bytes")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 1:
            raise ConfigError(f"factor: expected a number above 1, got {factor!r}")
        self.factor = float(factor)
        self.decrease_bytes = start if decrease_bytes is None else _positive_int(decrease_bytes, "decrease_bytes")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (0 <= tolerance < 1):
            raise ConfigError(f"tolerance: expected a number in [0, 1), got {tolerance!r}")
        self.tolerance = float(tolerance)
        self.start_bytes = self._clamp(start)
        self.reset()

    # -- state -----------------------------------------------------------
    def reset(self) -> None:
        """Start over (e.g. after the message size or the topology changed)."""
        self.history: list[tuple[int, float]] = []
        self.phase = "increase"  # increase -> decrease -> converged
        self._next = self.start_bytes
        self._floor = 0  # the decrease phase stays above this (already measured)
        self._best: tuple[int, float] | None = None

    @property
    def converged(self) -> bool:
        return self.phase == "converged"

    @property
    def best(self) -> int:
        """The best size measured so far (``start_bytes`` before any)."""
        return self.start_bytes if self._best is None else self._best[0]

    @property
    def best_throughput(self) -> float | None:
        return None if self._best is None else self._best[1]

    def _clamp(self, x: float) -> int:
        a = self.align_bytes
        lo = -(-self.min_bytes // a) * a
        hi = max(lo, self.max_bytes // a * a)
        return int(min(hi, max(lo, int(x) // a * a)))

    # -- the controller ----------------------------------------------------
    def propose(self) -> int:
        """The chunk size (bytes) to run next."""
        return self.best if self.converged else self._next

    def observe(self, chunk_bytes: int, throughput: float) -> None:
        """Feed the throughput (any unit, higher is better) measured with ``chunk_bytes``."""
        x = _positive_int(chunk_bytes, "chunk_bytes")
        if isinstance(throughput, bool) or not isinstance(throughput, (int, float)) or not math.isfinite(throughput) or throughput < 0:
            raise ConfigError(f"throughput: expected a finite non-negative number, got {throughput!r}")
        t = float(throughput)
        prev = self.history[-1] if self.history else None
        self.history.append((x, t))
        if self._best is None or t > self._best[1]:
            self._best = (x, t)
        if self.converged:
            return
        rising = prev is None or t > prev[1] * (1 + self.tolerance)
        if self.phase == "increase":
            if rising:
                nxt = self._clamp(x * self.factor)
                if nxt <= x:  # at max_bytes: nothing larger to try
                    self.phase = "converged"
                else:
                    self._next = nxt
                return
            # It fell (or stopped rising): walk back down from here, above the last good size.
            self.phase = "decrease"
            self._floor = prev[0] if prev is not None else 0
            self._step_down(x)
            return
        # decrease phase
        if rising:
            self._step_down(x)
        else:
            self.phase = "converged"

    def _step_down(self, x: int) -> None:
        nxt = self._clamp(x - self.decrease_bytes)
        if nxt <= self._floor or nxt >= x:
            self.phase = "converged"
        else:
            self._next = nxt


def tune(measure: Callable[[int], float], *, max_iters: int = 32, **settings: Any) -> tuple[int, list[tuple[int, float]]]:
    """Run MIAD against ``measure(chunk_bytes) -> throughput`` until it converges.

    ``settings`` are :class:`MiadTuner`'s (``start_bytes``, ``factor``, ...);
    at most ``max_iters`` measurements.

    Returns
    -------
    (best, history)
        The best chunk size and every ``(chunk_bytes, throughput)`` measured,
        in order; ``len(history)`` is the number of iterations MIAD took.
    """
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
        raise ConfigError(f"max_iters: expected a positive integer, got {max_iters!r}")
    t = MiadTuner(**settings)
    for _ in range(max_iters):
        if t.converged:
            break
        x = t.propose()
        t.observe(x, float(measure(x)))
    return t.best, list(t.history)
