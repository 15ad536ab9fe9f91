"""Launch Horovod jobs for the ops tests: horovodrun / blinkrun under a timeout, output captured."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "parallel" / "ops_workers"
VENV_BIN = Path(sys.executable).parent


def launcher_path(name: str = "horovodrun") -> Path | None:
    """The launcher beside this interpreter (the project's .venv), else the one on PATH (a system
    install, as on the GPU machine), else None."""
    if (VENV_BIN / name).exists():
        return VENV_BIN / name
    found = shutil.which(name)
    return Path(found) if found else None


def child_pythonpath() -> str:
    """PYTHONPATH for the ranks of a job: this process's, less the repository root.

    The ranks import the installed package, editable or not.  The root put first would shadow a
    non-editable install (the GPU machine's) with the source tree, where ``blink_horovod.ops`` and
    ``blink_horovod.launcher`` do not exist: setup.py maps ``ops/`` and ``launcher/`` into the
    package only when it installs it."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    return os.pathsep.join(keep)


def require_horovod() -> None:
    pytest.importorskip("horovod.torch")
    if launcher_path() is None:
        pytest.skip("horovodrun not installed")


def job_env(extra: dict | None = None, blink: bool = True, tmp: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BLINK_", "HOROVOD_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["TF_USE_LEGACY_KERAS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # Horovod's Gloo rendezvous waits 30 s by default for every rank's key; ranks importing torch and
    # TensorFlow on a loaded 2-core machine can take longer to arrive (seen: "Wait timeout after 30
    # seconds for key(s): 1" at init, about one run in four).
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "120"
    if tmp is not None:
        env["BLINK_PLAN_CACHE"] = str(tmp / "plans")
    if blink:
        env["BLINK_ENABLE"] = "1"
    env.update(extra or {})
    return env


def run_job(args: list[str], env: dict, timeout: int = 600, launcher: str = "horovodrun") -> subprocess.CompletedProcess:
    """``launcher args...`` (horovodrun or blinkrun from the venv) under ``timeout``; never hangs the test."""
    exe = str(launcher_path(launcher) or launcher)
    try:
        p = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        keep_job_log([launcher, *args], p)
        return p
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{launcher} {' '.join(args)} did not finish within {timeout} s:\n{out[-4000:]}")


def keep_job_log(argv: list[str], p: subprocess.CompletedProcess) -> None:
    """Write a job's whole output to ``$JOB_LOG_DIR/<current test>.log`` where a run asks for it (the
    GPU acceptance keeps every job's output; a failing test's message shows only its tail)."""
    keep = os.environ.get("JOB_LOG_DIR")
    if not keep:
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    test = os.environ.get("PYTEST_CURRENT_TEST", "job").split(" ")[0].split("::")[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test)
    (Path(keep) / f"{name[-120:]}.log").write_text(f"$ {' '.join(map(str, argv))}\n{p.stdout}\n{p.stderr}")


def tail(p: subprocess.CompletedProcess, n: int = 60) -> str:
    """The last ``n`` lines of a job's output, after the first error line of each rank (the cause, where
    the tail shows only what followed it)."""
    lines = (p.stdout + p.stderr).splitlines()
    first: dict[str, str] = {}
    for ln in lines:
        m = re.match(r"\[(\d+)\]<std(?:out|err)>:\s*([A-Za-z_.]*(?:Error|Exception)\b.*)", ln)
        if m and m.group(1) not in first:
            first[m.group(1)] = ln
    head = [f"first error of rank {r}: {ln}" for r, ln in sorted(first.items(), key=lambda kv: int(kv[0]))]
    return "\n".join(head + [ln for ln in lines[-n:] if "oneDNN" not in ln and "cuda" not in ln])
