"""What the ``blink`` subcommands share: reading a topology, writing output.

Both turn the operating system's complaints (a missing or unreadable file, a
folder that cannot be written) into one-line errors that name the flag and the
value (docs/formats.md, Commands: bad input is one line on stderr, exit code 2).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError, TopologyError
from ..topology.model import Topology

__all__ = ["load_topology", "positive_gbps", "write_output"]


def load_topology(spec: str, gpus: str | Sequence[int] | None = None, flag: str = "--topology") -> Topology:
    """:func:`~blink_horovod.topology.resolve`, with file errors as :class:`TopologyError`."""
    from ..topology import resolve

    try:
        return resolve(spec, gpus)
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise TopologyError(f"{flag}: cannot read {spec!r}: {reason}") from None
    except RecursionError:
        raise TopologyError(f"{flag}: {spec!r} is nested too deeply to be a topology") from None


def write_output(text: str, path: str | None, flag: str = "--output") -> None:
    """Write ``text`` to stdout, or atomically to ``path`` (temp file + ``os.replace``)."""
    if path is None or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".", prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write {path!r}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def positive_gbps(flag: str):
    """An argparse ``type=`` that accepts a positive, finite number of GB/s."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number of GB/s, got {text!r}")  # argparse names the flag
        return value

    parse.__name__ = flag
    return parse
