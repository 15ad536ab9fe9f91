"""A small progress bar on stderr (no dependency): ``[#####.....] 120/362  40s, ~60s left  dgx1v:0,1,4``.

On a terminal it redraws one line; otherwise (a log, CI) it prints a line
every tenth of the way, so long sweeps still show that they move.
"""

from __future__ import annotations

import sys
import time
from typing import Self, TextIO

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, "sweep") as p: ... p.advance(label)``."""

    def __init__(self, total: int, title: str = "", stream: TextIO | None = None, enabled: bool = True, width: int = 28) -> None:
        self.total = max(0, int(total))
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.total > 0
        self.width = width
        self.done = 0
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_line = 0
        self._last_len = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, label: str) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self.width)
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        head = f"{self.title} " if self.title else ""
        return f"{head}[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}  {elapsed:.0f}s, ~{left:.0f}s left  {label}"

    def advance(self, label: str = "", n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        if self._tty:
            line = self._line(label)
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
            self.stream.flush()
        elif self.done >= self._next_line or self.done == self.total:
            self.stream.write(self._line(label) + "\n")
            self.stream.flush()
            self._next_line = self.done + max(1, self.total // 10)

    def close(self) -> None:
        if self.enabled and self._tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
