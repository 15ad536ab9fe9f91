"""Per-collective metadata, checked across the server's ranks before any byte moves.

Stock Horovod's coordinator negotiates every named tensor and reports
disagreements ("Mismatched allreduce tensor shapes: One rank sent a tensor of
shape [4097], but another rank sent a tensor of shape [4096]",
``horovod/common/controller.cc``).  Blink bypasses that negotiation (ranks
issue collectives in one order), so each rank writes what it is about to do
(collective, name, dtype, shape, op, root, plan) into its metadata slot, reads
every peer's, and compares.  Every rank reads the same slots, so a
disagreement raises the same :class:`~blink_horovod.errors.MismatchError` on
every rank, naming the field, both values and the ranks, instead of a hang or
wrong sums.

A payload is two JSON lines: the *checked* fields, compared as bytes (the
fast path: equal bytes, nothing decoded), then free *extras* that ranks
combine rather than compare (measured times for the chunk tuner).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any
from collections.abc import Mapping, Sequence

from ..errors import BlinkInternalError, MismatchError

__all__ = ["CHECKED_FIELDS", "CLOSING", "check_agreement", "decode", "encode"]

# Checked in this order; the first that differs is the one reported.
CHECKED_FIELDS = ("collective", "name", "dtype", "shape", "op", "root", "plan")
_NAME_LIMIT = 512
# What a rank posts in place of metadata when it closes its communicator (peers meet it there).
CLOSING = b"close"


def encode(checked: Mapping[str, Any], extras: Mapping[str, Any] | None = None) -> bytes:
    """Serialise one rank's metadata (deterministically: same input, same bytes)."""
    fields = {k: checked.get(k) for k in CHECKED_FIELDS}
    name = fields.get("name")
    if isinstance(name, str) and len(name) > _NAME_LIMIT:
        # Keep payloads bounded; a digest still tells different names apart.
        fields["name"] = name[:200] + "...sha1:" + hashlib.sha1(name.encode()).hexdigest()
    head = json.dumps(fields, separators=(",", ":"), sort_keys=False, default=str)
    tail = json.dumps(dict(extras or {}), separators=(",", ":"), default=str)
    return (head + "\n" + tail).encode("utf-8")


def decode(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    head, _, tail = payload.decode("utf-8").partition("\n")
    return json.loads(head), (json.loads(tail) if tail else {})


def checked_part(payload: bytes) -> bytes:
    """The part of an encoded payload every rank must agree on (the checked fields; not the extras)."""
    return payload.split(b"\n", 1)[0]


_checked_part = checked_part


def _show(field: str, value: Any) -> str:
    if field == "shape" and isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if field == "name":
        return repr(value)
    return str(value)


def check_agreement(payloads: Sequence[bytes], seq: int) -> list[dict[str, Any]]:
    """Compare every rank's metadata; return the decoded extras of each rank.

    Raises
    ------
    MismatchError
        "mismatched shape in allreduce 'g' (collective 7): rank 1 sent shape
        [4097], rank 0 sent [4096]" -- naming the lowest rank that differs from
        rank 0, and every rank's value when more than two values occur.
    """
    heads = [_checked_part(p) for p in payloads]
    if any(h != heads[0] for h in heads[1:]):
        # (here, off the fast path: a peer's CLOSING differs from every collective's metadata)
        closed = [r for r, p in enumerate(payloads) if p == CLOSING]
        if closed:
            running = [r for r in range(len(payloads)) if r not in closed]
            raise BlinkInternalError(
                f"collective {seq}: local rank{'s' if len(closed) > 1 else ''} {', '.join(map(str, closed))} "
                f"closed the communicator (hvd.shutdown, or its process ending after an error of its own: see its "
                f"log) while local rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} started "
                f"a collective")
        decoded = [decode(p)[0] for p in payloads]
        ref = decoded[0]
        for field in CHECKED_FIELDS:
            values = [d.get(field) for d in decoded]
            if all(v == values[0] for v in values[1:]):
                continue
            odd = next(r for r, v in enumerate(values) if v != values[0])
            what = f"{ref.get('collective')} {_show('name', ref.get('name'))}" if ref.get("name") else str(ref.get("collective"))
            msg = (
                f"mismatched {field} in {what} (collective {seq}): "
                f"rank {odd} sent {field} {_show(field, values[odd])}, rank 0 sent {_show(field, values[0])}"
            )
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(_show(field, v), []).append(r)
            if len(groups) > 2:
                msg += "; by value: " + "; ".join(f"{v}: ranks {rs}" for v, rs in groups.items())
            raise MismatchError(msg)
        raise MismatchError(f"mismatched metadata in collective {seq}: {heads[0]!r} vs others")  # pragma: no cover
    return [decode(p)[1] for p in payloads]
