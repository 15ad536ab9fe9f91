"""pytest plugin that ``ops_reference_suite.py`` loads into every rank of Horovod's own test suite.

It does the same on stock and ``BLINK_ENABLE=1`` runs, so the two stay comparable:

1. **Local ranks that share GPUs.**  Horovod's ``test_torch.py`` puts every CUDA tensor on
   ``cuda:<local rank>`` (``tensor.cuda(hvd.local_rank())``, ``module.to(local_rank)``): it assumes
   one GPU per local rank.  Where ranks share fewer GPUs (two ranks on one GPU under MPS), rank 1's
   ``cuda:1`` does not exist: its test raises "invalid device ordinal" while rank 0 waits for it in a
   collective, and the test hangs on both sides without running a CUDA collective at all.  Where the
   local ranks outnumber the visible GPUs, this plugin places ordinal ``i`` on GPU ``i mod
   device_count`` (``Tensor.cuda``, ``Tensor.to`` and so ``Module.to``/``Module.cuda``, and
   ``torch.cuda.set_device``) and says so once.  Nothing else changes: the collectives see CUDA
   tensors of the one GPU, which Blink reaches through its peers' IPC mappings as on many GPUs.
2. **Why a test failed, at once.**  pytest prints failure details at the end of the session, which a
   job that later hangs never reaches; each failure's ``E`` lines are printed as it happens.
3. **When each rank left its collectives**, for the tests named in ``REFERENCE_SUITE_TRACE``
   (comma-separated parts of test ids): every ``hvd.allreduce_``, ``hvd.allreduce`` and
   ``hvd.barrier`` of those tests prints its rank and wall times on entry and return, so that a
   timing-sensitive test (``test_global_barrier_op`` times the barrier from the return of the
   allreduce before it) can be read rank against rank.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

PREFIX = "[reference-suite]"


def shared_ordinal(device: Any, count: int) -> Any:
    """``device`` (an ``int``, ``"cuda:N"`` or ``torch.device``) with a CUDA index ``>= count`` taken
    ``mod count``; anything else (a dtype, a tensor, ``"cpu"``, ``"cuda"``) unchanged."""
    if count <= 0 or isinstance(device, bool):
        return device
    if isinstance(device, int):
        return device % count if device >= 0 else device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind == "cuda" and index.isdigit() and int(index) >= count:
            return f"cuda:{int(index) % count}"
        return device
    import torch

    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None \
            and device.index >= count:
        return torch.device("cuda", device.index % count)
    return device


def _local_size() -> int:
    for key in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def place_ordinals_on_shared_gpus() -> int:
    """Where this server's local ranks outnumber its visible GPUs, map CUDA ordinals onto them
    (``shared_ordinal``); returns the number of GPUs mapped onto, 0 where nothing was changed."""
    try:
        import torch
    except ImportError:
        return 0
    if not torch.cuda.is_available():
        return 0
    count, local = torch.cuda.device_count(), _local_size()
    if local <= count:
        return 0
    cuda, to, set_device = torch.Tensor.cuda, torch.Tensor.to, torch.cuda.set_device

    def shared_cuda(self, device=None, *args, **kwargs):
        return cuda(self, shared_ordinal(device, count), *args, **kwargs)

    def shared_to(self, *args, **kwargs):
        if args:
            args = (shared_ordinal(args[0], count), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = shared_ordinal(kwargs["device"], count)
        return to(self, *args, **kwargs)

    def shared_set_device(device):
        return set_device(shared_ordinal(device, count))

    torch.Tensor.cuda, torch.Tensor.to, torch.cuda.set_device = shared_cuda, shared_to, shared_set_device
    print(f"{PREFIX} {local} local ranks share {count} GPU(s): CUDA ordinal i is placed on GPU i mod {count}",
          flush=True)
    return count


TRACED = ("allreduce_", "allreduce", "barrier")
TRACE_PARTS = [t for t in os.environ.get("REFERENCE_SUITE_TRACE", "").split(",") if t]
_traced_test: list[str | None] = [None]  # the running test's id where TRACE_PARTS names it
_traces: list[str] = []


def trace_collectives() -> None:
    """Wrap ``horovod.torch``'s ``TRACED`` functions: within a test whose id contains one of
    ``TRACE_PARTS``, each call records "trace ID rank R: NAME ENTERED -> RETURNED" (wall times, s)."""
    import horovod.torch as hvd

    def traced(name: str, fn):
        def call(*args, **kwargs):
            test = _traced_test[0]
            if test is None:
                return fn(*args, **kwargs)
            entered = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                # kept until the test's report: pytest captures what a test prints
                _traces.append(f"{PREFIX} trace {test} rank {hvd.rank()}: {name} {entered:.6f} -> {time.time():.6f}")
        return call

    for name in TRACED:
        setattr(hvd, name, traced(name, getattr(hvd, name)))


def pytest_configure(config) -> None:
    place_ordinals_on_shared_gpus()
    if TRACE_PARTS:
        trace_collectives()


def pytest_runtest_setup(item) -> None:
    _traced_test[0] = item.nodeid if any(p in item.nodeid for p in TRACE_PARTS) else None


def failure_reason(text: str, limit: int = 6) -> str:
    """The ``E`` lines of a pytest failure report joined on one line (the last lines where it has none)."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()][-3:]
    return " | ".join(lines[:limit])[:2000]


@pytest.hookimpl(trylast=True)  # after pytest's own "ID VERDICT" line, which the driver reads
def pytest_runtest_logreport(report) -> None:
    if _traces and report.when == "call":
        print("\n" + "\n".join(_traces), flush=True)
        _traces.clear()
    if report.failed:
        # (no "ID VERDICT" here: the driver reads verdicts from pytest's own -v lines)
        print(f"\n{PREFIX} failure in {report.when} of {report.nodeid} - {failure_reason(report.longreprtext)}",
              flush=True)
