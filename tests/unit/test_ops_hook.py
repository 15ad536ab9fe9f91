"""The BLINK_ENABLE=1 import hook: patches Horovod after import, and without the variable changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("horovod")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("BLINK_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150, env=full)


def test_pth_file_is_installed_next_to_the_package() -> None:
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    assert any(os.path.exists(os.path.join(d, "blink_horovod_hook.pth")) for d in dirs), dirs


def test_without_blink_enable_nothing_is_imported_or_patched() -> None:
    p = run("import sys, horovod.torch as hvd; "
            "print(hvd.synchronize.__module__, any(m.startswith('blink_horovod') for m in sys.modules))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["horovod.torch.mpi_ops", "False"]


def test_with_blink_enable_every_binding_is_patched() -> None:
    code = ("import horovod.torch as hvd, horovod.torch.mpi_ops as m, horovod.torch.optimizer as o, "
            "horovod.torch.functions as f; "
            "print(m._allreduce_async.__module__, m._broadcast_async.__module__, hvd.synchronize.__module__, "
            "o.synchronize.__module__, f.broadcast_async_.__globals__['_broadcast_async'].__module__, "
            "hvd.DistributedOptimizer.__module__)")
    p = run(code, BLINK_ENABLE="1")
    assert p.returncode == 0, p.stderr
    mods = p.stdout.split()
    assert mods[:5] == ["blink_horovod.ops.torch_ops"] * 5 and mods[5] == "blink_horovod.ops.torch_optimizer"


def test_invalid_blink_variable_is_reported() -> None:
    p = run("import horovod.torch", BLINK_ENABLE="1", BLINK_TIMEOUT_SECONDS="soon")
    assert "BLINK_TIMEOUT_SECONDS" in p.stderr


def test_keras3_is_refused_with_a_clear_error() -> None:
    pytest.importorskip("tensorflow")
    p = run("import tensorflow as tf\n"
            "try:\n import horovod.tensorflow.keras\n"
            "except Exception as e:\n print(type(e).__name__, e)\n",
            BLINK_ENABLE="1", TF_USE_LEGACY_KERAS="0")
    assert "BlinkError" in p.stdout and "TF_USE_LEGACY_KERAS=1" in p.stdout, p.stdout + p.stderr
