"""Sizes and rates as nccl-tests writes them, and the numbers of options and variables.

Sizes take the suffixes K, M, G (2**10, 2**20, 2**30 bytes); rates are GB/s
(10**9 bytes/s), as in docs/formats.md, Commands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

__all__ = ["GB", "format_size", "parse_number", "parse_size"]

GB = 1e9  # bytes per GB (rates are decimal, as nccl-tests reports them)

_SUFFIX = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_number(text: Any, field: str, kind: Callable[[str], Any] = int, expected: str = "an integer",
                 ok: Callable[[Any], bool] = lambda value: True) -> Any:
    """``text`` as a number of ``kind`` (``int`` or ``float``) that ``ok`` accepts; else ConfigError
    ``"<field>: expected <expected>, got <text>"``.

    >>> parse_number(" 3 ", "-n", ok=lambda v: v >= 1)
    3
    """
    try:
        value = kind(str(text).strip())
    except ValueError:
        raise ConfigError(f"{field}: expected {expected}, got {text!r}") from None
    if not ok(value):
        raise ConfigError(f"{field}: expected {expected}, got {text!r}")
    return value


def parse_size(text: str | int, field: str = "size") -> int:
    """Parse ``"64M"`` into 67108864 bytes; ``field`` names the value in errors.

    >>> parse_size("1K"), parse_size("64M"), parse_size(8)
    (1024, 67108864, 8)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{field}: size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{field}: not a size (use e.g. 8, 1K, 64M, 1G): {text!r}")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value != int(value):
        raise ConfigError(f"{field}: size is not a whole number of bytes: {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """Shortest exact K/M/G spelling of ``n`` bytes (``67108864 -> '64M'``).

    >>> format_size(1024), format_size(3), format_size(2**30)
    ('1K', '3', '1G')
    """
    for suffix, mult in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)
