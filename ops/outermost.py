"""A process-wide change made by the first of overlapping holders and undone by the last to leave.

Blink collectives of several communicators, or of several threads, may overlap in one
process; a setting changed for "while a Blink collective runs" (:mod:`.mpi_yield`,
:mod:`.background`) must therefore be made by the outermost entry and put back by the
last exit, not by each collective.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Outermost"]


class Outermost:
    """Counts the holders; :meth:`held` calls ``enter`` when the count leaves 0 and ``leave``
    when it returns to 0 (also when the body raises)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.depth = 0

    @contextmanager
    def held(self, enter: Callable[[], None], leave: Callable[[], None]) -> Iterator[None]:
        with self._lock:
            if self.depth == 0:
                enter()
            self.depth += 1
        try:
            yield
        finally:
            with self._lock:
                self.depth -= 1
                if self.depth == 0:
                    leave()
