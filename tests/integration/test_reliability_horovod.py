"""Faults under Horovod with ``BLINK_ENABLE=1``: what users of an unmodified script see.

Reliability requirement (Mismatch): "under ``BLINK_ENABLE=1``: every rank raises within
seconds, naming both values and the ranks".  The other cases start ranks by
hand (so no launcher interferes); these run a torch script under
``horovodrun --gloo``, with Blink switched on by the environment only.

Skipped where Horovod is not installed for this interpreter (the project's
``.venv`` has it; ``make test`` runs from there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import rendezvous_leftovers
from support.horovod_jobs import child_pythonpath, launcher_path

pytestmark = pytest.mark.timeout(240)

HOROVODRUN = launcher_path() or Path(sys.executable).parent / "horovodrun"
N = 3

needs_horovod = pytest.mark.skipif(
    not HOROVODRUN.exists(), reason="horovodrun is not installed for this interpreter (the project .venv has it)"
)


def horovodrun(script: str, tmp_path: Path, env: dict[str, str], timeout: float = 200) -> tuple[subprocess.CompletedProcess, list[dict]]:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    full = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    full.update(
        PYTHONPATH=child_pythonpath(),
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
        BLINK_PLAN_CACHE=str(tmp_path / "plans"),
    )
    full.update(env)
    proc = subprocess.run(
        [str(HOROVODRUN), "-np", str(N), "-H", f"localhost:{N}", "--gloo", sys.executable, str(path)],
        capture_output=True, text=True, timeout=timeout, env=full, cwd=tmp_path,
    )
    events = []
    for line in proc.stdout.splitlines():
        _, sep, rest = line.partition("@@reliability ")
        if sep:
            events.append(json.loads(rest))
    return proc, events


MISMATCH = """
import json, os, sys, time
import torch
import horovod.torch as hvd

hvd.init()
r = hvd.rank()

def emit(kind, **fields):
    print("@@reliability " + json.dumps(dict(kind=kind, rank=r, pid=os.getpid(), t=time.time(), **fields)), flush=True)

hvd.allreduce(torch.ones(16), name="warm-up")
x = torch.ones(4096 + (1 if r == 1 else 0))
start = time.time()
try:
    hvd.allreduce(x, name="grad.w")
    emit("no-error")
except Exception as exc:
    import blink_horovod
    emit("error", type=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], message=str(exc),
         seconds=time.time() - start, stats=blink_horovod.stats())
    sys.exit(1)
"""


@needs_horovod
def test_mismatched_shape_under_blink_enable_raises_on_every_rank(tmp_path: Path, record) -> None:
    timeout = 30.0
    proc, events = horovodrun(MISMATCH, tmp_path, {"BLINK_ENABLE": "1", "BLINK_TIMEOUT_SECONDS": f"{timeout:g}"})
    errors = {e["rank"]: e for e in events if e["kind"] == "error"}
    left = rendezvous_leftovers({e["pid"] for e in events})
    record(
        case=f"mismatched shape under horovodrun --gloo, BLINK_ENABLE=1 ({N} ranks, torch)",
        fault="mismatch across ranks",
        injected="rank 1 allreduces a tensor of 4097 elements, the others 4096, same name",
        behaviour=(f"{len(errors)} of {N} ranks raise {'/'.join(sorted({e['type'] for e in errors.values()}))}: "
                   f"\"{next(iter(errors.values()))['message']}\"; horovodrun exits {proc.returncode}; "
                   f"{len(left)} rendezvous file(s) left in /tmp"
                   if errors else f"no rank raised; horovodrun exit {proc.returncode}"),
        seconds=max((e["seconds"] for e in errors.values()), default=None),
        limits=f"timeout {timeout:g} s",
    )
    assert sorted(errors) == list(range(N)), (events, proc.stdout[-3000:], proc.stderr[-3000:])
    for e in errors.values():
        assert "RuntimeError" in e["mro"], e  # Horovod's errors are RuntimeErrors; Blink's too
        for text in ("shape differs", "rank 1 sent [4097]", "ranks 0, 2 sent [4096]", "grad.w"):
            assert text in e["message"], (text, e)
        assert e["seconds"] < 5.0, e
    assert proc.returncode != 0
    assert left == [], left  # the job's rendezvous folder does not outlive it
