"""Every ``BLINK_*`` environment variable, read and validated in one place.

The launcher (``blinkrun --blink-*``) maps its flags one-to-one onto the
user-facing names among these (``LAUNCHER_FLAGS``; tuning and test switches
have no flag), in the manner of Horovod's
``runner/common/util/config_parser.py``.  An invalid value raises
:class:`~blink_horovod.errors.ConfigError` naming the variable and the value.
See docs/formats.md, Environment variables for the contract.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .units import parse_number, parse_size

__all__ = [
    "ALL_VARIABLES",
    "BLINK_BACKGROUND_IDLE",
    "BLINK_CHUNK_BYTES",
    "BLINK_EAGER_BYTES",
    "BLINK_ENABLE",
    "BLINK_FAULT",
    "BLINK_GPU_SM_SHARE",
    "BLINK_LOCAL_SIZE",
    "BLINK_LOG_LEVEL",
    "BLINK_MPI_YIELD",
    "BLINK_PLAN_CACHE",
    "BLINK_STALL_CHECK_SECONDS",
    "BLINK_STREAM_COPY",
    "BLINK_TIMEOUT_SECONDS",
    "BLINK_TOPOLOGY",
    "LAUNCHER_FLAGS",
    "Config",
    "load_config",
]

BLINK_ENABLE = "BLINK_ENABLE"
BLINK_TOPOLOGY = "BLINK_TOPOLOGY"
BLINK_LOCAL_SIZE = "BLINK_LOCAL_SIZE"
BLINK_CHUNK_BYTES = "BLINK_CHUNK_BYTES"
BLINK_PLAN_CACHE = "BLINK_PLAN_CACHE"
BLINK_TIMEOUT_SECONDS = "BLINK_TIMEOUT_SECONDS"
BLINK_STALL_CHECK_SECONDS = "BLINK_STALL_CHECK_SECONDS"
BLINK_LOG_LEVEL = "BLINK_LOG_LEVEL"
# Fault injection for the reliability tests only (see runtime.faults):
# "ACTION:after=K[:rank=R]" with ACTION in kill, raise, stall, corrupt.
BLINK_FAULT = "BLINK_FAULT"
# While the ops layer runs a Blink CPU collective, the Open MPI already loaded in the process (Horovod's MPI
# controller) yields the CPU when its polling finds nothing to do, as under mpi_yield_when_idle, and
# goes back to its own setting afterwards: Horovod's background thread keeps polling its 1 ms
# coordination allreduce during Blink's collectives, and without this it spins on the cores Blink's
# ranks need (ops/mpi_yield.py, docs/benchmarks.md).  1 (default) or 0 (leave Open MPI alone).
BLINK_MPI_YIELD = "BLINK_MPI_YIELD"
# While the ops layer runs a Blink CPU collective, the threads Horovod's init started (its background thread, the MPI
# library's threads) run at SCHED_IDLE, and get their policy back afterwards; only where the process may
# give it back (CAP_SYS_NICE or RLIMIT_NICE >= 20, probed once), else never touched
# (ops/background.py).  1 (default) or 0.
BLINK_BACKGROUND_IDLE = "BLINK_BACKGROUND_IDLE"
# The CPU runtime's large chunk copies (staging into the shared segment, results into the caller's tensor)
# use streaming stores from a small C function compiled on first use (runtime/streamcopy.py): a plain copy
# reads each destination line before writing it, a streamed one does not, and the CPU runtime is bound by
# memory bandwidth.  1 (default; numpy's copies where no C compiler is found) or 0 (numpy's copies).
BLINK_STREAM_COPY = "BLINK_STREAM_COPY"
# The share of each GPU's thread-block slots that the tree kernels of the ranks on it take together
# (0 < share <= 1).  A tree kernel's blocks spin on their peers' flags while resident, so where compute
# kernels run beside the collectives (a backward pass overlapping its gradients' allreduces), a smaller
# share leaves them SMs, as NCCL's channel limits do.  Unset: 1 (all, the most memory parallelism), but
# 0.5 for CUDA tensors under Horovod where ranks share a GPU: there a rank's spinning blocks must leave
# SMs free for its peers' compute kernels, which its peers' collectives may be queued behind.
BLINK_GPU_SM_SHARE = "BLINK_GPU_SM_SHARE"
# Under Horovod, in a single-server job: each rank's proposal in the round that agrees on what runs next
# (ops/negotiation.py) also carries the inputs of its queued CPU allreduces, up to this many bytes in
# all; a round that runs only such allreduces reduces them there, every rank in the same rank order, and
# needs no data round of its own.  A size (default 4K; 0: never).
BLINK_EAGER_BYTES = "BLINK_EAGER_BYTES"

ALL_VARIABLES = (
    BLINK_ENABLE,
    BLINK_TOPOLOGY,
    BLINK_LOCAL_SIZE,
    BLINK_CHUNK_BYTES,
    BLINK_PLAN_CACHE,
    BLINK_TIMEOUT_SECONDS,
    BLINK_STALL_CHECK_SECONDS,
    BLINK_LOG_LEVEL,
    BLINK_FAULT,
    BLINK_MPI_YIELD,
    BLINK_BACKGROUND_IDLE,
    BLINK_STREAM_COPY,
    BLINK_GPU_SM_SHARE,
    BLINK_EAGER_BYTES,
)

# blinkrun flag -> variable (one-to-one, as Horovod's launcher argument groups).
LAUNCHER_FLAGS = {
    "--blink-topology": BLINK_TOPOLOGY,
    "--blink-chunk-bytes": BLINK_CHUNK_BYTES,
    "--blink-timeout": BLINK_TIMEOUT_SECONDS,
    "--blink-stall-check": BLINK_STALL_CHECK_SECONDS,
    "--blink-log-level": BLINK_LOG_LEVEL,
    "--blink-local-size": BLINK_LOCAL_SIZE,
    "--blink-plan-cache": BLINK_PLAN_CACHE,
}

LOG_LEVELS = ("warning", "info", "debug")
DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_STALL_CHECK_SECONDS = 60.0
DEFAULT_EAGER_BYTES = 4096
MAX_EAGER_BYTES = 16384  # the proposals travel in the runtime's 64 KB metadata slots


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blink_horovod" / "plans"


@dataclass(frozen=True)
class Config:
    """The validated values of every ``BLINK_*`` variable."""

    enable: bool = False
    topology: str | None = None
    local_size: int | None = None
    chunk_bytes: int | None = None
    plan_cache: Path = _default_cache()
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    stall_check_seconds: float = DEFAULT_STALL_CHECK_SECONDS
    log_level: str = "warning"
    fault: str | None = None
    mpi_yield: bool = True
    background_idle: bool = True
    stream_copy: bool = True
    gpu_sm_share: float | None = None  # None: automatic (runtime/gpu/tree_executor.py, OVERLAP_SHARE)
    eager_bytes: int = DEFAULT_EAGER_BYTES


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}: expected 1 or 0, got {env[name]!r}")


def env_number(env: Mapping[str, str], name: str, kind: Callable[[str], Any], expected: str,
               ok: Callable[[Any], bool], default: Any = None) -> Any:
    """The variable ``name`` of ``env`` as :func:`~blink_horovod.units.parse_number` reads it;
    ``default`` where it is unset or blank."""
    raw = env.get(name, "").strip()
    return parse_number(raw, name, kind, expected, ok) if raw else default


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    return env_number(env, name, int, "a positive integer", lambda v: v > 0)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return env_number(env, name, float, "seconds (a positive number)", lambda v: math.isfinite(v) and v > 0, default)


def _fault(env: Mapping[str, str]) -> str | None:
    """``BLINK_FAULT``, validated here so a typo fails at start, not at the first collective."""
    raw = env.get(BLINK_FAULT, "").strip() or None
    if raw is not None:
        from .runtime.faults import parse_fault  # pure parsing; no runtime state

        parse_fault(raw)
    return raw


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Read and validate every ``BLINK_*`` variable of ``env`` (default ``os.environ``).

    Raises
    ------
    ConfigError
        naming the variable and its value, for any invalid setting.
    """
    env = os.environ if env is None else env
    chunk_raw = env.get(BLINK_CHUNK_BYTES, "").strip()
    chunk = parse_size(chunk_raw, BLINK_CHUNK_BYTES) if chunk_raw else None
    if chunk is not None and chunk <= 0:
        raise ConfigError(f"{BLINK_CHUNK_BYTES}: expected a positive size, got {chunk_raw!r}")
    level = env.get(BLINK_LOG_LEVEL, "").strip().lower() or "warning"
    if level not in LOG_LEVELS:
        raise ConfigError(f"{BLINK_LOG_LEVEL}: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    cache_raw = env.get(BLINK_PLAN_CACHE, "").strip()
    eager_raw = env.get(BLINK_EAGER_BYTES, "").strip()
    eager = parse_size(eager_raw, BLINK_EAGER_BYTES) if eager_raw else DEFAULT_EAGER_BYTES
    if not 0 <= eager <= MAX_EAGER_BYTES:
        raise ConfigError(f"{BLINK_EAGER_BYTES}: expected a size from 0 to {MAX_EAGER_BYTES // 1024}K, got {eager_raw!r}")
    return Config(
        enable=_flag(env, BLINK_ENABLE),
        topology=env.get(BLINK_TOPOLOGY, "").strip() or None,
        local_size=_positive_int(env, BLINK_LOCAL_SIZE),
        chunk_bytes=chunk,
        plan_cache=Path(cache_raw) if cache_raw else _default_cache(),
        timeout_seconds=_seconds(env, BLINK_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS),
        stall_check_seconds=_seconds(env, BLINK_STALL_CHECK_SECONDS, DEFAULT_STALL_CHECK_SECONDS),
        log_level=level,
        fault=_fault(env),
        mpi_yield=_flag(env, BLINK_MPI_YIELD, default=True),
        background_idle=_flag(env, BLINK_BACKGROUND_IDLE, default=True),
        stream_copy=_flag(env, BLINK_STREAM_COPY, default=True),
        gpu_sm_share=env_number(env, BLINK_GPU_SM_SHARE, float, "a share of the GPU (0 < share <= 1)",
                                lambda v: math.isfinite(v) and 0 < v <= 1, None),
        eager_bytes=eager,
    )
