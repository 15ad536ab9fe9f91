"""What the CPU benchmark drivers (``cpu_matrix.py``, ``cpu_speed.py``) share: running one ``blink perf``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "bin"


def run_perf(cmd: list[str], env: dict[str, str], log: Path, json_path: Path, timeout: float) -> tuple[int, list[dict]]:
    """Run ``cmd`` (a ``blink perf ... --json json_path`` under a launcher) in the repository, its
    output to ``log``; returns its exit status (124: timed out) and the rows it wrote."""
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    rows = json.loads(json_path.read_text())["rows"] if json_path.exists() else []
    return rc, rows
