"""``make demo`` end to end: two servers of two ranks, stock Horovod and Blink side by side."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(900)]


def test_demo_prints_the_comparison_and_the_models_match(tmp_path) -> None:
    pytest.importorskip("horovod.torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env["BLINK_PLAN_CACHE"] = str(tmp_path / "plans")
    p = subprocess.run([sys.executable, "-m", "blink_horovod.demo", "--steps", "4", "--hidden", "256"],
                       capture_output=True, text=True, timeout=800, env=env)
    out = p.stdout
    assert p.returncode == 0, (out + p.stderr)[-4000:]
    assert "2 servers x 2 ranks" in out
    assert re.search(r"stock Horovod comm \(ms\)\s+Blink comm \(ms\)", out)
    assert len(re.findall(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", out, re.MULTILINE)) == 4
    assert re.search(r"models match: .* -> yes", out) and "all ranks hold the same Blink model: yes" in out
    m = re.search(r"stats\(\) on rank 0: (\d+) allreduces", out)
    assert m and int(m.group(1)) >= 4
    assert "DGX-1V" in out and ("simulated speedup" in out)
