"""Open MPI yields while a Blink collective runs (ops/mpi_yield.py), and only then."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from blink_horovod.ops import mpi_yield

from blink_horovod.config import BLINK_MPI_YIELD, load_config
from blink_horovod.errors import ConfigError


@pytest.fixture
def fake_setter(monkeypatch):
    """A stand-in for opal_progress_set_yield_when_idle: records values, returns the old one."""
    state = {"value": False, "calls": []}

    def setter(value: bool) -> bool:
        old = state["value"]
        state["value"] = bool(value)
        state["calls"].append(bool(value))
        return old

    monkeypatch.setattr(mpi_yield, "setter", lambda: setter)
    return state


def test_yields_inside_and_restores_after(fake_setter):
    with mpi_yield.yielding():
        assert fake_setter["value"] is True
    assert fake_setter["value"] is False
    assert fake_setter["calls"] == [True, False]


def test_keeps_a_value_set_before(fake_setter):
    fake_setter["value"] = True  # the user ran with mpi_yield_when_idle=1
    with mpi_yield.yielding():
        pass
    assert fake_setter["value"] is True


def test_nested_uses_restore_once_at_the_outermost_exit(fake_setter):
    with mpi_yield.yielding():
        with mpi_yield.yielding():
            assert fake_setter["value"] is True
        assert fake_setter["value"] is True
    assert fake_setter["calls"] == [True, False]


def test_restores_when_the_collective_raises(fake_setter):
    with pytest.raises(RuntimeError), mpi_yield.yielding():
        raise RuntimeError("peer failed")
    assert fake_setter["value"] is False


def test_disabled_is_a_no_op(fake_setter):
    with mpi_yield.yielding(False):
        assert fake_setter["value"] is False
    assert fake_setter["calls"] == []


def test_no_open_mpi_in_the_process_is_a_no_op(monkeypatch):
    monkeypatch.setattr(mpi_yield, "_loaded_path", lambda: None)
    mpi_yield.reset()
    try:
        assert mpi_yield.setter() is None
        with mpi_yield.yielding():
            pass
    finally:
        mpi_yield.reset()


def test_the_hierarchy_yields_during_blink_collectives(fake_setter):
    from blink_horovod.ops.hierarchical import Hierarchy
    from blink_horovod.ops.layout import Layout
    from support.loopback import run_loopback

    out: list[np.ndarray] = [np.arange(8, dtype=np.float32) + r for r in range(2)]
    run_loopback(2, lambda r, comm: comm.allreduce(out[r]), eager=True, join_timeout=60)
    assert fake_setter["calls"] == []  # the raw communicator leaves Open MPI alone
    run_loopback(2, lambda r, comm: Hierarchy(Layout(r, 2, 2), comm, None).allreduce(out[r], "sum", "t"),
                 eager=True, join_timeout=60)
    assert True in fake_setter["calls"]
    assert fake_setter["value"] is False  # back after the last collective
    assert np.array_equal(out[0], (np.arange(8, dtype=np.float32) * 2 + 1) * 2)


def test_switched_off_by_the_variable(fake_setter):
    from blink_horovod.ops.hierarchical import Hierarchy
    from blink_horovod.ops.layout import Layout
    from support.loopback import run_loopback

    out: list[np.ndarray] = [np.arange(8, dtype=np.float32) + r for r in range(2)]
    run_loopback(2, lambda r, comm: Hierarchy(Layout(r, 2, 2), comm, None).allreduce(out[r], "sum", "t"),
                 env={BLINK_MPI_YIELD: "0"}, eager=True, join_timeout=60)
    assert fake_setter["calls"] == []


def test_only_the_communicators_collectives_are_quieted(fake_setter):
    from blink_horovod.ops.quiet import Quiet, QuietCommunicator

    class Comm:
        local_rank = 1
        transport = "the transport"

        def allreduce(self, arr, op="sum", name=None):
            return fake_setter["value"], op, name

        def topology_name(self):
            return fake_setter["value"]

    comm = QuietCommunicator(Comm(), Quiet())
    assert comm.allreduce(None, "max", name="x") == (True, "max", "x")  # yielding inside
    assert comm.topology_name() is False  # not a collective: passed through as it is
    assert (comm.local_rank, comm.transport) == (1, "the transport")
    assert QuietCommunicator(Comm(), Quiet(mpi_yield=False)).allreduce(None)[0] is False
    assert fake_setter["value"] is False


def test_config_variable():
    assert load_config({}).mpi_yield is True
    assert load_config({BLINK_MPI_YIELD: "0"}).mpi_yield is False
    assert load_config({BLINK_MPI_YIELD: "1"}).mpi_yield is True
    with pytest.raises(ConfigError, match=BLINK_MPI_YIELD):
        load_config({BLINK_MPI_YIELD: "sometimes"})


def _open_pal() -> str | None:
    for name in ("libopen-pal.so.40", "libopen-pal.so.80", "libopen-pal.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux") or _open_pal() is None, reason="no Open MPI here")
def test_real_open_mpi_flag_flips_and_comes_back():
    """With Open MPI loaded (as Horovod's MPI controller loads it), the real flag is set and restored."""
    code = textwrap.dedent(f"""
        import ctypes
        lib = ctypes.CDLL({_open_pal()!r}, mode=ctypes.RTLD_GLOBAL)
        flag = ctypes.c_bool.in_dll(lib, "opal_progress_yield_when_idle")
        from blink_horovod.ops import mpi_yield
        before = flag.value
        with mpi_yield.yielding():
            inside = flag.value
        print(before, inside, flag.value)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "False"]
