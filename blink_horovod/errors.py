"""One exception hierarchy for the whole project.

::

    BlinkError                      (base; every error this project raises on purpose)
     +-- ConfigError                a BLINK_* variable or a command-line value is invalid
     +-- TopologyError              a topology (file, built-in name, probe) is invalid
     +-- PlanError                  a plan cannot be made, or a plan file is invalid
     +-- ScheduleError              a program cannot be compiled, or fails the symbolic check
     +-- MismatchError              ranks disagree on a collective (shape, dtype, op, root, name),
                                    or one call's tensors do (a group on several devices)
     +-- BlinkTimeoutError          a collective did not finish within BLINK_TIMEOUT_SECONDS
     +-- BlinkInternalError         the runtime failed (a peer died, a transport broke)

Messages name the field, the value and, across ranks, which ranks disagree, in
the manner of Horovod's coordinator ("Mismatched tensor shapes: One rank sent
..., another rank sent ...") and its stall inspector ("Missing ranks: ...").

``BlinkError`` derives from ``RuntimeError``, as Horovod's own errors do.
Errors about bad *input* (``ConfigError``, ``TopologyError``, ``PlanError``)
are ``ValueError`` s too, so that argument-checking code behaves as users
expect; failures of a running collective (``MismatchError``,
``BlinkTimeoutError``, ``BlinkInternalError``, ``ScheduleError``) are not, so
``except ValueError`` in user code never swallows one of them by accident.
"""

from __future__ import annotations

__all__ = [
    "BlinkError",
    "BlinkInternalError",
    "BlinkTimeoutError",
    "ConfigError",
    "MismatchError",
    "PlanError",
    "ScheduleError",
    "TopologyError",
]


class BlinkError(RuntimeError):
    """Base of every error blink_horovod raises on purpose."""


class ConfigError(BlinkError, ValueError):
    """A ``BLINK_*`` environment variable or a command-line value is invalid."""


class TopologyError(BlinkError, ValueError):
    """A topology is invalid: names the offending field and value."""


class PlanError(BlinkError, ValueError):
    """No plan can be made for the request, or a plan file is invalid."""


class ScheduleError(BlinkError):
    """A program cannot be compiled, or it failed the symbolic checker."""


class MismatchError(BlinkError):
    """Ranks submitted different collectives (shape, dtype, op, root or name), or the tensors of one
    call disagree (a grouped allreduce over tensors on different devices)."""


class BlinkTimeoutError(BlinkError, TimeoutError):
    """A collective did not complete within ``BLINK_TIMEOUT_SECONDS``."""


class BlinkInternalError(BlinkError):
    """The runtime failed: a peer rank died or its transport broke."""
