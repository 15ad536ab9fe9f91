"""The plan cache: plan once per (topology, collective, root, channels, planner).

A plan is a pure function of the topology's content, the collective, the root,
the channels and the planner's code, so it is cached under ``BLINK_PLAN_CACHE``
(docs/formats.md, Environment variables) in a file named by a hash of exactly those:

- the topology's :meth:`~blink_horovod.topology.model.Topology.content_hash`
  (GPUs, links, switches, PCIe channel; not its name),
- the collective, the root (None for allreduce), the channels (None = "every
  channel the topology has", kept apart from an explicit list),
- the planner's version: ``blink_horovod.__version__`` and a hash of the
  planner package's source files, so that any change to the planner's code
  invalidates every entry it made.

Entries are written atomically (a temporary file in the same folder, then
``os.replace``), so a reader never sees half a plan, and concurrent writers of
one key both leave a whole entry.  An entry that cannot be read, is not a valid
``blink-plan/1`` plan for the topology, or was made for another key is ignored
with a warning and planned again.  A cache folder that cannot be written only
costs the caching (a warning), never the plan.

Looking up a cached plan does not import the planner itself (scipy, HiGHS):
only a miss does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import BlinkError, BlinkInternalError, PlanError
from ..topology.model import Topology
from .plan import CHANNELS, Plan, validate_plan

__all__ = ["ENTRY_FORMAT", "CacheResult", "cache_key", "cached_plan", "get_plan", "lookup_plan", "planner_version", "store_plan"]

log = logging.getLogger(__name__)

ENTRY_FORMAT = "blink-plan-cache/1"
CacheDir = str | os.PathLike[str] | None  # the cache folder; None: BLINK_PLAN_CACHE
_PLANNER_DIR = Path(__file__).resolve().parent
_version_memo: str | None = None


@dataclass(frozen=True)
class CacheResult:
    """A plan and where it came from: ``hit`` is True when read from ``path``."""

    plan: Plan
    path: Path | None
    hit: bool


def planner_version() -> str:
    """``blink_horovod.__version__`` plus a hash of the planner's source files."""
    global _version_memo
    if _version_memo is None:
        digest = hashlib.sha256(__version__.encode())
        for path in sorted(_PLANNER_DIR.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(_PLANNER_DIR).as_posix().encode())
            digest.update(path.read_bytes())
        _version_memo = f"{__version__}+{digest.hexdigest()[:16]}"
    return _version_memo


def _channels(channels: Sequence[str] | None) -> tuple[str, ...] | None:
    """Channels in canonical order; None stays None (the planner's default)."""
    if channels is None:
        return None
    if isinstance(channels, str):
        channels = [c.strip() for c in channels.split(",")]
    chosen = list(channels)
    bad = [c for c in chosen if c not in CHANNELS]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise PlanError(f"channels: expected a non-empty list of distinct channels from {', '.join(CHANNELS)}, got {list(chosen)!r}")
    return tuple(sorted(chosen, key=CHANNELS.index))


def _key_fields(topology: Topology, collective: str, root: int | None, channels: tuple[str, ...] | None) -> dict[str, Any]:
    return {
        "topology": topology.content_hash(),
        "collective": collective,
        "root": root,
        "channels": None if channels is None else list(channels),
        "planner": planner_version(),
    }


def cache_key(
    topology: Topology, collective: str, root: int | None = None, channels: Sequence[str] | None = None
) -> str:
    """The cache key (a hex digest) of one planning request."""
    return _digest(_key_fields(topology, collective, root, _channels(channels)))


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _read(path: Path, fields: dict[str, Any], topology: Topology, collective: str, root: int | None) -> Plan | None:
    """The plan stored at ``path``; None (with a warning if corrupt) when unusable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("plan cache: ignoring unreadable entry %s (%s); planning again", path, exc)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT:
            raise PlanError(f"format: expected {ENTRY_FORMAT!r}")
        if data.get("key") != fields:
            raise PlanError("key: the entry was made for another request")
        plan = Plan.from_dict(data.get("plan"))
        validate_plan(plan, topology)
        if plan.collective != collective or tuple(plan.gpus) != tuple(topology.gpus):
            raise PlanError("plan: collective or GPUs differ from the request")
        if root is not None and plan.root != root:
            raise PlanError(f"root: entry has root {plan.root!r}, request {root!r}")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, BlinkError) as exc:
        log.warning("plan cache: ignoring corrupt entry %s (%s); planning again", path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if plan.topology != topology.name:
        # Same content under another name (a file vs a built-in): say this one.
        plan = dataclasses.replace(plan, topology=topology.name)
    return plan


# A write takes milliseconds; a temporary file older than this is an orphan of a killed writer.
ORPHAN_SECONDS = 60.0


def _sweep_orphans(folder: Path) -> None:
    """Remove temporary files that writers killed mid-write left behind (nothing outlives a job)."""
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > ORPHAN_SECONDS:
                tmp.unlink()
        except OSError:
            pass  # gone already, or not ours to remove


def _write(path: Path, fields: dict[str, Any], plan: Plan) -> bool:
    """Store ``plan`` at ``path`` atomically; False (with a warning) if the folder is not writable."""
    entry = {"format": ENTRY_FORMAT, "key": fields, "plan": plan.to_dict()}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sweep_orphans(path.parent)
        return True
    except OSError as exc:
        log.warning("plan cache: cannot write %s (%s); plan not cached", path, exc)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def _locate(topology: Topology, collective: str, root: int | None, channels: Sequence[str] | None,
            cache_dir: CacheDir) -> tuple[Path, dict[str, Any], tuple[str, ...] | None]:
    chans = _channels(channels)
    if cache_dir is None:
        from ..config import load_config

        cache_dir = load_config().plan_cache
    fields = _key_fields(topology, collective, root, chans)
    return Path(cache_dir) / f"{_digest(fields)}.json", fields, chans


def lookup_plan(topology: Topology, collective: str, root: int | None = None, channels: Sequence[str] | None = None,
                cache_dir: CacheDir = None) -> Plan | None:
    """The cached plan for this request, or None (a corrupt entry warns and counts as none)."""
    path, fields, _ = _locate(topology, collective, root, channels, cache_dir)
    return _read(path, fields, topology, collective, root)


def store_plan(plan: Plan, topology: Topology, collective: str, root: int | None = None,
               channels: Sequence[str] | None = None, cache_dir: CacheDir = None) -> Path | None:
    """Cache ``plan`` as the answer to this request; its path, or None if not writable.

    Raises
    ------
    PlanError
        when ``plan`` is not a valid plan of ``topology`` for ``collective``.
    """
    validate_plan(plan, topology)
    if plan.collective != collective or tuple(plan.gpus) != tuple(topology.gpus):
        raise PlanError(f"plan: a {plan.collective} plan over {list(plan.gpus)} cannot answer {collective} over {list(topology.gpus)}")
    path, fields, _ = _locate(topology, collective, root, channels, cache_dir)
    return path if _write(path, fields, plan) else None


def get_plan(topology: Topology, collective: str, root: int | None = None, channels: Sequence[str] | None = None,
             cache_dir: CacheDir = None) -> CacheResult:
    """:func:`cached_plan`, also saying whether the plan came from the cache."""
    path, fields, chans = _locate(topology, collective, root, channels, cache_dir)
    plan = _read(path, fields, topology, collective, root)
    if plan is not None:
        log.info("plan cache: hit %s", path)
        return CacheResult(plan, path, True)
    try:
        from . import make_plan  # the planner proper, imported on a miss only
    except ImportError as exc:
        raise BlinkInternalError(f"planner: make_plan is not available ({exc})") from None
    plan = make_plan(topology, collective, root, None if chans is None else list(chans))
    stored = _write(path, fields, plan)
    return CacheResult(plan, path if stored else None, False)


def cached_plan(topology: Topology, collective: str, root: int | None = None, channels: Sequence[str] | None = None,
                cache_dir: CacheDir = None) -> Plan:
    """``make_plan(topology, collective, root, channels)``, cached on disk.

    Parameters
    ----------
    topology, collective, root, channels
        As :func:`blink_horovod.planner.make_plan`.
    cache_dir
        The cache folder; default ``BLINK_PLAN_CACHE`` (see
        :mod:`blink_horovod.config`).

    Returns
    -------
    Plan
        The cached plan when a valid entry exists for this request, else a new
        plan (then stored).
    """
    return get_plan(topology, collective, root, channels, cache_dir).plan
