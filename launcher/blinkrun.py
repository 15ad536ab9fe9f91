"""``blinkrun``: ``horovodrun`` with Blink underneath.

Every argument of ``horovodrun`` passes through unchanged; ``blinkrun`` adds
the ``--blink-*`` options of ``blink_horovod.config.LAUNCHER_FLAGS`` (one
option for each user-facing ``BLINK_*`` variable: ``--blink-topology``,
``--blink-chunk-bytes``, ``--blink-timeout``, ``--blink-stall-check``,
``--blink-log-level``, ``--blink-local-size``, ``--blink-plan-cache``; the
tuning and test switches, such as ``BLINK_STREAM_COPY`` or ``BLINK_FAULT``,
are set in the environment, which ``horovodrun`` passes on as well) and
``--dry-run``, then runs

    horovodrun ARGS...   with BLINK_ENABLE=1, the BLINK_* variables and
                         TF_USE_LEGACY_KERAS=1 (unless already set) in its environment.

``horovodrun`` hands its environment to every rank, local or remote: with
Gloo it starts each rank as ``env K=V ... command`` (over ssh for remote
hosts), with MPI it adds ``-x K`` for every variable to ``mpirun``
(``horovod/runner/gloo_run.py``, ``mpi_run.py``).  So the variables set here
reach all ranks on all hosts with no extra work.

Bad values (``--blink-timeout -1``, an unknown topology) are refused before
anything starts: one line on stderr naming the option and the value, exit 2
(docs/formats.md, Commands).  ``--dry-run`` prints the command it would run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence

from ..config import BLINK_ENABLE, LAUNCHER_FLAGS, load_config
from ..errors import BlinkError, ConfigError

__all__ = ["build_command", "main", "split_blink_args"]

DRY_RUN = "--dry-run"
_VAR_OF_FLAG = dict(LAUNCHER_FLAGS)


class _Captured(Exception):
    pass


def _horovodrun_parser() -> argparse.ArgumentParser:
    """horovodrun's own argument parser (built by ``horovod.runner.launch.parse_args``)."""
    from horovod.runner import launch

    captured: dict[str, argparse.ArgumentParser] = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        captured["parser"] = self
        raise _Captured

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        launch.parse_args()
    except _Captured:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return captured["parser"]


def split_blink_args(argv: Sequence[str]) -> tuple[dict[str, str], bool, list[str]]:
    """Take ``--blink-*`` options and ``--dry-run`` out of ``argv`` (before the training command).

    Returns ``(variables, dry_run, horovodrun_args)``; ``variables`` maps
    ``BLINK_*`` names to the given values.  The command starts at the first
    token that is neither an option nor an option's value; options after it
    belong to the training script and are left alone.
    """
    env: dict[str, str] = {}
    dry = False
    rest: list[str] = []
    takes_value = _options_with_values()
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        if name in _VAR_OF_FLAG:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name}: expected a value")
                value = argv[i + 1]
                i += 1
            env[_VAR_OF_FLAG[name]] = value
        elif tok == DRY_RUN:
            dry = True
        elif tok.startswith("-"):
            rest.append(tok)
            if not eq and name in takes_value and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
        else:  # the training command: everything from here on is its own
            rest.extend(argv[i:])
            break
        i += 1
    return env, dry, rest


_TAKES_VALUE: set[str] | None = None


def _options_with_values() -> set[str]:
    """horovodrun's option strings that consume a value (``-np 4``, ``-H a:2``, ...)."""
    global _TAKES_VALUE
    if _TAKES_VALUE is None:
        try:
            parser = _horovodrun_parser()
            _TAKES_VALUE = {s for a in parser._actions for s in a.option_strings if a.nargs != 0}
        except Exception:  # horovod missing: the common ones
            _TAKES_VALUE = {"-np", "--num-proc", "-H", "--hosts", "-p", "--ssh-port", "--hostfile",
                            "--network-interface", "--output-filename", "--log-level", "--mpi-args",
                            "--start-timeout", "-i", "--ssh-identity-file", "--fusion-threshold-mb",
                            "--cycle-time-ms", "--timeline-filename", "--gloo-timeout-seconds",
                            "--min-np", "--max-np", "--host-discovery-script", "--slots-per-host",
                            "--reset-limit", "--blacklist-cooldown-range", "--config-file"}
    return _TAKES_VALUE


def _validate(variables: Mapping[str, str]) -> None:
    """Refuse bad ``--blink-*`` values before starting anything (ConfigError names the option)."""
    flag_of = {v: k for k, v in LAUNCHER_FLAGS.items()}
    env = dict(variables)
    env[BLINK_ENABLE] = "1"
    try:
        cfg = load_config(env)
    except ConfigError as exc:
        var = str(exc).split(":", 1)[0]
        raise ConfigError(f"{flag_of.get(var, var)}: {str(exc).split(':', 1)[-1].strip()}") from None
    if cfg.topology and cfg.topology != "local":
        from ..topology.machines import resolve

        try:
            resolve(cfg.topology)
        except BlinkError as exc:
            raise ConfigError(f"--blink-topology: {exc}") from None


def build_command(argv: Sequence[str], base_env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str], dict[str, str], bool]:
    """``(command, full_env, added_env, dry_run)`` for ``blinkrun argv``."""
    variables, dry, rest = split_blink_args(argv)
    _validate(variables)
    base = dict(os.environ if base_env is None else base_env)
    added = {BLINK_ENABLE: "1", **variables}
    if not base.get("TF_USE_LEGACY_KERAS"):
        added["TF_USE_LEGACY_KERAS"] = "1"
    horovodrun = _find_horovodrun()
    return [horovodrun, *rest], {**base, **added}, added, dry


def _find_horovodrun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.exists(here):
        return here
    return shutil.which("horovodrun") or "horovodrun"


def _help() -> str:
    lines = ["usage: blinkrun [--blink-* OPTIONS] [--dry-run] HOROVODRUN-ARGS... COMMAND...", "",
             "horovodrun with Blink's collectives: sets BLINK_ENABLE=1 (and TF_USE_LEGACY_KERAS=1 when unset)",
             "and the BLINK_* variables below on every rank; all other arguments go to horovodrun.", "",
             "Blink options:"]
    for flag, var in LAUNCHER_FLAGS.items():
        lines.append(f"  {flag} VALUE".ljust(32) + f"sets {var}")
    lines.append(f"  {DRY_RUN}".ljust(32) + "print the horovodrun command instead of running it")
    lines += ["", "horovodrun options: see `horovodrun --help`."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blinkrun`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_help())
        return 0
    try:
        cmd, env, added, dry = build_command(argv)
    except BlinkError as exc:
        print(f"blinkrun: {exc}", file=sys.stderr)
        return 2
    if dry:
        print(shlex.join(["env", *(f"{k}={v}" for k, v in added.items()), *cmd]))
        return 0
    if not os.path.exists(cmd[0]) and shutil.which(cmd[0]) is None:
        print("blinkrun: horovodrun not found (install horovod: make install)", file=sys.stderr)
        return 2
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
