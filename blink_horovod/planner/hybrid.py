"""The hybrid split between channels (Blink, section 3.4).

Blink sends part of the bytes over PCIe while NVLink carries the rest and
picks the split that minimises ``max(T_pcie, T_nvlink)``.  With channel rates
``R_c`` (each channel's own packing; the channels are separate hardware), a
share ``f_c`` takes ``T_c = S f_c / R_c``; the max is smallest when every
``T_c`` is equal, i.e. ``f_c = R_c / sum R``, and the plan then runs at
``sum R``.  (Blink also subtracts the measured cost of toggling peer access;
that is a latency and the bandwidth model here has none.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import PlanError

__all__ = ["channel_shares", "hybrid_rate"]


def channel_shares(rates: Mapping[str, float]) -> dict[str, float]:
    """Byte share per channel, proportional to the channel rates (GB/s).

    Examples
    --------
    >>> channel_shares({"nvlink": 150.0, "pcie": 12.0})["pcie"]
    0.07407407407407407
    """
    total = math.fsum(rates.values())
    if not rates or total <= 0:
        raise PlanError(f"channels: no channel can move data (rates {dict(rates)})")
    return {ch: r / total for ch, r in rates.items()}


def hybrid_rate(rates: Mapping[str, float]) -> float:
    """The rate of the best split: the channels' rates added up."""
    return math.fsum(rates.values())
