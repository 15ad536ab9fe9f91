"""Running ``python3 -m blink_horovod ...`` as a user does, for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def blink(*argv: str, cwd: Path, stdin: str | None = None, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python3 -m blink_horovod ARGV`` in a fresh interpreter, with the plan cache under ``cwd``."""
    full = dict(os.environ, PYTHONPATH=str(REPO), BLINK_PLAN_CACHE=str(cwd / "plan-cache"))
    full.pop("CUDA_VISIBLE_DEVICES", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "blink_horovod", *argv], check=False, capture_output=True, text=True,
                          input=stdin, timeout=timeout, env=full, cwd=cwd)


def assert_bad_input(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr (no traceback) containing every needle."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, lines
    assert proc.stdout == "", proc.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
