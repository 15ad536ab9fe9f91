"""Unmodified Horovod training scripts: blinkrun gives the same weights as horovodrun (two servers x two ranks).

The scripts are examples/torch_train.py, examples/keras_train.py and examples/tf_train.py
(DistributedOptimizer, broadcast_parameters / broadcast_optimizer_state, Horovod's Keras
callbacks, DistributedGradientTape in tf.function, broadcast_variables).  Both run
15 optimizer steps under ``horovodrun`` and under ``blinkrun`` with the same arguments;
the final weights must agree within 1e-5 and Blink's stats must show that it carried
the allreduces.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from support.horovod_jobs import ROOT, WORKERS, job_env, require_horovod, run_job, tail

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(1200)]

HOSTS = ["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo"]


def train(tmp_path, script: str, blink: bool, extra: list[str]) -> tuple[dict, list[dict]]:
    out = tmp_path / ("blink.npz" if blink else "stock.npz")
    args = [*HOSTS, "python", str(WORKERS / "with_stats.py"), str(ROOT / "examples" / script), "--save", str(out),
            *extra]
    env = job_env(blink=False, tmp=tmp_path)  # blinkrun itself sets BLINK_ENABLE=1
    p = run_job(args, env, launcher="blinkrun" if blink else "horovodrun")
    assert p.returncode == 0 and out.exists(), tail(p)
    stats = [json.loads(s) for s in re.findall(r"STATS \S+ (\{.*\})", p.stdout)]
    return dict(np.load(out)), stats


@pytest.mark.parametrize("script,extra", [("torch_train.py", ["--steps", "15"]),
                                          ("keras_train.py", ["--steps", "15", "--epochs", "3"]),
                                          ("tf_train.py", ["--steps", "15"])])
def test_blinkrun_matches_horovodrun(tmp_path, script: str, extra: list[str]) -> None:
    require_horovod()
    if script.startswith(("keras", "tf")):
        pytest.importorskip("tf_keras")
        pytest.importorskip("horovod.tensorflow")
    stock, stock_stats = train(tmp_path, script, False, extra)
    blink, blink_stats = train(tmp_path, script, True, extra)
    assert stock.keys() == blink.keys()
    diff = max(float(np.abs(stock[k] - blink[k]).max()) for k in stock)
    # the figures docs/integration.md records (pytest -rP shows them)
    print(f"{script}: max abs weight difference blinkrun vs horovodrun {diff:.3g}; "
          f"Blink stats rank 0 {blink_stats[0] if blink_stats else None}")
    assert diff <= 1e-5, diff
    assert all(s["allreduce"] == 0 for s in stock_stats)  # nothing of Blink's ran under horovodrun
    assert len(blink_stats) == 4
    for s in blink_stats:
        assert s["allreduce"] >= 15 and s["bytes"] > 0, s  # one fused gradient allreduce per step at least
