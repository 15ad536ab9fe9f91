"""Elastic: a rank is removed mid-training; Blink re-plans for the new rank set and training goes on.

Reliability requirement (Elastic): "under ``hvd.elastic.run``, after a reset with a different
set of ranks, Blink re-probes, re-plans and goes on; a test removes a rank
mid-training and training continues from the last commit with the same
results as stock Horovod elastic under the same removal".

The same torch script runs twice under ``horovodrun`` in elastic mode (3
slots, ``--min-np 2``, a host-discovery script reading a file), once stock
and once with ``BLINK_ENABLE=1``.  At a fixed batch rank 0 rewrites the
hosts file to 2 slots and every rank waits a few seconds before its
``state.commit()``, so the driver's discovery (1 s polling) has seen the
change and the reset happens at that commit on every run: both runs then go
on with ranks 0 and 1 from the same committed state, and must end with the
same weights.  (``--network-interfaces lo``: elastic mode otherwise waits for
two hosts before it starts.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import rendezvous_leftovers
from support.horovod_jobs import child_pythonpath, launcher_path

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
HOROVODRUN = launcher_path() or Path(sys.executable).parent / "horovodrun"
TOTAL, REMOVE_AT, SETTLE_S = 10, 4, 4.0
# 128 KiB of float64 gradient: above the runtime's eager size (64 KiB), so it travels over planned trees.
FEATURES = 16384

TRAIN = """
import json, os, sys, time
import torch
import horovod.torch as hvd

hvd.init()
HOSTS = os.environ["RELIABILITY_HOSTS_FILE"]
TOTAL, REMOVE_AT, SETTLE = int(os.environ["TOTAL"]), int(os.environ["REMOVE_AT"]), float(os.environ["SETTLE"])

def emit(kind, **fields):
    print("@@reliability " + json.dumps(dict(kind=kind, rank=hvd.rank(), size=hvd.size(), pid=os.getpid(), t=time.time(),
                                             **fields)),
          flush=True)

FEATURES = int(os.environ["FEATURES"])
model = torch.nn.Linear(FEATURES, 1, bias=False).double()
with torch.no_grad():
    model.weight.fill_(0.001)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5), named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, resets=0)

def data(batch, rank):
    # What a rank trains on depends only on (batch, rank): both runs see the same data.
    g = torch.Generator().manual_seed(batch * 100 + rank)
    x = torch.randn(4, FEATURES, generator=g, dtype=torch.float64)
    return x, x[:, :8].sum(1, keepdim=True) * 0.5

def on_reset():
    state.resets += 1
    emit("reset", batch=state.batch)

state.register_reset_callbacks([on_reset])

@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        x, y = data(state.batch, hvd.rank())
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        state.batch += 1
        emit("step", batch=state.batch, loss=float(loss))
        if state.batch == REMOVE_AT and hvd.size() == 3:
            if hvd.rank() == 0:
                with open(HOSTS, "w") as f:
                    f.write("localhost:2\\n")
                emit("removed")
            time.sleep(SETTLE)
        state.commit()

train(state)
import blink_horovod
emit("final", weight=model.weight.detach().flatten().tolist(), resets=state.resets, stats=blink_horovod.stats())
"""


def _start(tmp: Path, blink: bool) -> subprocess.Popen:
    tmp.mkdir()
    (tmp / "train.py").write_text(textwrap.dedent(TRAIN))
    hosts = tmp / "hosts.txt"
    hosts.write_text("localhost:3\n")
    discover = tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    env.update(
        PYTHONPATH=child_pythonpath(),
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
        RELIABILITY_HOSTS_FILE=str(hosts), TOTAL=str(TOTAL), REMOVE_AT=str(REMOVE_AT), SETTLE=f"{SETTLE_S:g}", FEATURES=str(FEATURES),
        BLINK_PLAN_CACHE=str(tmp / "plans"),
    )
    if blink:
        env.update(BLINK_ENABLE="1", BLINK_TIMEOUT_SECONDS="60")
    out = open(tmp / "out.log", "wb")
    return subprocess.Popen(
        [str(HOROVODRUN), "-np", "3", "--min-np", "2", "--max-np", "3", "--network-interfaces", "lo",
         "--host-discovery-script", str(discover), sys.executable, str(tmp / "train.py")],
        stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True,
    )


def _events(tmp: Path) -> list[dict]:
    out = []
    for line in (tmp / "out.log").read_text(errors="replace").splitlines():
        _, sep, rest = line.partition("@@reliability ")
        if sep:
            out.append(json.loads(rest))
    return out


def _plans_by_size(tmp: Path) -> set[int]:
    return {len(json.loads(p.read_text())["plan"]["gpus"]) for p in (tmp / "plans").glob("*.json")}


@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed for this interpreter (the project .venv has it)")
def test_rank_removed_under_elastic_blink_replans_and_matches_stock(tmp_path: Path, record) -> None:
    t0 = time.monotonic()
    # Both jobs at once: each mostly waits (start-up, the settle sleep), so together they take ~one's time.
    jobs = {"stock": _start(tmp_path / "stock", blink=False), "blink": _start(tmp_path / "blink", blink=True)}
    for name, proc in jobs.items():
        try:
            proc.wait(timeout=360)
        except subprocess.TimeoutExpired:
            for p in jobs.values():
                os.killpg(p.pid, 9)
            pytest.fail(f"{name} elastic job did not finish in 360 s: {(tmp_path / name / 'out.log').read_text()[-3000:]}")
    wall = time.monotonic() - t0
    ev = {name: _events(tmp_path / name) for name in jobs}
    finals = {name: {e["rank"]: e for e in ev[name] if e["kind"] == "final"} for name in jobs}
    resets = {name: [e for e in ev[name] if e["kind"] == "reset"] for name in jobs}
    removed = {name: next((e["t"] for e in ev[name] if e["kind"] == "removed"), None) for name in jobs}
    resumed = {
        name: min((e["t"] for e in ev[name] if e["kind"] == "step" and e["size"] == 2), default=None) for name in jobs
    }
    diff = None
    if 0 in finals["stock"] and 0 in finals["blink"]:
        diff = max(abs(a - b) for a, b in zip(finals["stock"][0]["weight"], finals["blink"][0]["weight"]))
    stats = finals["blink"].get(0, {}).get("stats", {})
    left = rendezvous_leftovers({e["pid"] for e in ev["blink"]})
    since = (resumed["blink"] - removed["blink"]) if resumed["blink"] and removed["blink"] else None
    record(
        case="a rank removed mid-training under hvd.elastic.run (3 -> 2 ranks, torch), BLINK_ENABLE=1 vs stock",
        fault="elastic",
        injected=f"horovodrun elastic (host-discovery script); at batch {REMOVE_AT} of {TOTAL} the hosts file goes "
                 f"from localhost:3 to localhost:2; every rank waits {SETTLE_S:g} s before that commit",
        behaviour=(
            f"Blink: exit {jobs['blink'].returncode}, {len(resets['blink'])} reset callback(s) at batch "
            f"{sorted({e['batch'] for e in resets['blink']})} with size {sorted({e['size'] for e in resets['blink']})}, "
            f"plans made for {sorted(_plans_by_size(tmp_path / 'blink'))} ranks, training finished on "
            f"{len(finals['blink'])} ranks; Blink carried {stats.get('allreduce')} allreduces, "
            f"{stats.get('fallback')} fell back; final weights vs stock Horovod elastic under the same removal: "
            f"max abs difference {diff:.1e}; {len(left)} rendezvous file(s) left in /tmp" if diff is not None else f"stock exit {jobs['stock'].returncode}, "
            f"blink exit {jobs['blink'].returncode}, no final weights to compare"
        ),
        seconds=since,
        limits=f"time = removal to the first step on 2 ranks (includes the {SETTLE_S:g} s settle wait); "
               f"both jobs {wall:.0f} s",
    )
    for name, proc in jobs.items():
        assert proc.returncode == 0, (name, (tmp_path / name / "out.log").read_text()[-4000:])
        assert sorted(finals[name]) == [0, 1], (name, finals[name].keys())
        assert {e["size"] for e in resets[name]} == {2} and {e["batch"] for e in resets[name]} == {REMOVE_AT}, resets[name]
        assert finals[name][0]["weight"] == finals[name][1]["weight"], name  # ranks agree after the reset
    assert diff is not None and diff <= 1e-5, diff
    assert max(abs(w - 0.001) for w in finals["blink"][0]["weight"]) > 1e-6  # it did train
    assert stats.get("allreduce", 0) > 0 and stats.get("fallback") == 0, stats
    assert _plans_by_size(tmp_path / "blink") >= {2, 3}  # planned for the first rank set, then again for the new one
    assert left == [], left  # neither rank set's rendezvous folder outlives the job
