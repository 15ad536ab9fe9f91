"""blink_horovod: Blink's topology-specific spanning-tree collectives as a Horovod plugin.

Importing this package never imports a framework or Horovod.  See
docs/architecture.md for the layers and docs/formats.md for the
public contracts.
"""

from __future__ import annotations

from ._stats import stats

__version__ = "0.1.0"
__all__ = ["__version__", "stats"]
