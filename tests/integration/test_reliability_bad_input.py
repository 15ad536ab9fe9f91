"""Bad input to the real commands: one line on stderr naming the field and value, exit 2, no traceback.

Reliability requirement (Bad input) and docs/formats.md, Commands.  The parsers themselves are
fuzzed with hypothesis in ``tests/unit/test_fuzz_parsers.py`` and the
``plan``/``topology`` command lines in ``tests/unit/test_fuzz_cli.py``; this
case runs a fixed set of bad inputs through ``python -m blink_horovod`` (a
fresh interpreter, as a user's shell would) and records them for
``docs/reliability.md``, including bad ``BLINK_*`` variables and the
benchmark's flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.horovod_jobs import child_pythonpath

pytestmark = pytest.mark.timeout(180)


# (what, argv, extra environment, text the one line must contain)
CASES = [
    ("unknown machine", ["plan", "--topology", "dgx9", "--collective", "allreduce"], {}, "dgx9"),
    ("GPU not on the machine", ["plan", "--topology", "dgx1v:0,1,9", "--collective", "allreduce"], {}, "9"),
    ("broadcast root outside the allocation", ["plan", "--topology", "dgx1v:0,1,4,5", "--collective", "broadcast", "--root", "7"], {}, "7"),
    ("unknown channel", ["plan", "--topology", "dgx1v", "--collective", "allreduce", "--channels", "infiniband"], {}, "infiniband"),
    ("binary topology file", ["topology", "BINARY_FILE"], {}, "topo.bin"),
    ("topology file: link to an unknown GPU", ["topology", "BAD_LINK_FILE"], {}, "links[0].dst"),
    ("unwritable --output", ["topology", "dgx1v", "--output", "/nonexistent-dir/t.json"], {}, "--output"),
    ("perf: bad size", ["perf", "-b", "12Q"], {}, "12Q"),
    ("perf: max size below min", ["perf", "-b", "1M", "-e", "1K"], {}, "-e"),
    ("bad BLINK_TIMEOUT_SECONDS", ["perf", "-b", "1K", "-e", "1K"], {"BLINK_TIMEOUT_SECONDS": "soon"}, "BLINK_TIMEOUT_SECONDS"),
    ("bad BLINK_CHUNK_BYTES", ["perf", "-b", "1K", "-e", "1K"], {"BLINK_CHUNK_BYTES": "-4K"}, "BLINK_CHUNK_BYTES"),
    ("control characters in a value", ["topology", "no\nsuch\r"], {}, "\\n"),
]


def test_bad_input_to_the_commands_is_one_line_and_exit_2(tmp_path: Path, record) -> None:
    binary = tmp_path / "topo.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    bad_link = tmp_path / "badlink.json"
    bad_link.write_text('{"gpus": [0, 1], "links": [{"src": 0, "dst": 7, "bandwidth_gbps": 25}]}')
    base = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    base["PYTHONPATH"] = child_pythonpath()
    base["BLINK_PLAN_CACHE"] = str(tmp_path / "plans")
    seen, failures, slowest = [], [], 0.0
    for what, argv, env, needle in CASES:
        argv = [str(binary) if a == "BINARY_FILE" else str(bad_link) if a == "BAD_LINK_FILE" else a for a in argv]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "blink_horovod", *argv], capture_output=True, text=True,
                              timeout=120, env=dict(base, **env), cwd=tmp_path)
        slowest = max(slowest, time.monotonic() - t0)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        ok = proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr and needle in lines[0]
        seen.append((what, proc.returncode, lines))
        if not ok:
            failures.append((what, argv, proc.returncode, proc.stderr[-1500:]))
    examples = "; ".join(f"{what}: `{lines[0] if lines else '?'}`" for what, _, lines in seen[:3])
    record(
        case=f"{len(CASES)} bad inputs to blink plan/topology/perf and BLINK_* variables",
        fault="bad input",
        injected="unknown names, GPUs, roots, channels, binary and invalid files, unwritable --output, bad sizes, "
                 "invalid BLINK_TIMEOUT_SECONDS / BLINK_CHUNK_BYTES, control characters; plus hypothesis "
                 "fuzzing of every parser and of the plan/topology command lines (tests/unit/test_fuzz_*.py)",
        behaviour=f"{len(CASES) - len(failures)} of {len(CASES)} exit 2 with one stderr line naming the field and the "
                  f"value, no traceback; e.g. {examples}",
        seconds=None,
        limits=f"slowest command {slowest:.2f} s, interpreter start included",
    )
    assert not failures, failures
