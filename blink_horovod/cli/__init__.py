"""The ``blink`` command: ``blink plan|topology|simulate|perf ...`` (docs/formats.md, Commands).

Each subcommand lives in its own module ``blink_horovod.cli.<name>_cmd`` with
``register(subparsers)``; the parser it adds sets ``func(args) -> int``.
Machine-readable output goes to stdout (or ``--output``); messages, progress
and errors go to stderr.  Bad input is one line on stderr naming the field and
the value, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..errors import BlinkError

__all__ = ["SUBCOMMANDS", "fail", "main", "one_line"]

SUBCOMMANDS = ("plan", "topology", "simulate", "perf")
EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {one_line(message)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def one_line(message: str) -> str:
    """``message`` with line breaks and other control characters escaped.

    Error messages quote what the user typed; a value holding ``\\r`` or
    ``\\n`` (or a terminal escape) must not break the one-line contract.
    """
    return "".join(
        c if c == "\t" or (c.isprintable() and c not in "\u2028\u2029") else repr(c)[1:-1] for c in str(message)
    )


def fail(message: str) -> int:
    """Print one error line to stderr and return the bad-input exit code."""
    print(f"blink: error: {one_line(message)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="blink",
        description=(
            "Blink collectives for Horovod: plan spanning-tree collectives for a GPU topology, "
            "inspect topologies, simulate plans against NCCL, and benchmark the runtime."
        ),
        epilog="Sizes take K, M, G suffixes (2^10, 2^20, 2^30 bytes); rates are GB/s (10^9 bytes/s).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}_cmd":
                continue  # not built yet in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except BlinkError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("blink: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
