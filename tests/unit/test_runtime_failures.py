"""Failures end in clear errors on every rank, never in a hang (loopback ranks, short timeouts)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from support.loopback import rank_errors, run_loopback

from blink_horovod.errors import (
    BlinkInternalError,
    BlinkTimeoutError,
    ConfigError,
    MismatchError,
)
from blink_horovod.runtime import executor as executor_mod
from blink_horovod.runtime import metadata
from blink_horovod.runtime.faults import FaultSpec, parse_fault

pytestmark = pytest.mark.timeout(60)

FAST = {"BLINK_TIMEOUT_SECONDS": "2", "BLINK_STALL_CHECK_SECONDS": "0.5"}


def test_shape_mismatch_raises_on_every_rank_naming_both() -> None:
    def body(r, comm):
        comm.allreduce(np.ones(4096 + (r == 1), np.float32), name="grad.w")

    errors = rank_errors(3, body, env=FAST)
    for e in errors:
        assert isinstance(e, MismatchError), e
        assert "rank 1 sent shape [4097], rank 0 sent [4096]" in str(e)
        assert "allreduce 'grad.w'" in str(e)
    assert len({str(e) for e in errors}) == 1  # the same message everywhere


@pytest.mark.parametrize(
    "field,kwargs0,kwargs1,text",
    [
        ("dtype", {"dtype": np.float32}, {"dtype": np.float64}, "rank 1 sent dtype float64, rank 0 sent float32"),
        ("op", {"op": "sum"}, {"op": "max"}, "rank 1 sent op max, rank 0 sent sum"),
        ("name", {"name": "a"}, {"name": "b"}, "rank 1 sent name 'b', rank 0 sent 'a'"),
    ],
)
def test_other_mismatches(field, kwargs0, kwargs1, text) -> None:
    def body(r, comm):
        kw = kwargs1 if r == 1 else kwargs0
        x = np.ones(10, kw.get("dtype", np.float32))
        comm.allreduce(x, kw.get("op", "sum"), name=kw.get("name", "t"))

    for e in rank_errors(2, body, env=FAST):
        assert isinstance(e, MismatchError) and text in str(e), e


def test_root_and_collective_mismatch() -> None:
    def body(r, comm):
        comm.broadcast(np.ones(10, np.float32), root=1 if r == 2 else 0, name="b")

    for e in rank_errors(3, body, env=FAST):
        assert isinstance(e, MismatchError) and "rank 2 sent root 1, rank 0 sent 0" in str(e)

    def body2(r, comm):
        x = np.ones(10, np.float32)
        comm.broadcast(x, 0) if r == 0 else comm.allreduce(x)

    for e in rank_errors(2, body2, env=FAST):
        assert isinstance(e, MismatchError) and "rank 1 sent collective allreduce, rank 0 sent broadcast" in str(e)


def test_missing_rank_times_out_naming_it_and_warns_of_the_stall(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="blink_horovod.runtime")

    def body(r, comm):
        comm.allreduce(np.ones(100, np.float32))
        if r == 2:
            time.sleep(3.5)  # misses the second collective, past the others' timeout
            return
        comm.allreduce(np.ones(100, np.float32))

    start = time.monotonic()
    errors = rank_errors(3, body, env=FAST)
    waited = time.monotonic() - start
    assert errors[2] is None
    for e in errors[:2]:
        assert isinstance(e, BlinkTimeoutError), e
        assert "waiting for rank 2" in str(e) and "timed out after 2 s" in str(e)
    assert waited < 10
    stalls = [r.getMessage() for r in caplog.records if "Missing ranks" in r.getMessage()]
    assert stalls and all("Missing ranks: 2" in m for m in stalls)


def test_a_rank_that_raises_makes_the_others_raise_naming_it() -> None:
    def body(r, comm):
        comm.allreduce(np.ones(1000, np.float32))

    env = dict(FAST, BLINK_FAULT="raise:after=2:rank=1", BLINK_CHUNK_BYTES="400")
    start = time.monotonic()
    errors = rank_errors(4, body, env=env)
    assert time.monotonic() - start < 2  # well before the timeout
    assert isinstance(errors[1], BlinkInternalError) and "fault injected" in str(errors[1])
    for r in (0, 2, 3):
        assert isinstance(errors[r], BlinkInternalError), errors[r]
        assert "rank 1 failed" in str(errors[r])


def test_a_rank_failing_inside_the_fused_steps_makes_the_others_raise_naming_it() -> None:
    """The data loop production runs (fused steps, no BLINK_FAULT) fails over cleanly too.

    BLINK_FAULT counts chunk operations one by one and so forces the unfused
    path; here rank 1's chunk copier raises on its second copy instead, inside
    the fused step loop, while its peers wait there on its flags.
    """

    class FailingCopier:
        def __init__(self, real) -> None:
            self.real, self.calls = real, 0

        def _count(self) -> None:
            self.calls += 1
            if self.calls == 2:
                raise BlinkInternalError("chunk copy failed on purpose")

        def copy(self, dst, src) -> None:
            self._count()
            self.real.copy(dst, src)

        def copy2(self, dst, dst2, src) -> None:
            self._count()
            self.real.copy2(dst, dst2, src)

    def body(r, comm):
        ex = comm._executor
        assert ex.faults is None and executor_mod._FUSE  # the fused path, as in production
        if r == 1:
            real_run, real_copier = ex._run, ex.copier

            def run(*args, **kwargs):
                ex.copier = FailingCopier(real_copier)
                try:
                    return real_run(*args, **kwargs)
                finally:
                    ex.copier = real_copier

            def unfused(*args, **kwargs):
                raise AssertionError("the unfused op-by-op path ran")

            ex._run, ex._run_ops = run, unfused
        comm.allreduce(np.ones(1000, np.float32))

    start = time.monotonic()
    errors = rank_errors(4, body, env=dict(FAST, BLINK_CHUNK_BYTES="400"))
    assert time.monotonic() - start < 2  # well before the timeout
    assert isinstance(errors[1], BlinkInternalError) and "failed on purpose" in str(errors[1]), errors[1]
    for r in (0, 2, 3):
        assert isinstance(errors[r], BlinkInternalError), errors[r]
        assert "rank 1 failed" in str(errors[r]) and "failed on purpose" in str(errors[r]), errors[r]


def test_a_closed_peer_is_named() -> None:
    def body(r, comm):
        comm.allreduce(np.ones(10, np.float32))
        if r != 0:
            comm.allreduce(np.ones(10, np.float32))

    errors = rank_errors(3, body, env=FAST)
    assert errors[0] is None
    for e in errors[1:]:
        assert isinstance(e, BlinkInternalError) and "rank 0 closed its communicator" in str(e), e


def test_a_stalled_rank_makes_everyone_fail_by_the_timeout() -> None:
    def body(r, comm):
        comm.allreduce(np.ones(1000, np.float32))

    env = dict(FAST, BLINK_FAULT="stall:after=1:rank=0", BLINK_CHUNK_BYTES="400")
    start = time.monotonic()
    errors = rank_errors(3, body, env=env)
    assert time.monotonic() - start < 6
    assert all(e is not None for e in errors)
    assert any(isinstance(e, BlinkTimeoutError) and "waiting for rank 0" in str(e) for e in errors[1:])


def test_corruption_changes_exactly_the_result() -> None:
    def body(r, comm):
        x = np.full(1000, r + 1, np.float32)
        comm.allreduce(x)
        return int(np.count_nonzero(x != 10))

    env = {"BLINK_FAULT": "corrupt:after=0:rank=3", "BLINK_CHUNK_BYTES": "400"}
    wrong = run_loopback(4, body, env=env)
    assert sum(wrong) > 0


def test_unusable_after_failure() -> None:
    def body(r, comm):
        try:
            comm.allreduce(np.ones(10 + (r == 1), np.float32))
        except MismatchError:
            pass
        comm.allreduce(np.ones(10, np.float32))

    for e in rank_errors(2, body, env=FAST):
        assert isinstance(e, BlinkInternalError) and "unusable after an earlier failure" in str(e)


def test_bad_arguments_are_config_errors() -> None:
    def body(r, comm):
        with pytest.raises(ConfigError, match="op: unknown reduction 'mean'"):
            comm.allreduce(np.ones(4, np.float32), "mean")
        with pytest.raises(ConfigError, match="dtype: complex128 is not supported"):
            comm.allreduce(np.ones(4, np.complex128))
        with pytest.raises(ConfigError, match="C-contiguous"):
            comm.allreduce(np.ones((4, 4), np.float32)[:, 1])
        with pytest.raises(ConfigError, match="root: expected a local rank in 0..1, got 5"):
            comm.broadcast(np.ones(4, np.float32), 5)
        with pytest.raises(ConfigError, match="expected a numpy array"):
            comm.allreduce([1, 2])

    run_loopback(2, body)


# -- pure pieces ---------------------------------------------------------------------
def test_metadata_agreement_fast_path_and_groups() -> None:
    a = metadata.encode({"collective": "allreduce", "name": "g", "shape": [3], "dtype": "float32"}, {"t": 1.0})
    b = metadata.encode({"collective": "allreduce", "name": "g", "shape": [3], "dtype": "float32"}, {"t": 2.0})
    assert metadata.check_agreement([a, b], 1) == [{"t": 1.0}, {"t": 2.0}]
    c = metadata.encode({"collective": "allreduce", "name": "g", "shape": [4], "dtype": "float32"})
    d = metadata.encode({"collective": "allreduce", "name": "g", "shape": [5], "dtype": "float32"})
    with pytest.raises(MismatchError, match=r"rank 1 sent shape \[4\], rank 0 sent \[3\]; by value: "
                                            r"\[3\]: ranks \[0, 3\]; \[4\]: ranks \[1\]; \[5\]: ranks \[2\]"):
        metadata.check_agreement([a, c, d, b], 9)


def test_long_names_stay_bounded_and_distinct() -> None:
    p1 = metadata.encode({"name": "x" * 5000 + "1"})
    p2 = metadata.encode({"name": "x" * 5000 + "2"})
    assert len(p1) < 1000 and p1 != p2


@pytest.mark.parametrize(
    "text,spec",
    [
        ("kill:after=3:rank=1", FaultSpec("kill", 3, 1)),
        ("raise:after=0", FaultSpec("raise", 0, None)),
        ("stall:after=5:rank=2:seconds=1.5", FaultSpec("stall", 5, 2, 1.5)),
        ("CORRUPT:after=1", FaultSpec("corrupt", 1, None)),
    ],
)
def test_fault_specs_parse(text, spec) -> None:
    assert parse_fault(text) == spec


@pytest.mark.parametrize("text", ["explode:after=1", "kill", "kill:after=-1", "kill:after=x", "kill:after=1:when=2",
                                  "kill:after=1:after=2", "stall:after=1:seconds=soon"])
def test_bad_fault_specs_name_the_variable(text) -> None:
    with pytest.raises(ConfigError, match="BLINK_FAULT"):
        parse_fault(text)


def test_a_planner_failure_on_rank_0_fails_every_rank_fast() -> None:
    from blink_horovod.errors import PlanError

    def planner(topology, collective, root):
        raise PlanError("plan: no tree spans the allocation")

    def body(r, comm):
        comm.allreduce(np.ones(10, np.float32))

    start = time.monotonic()
    errors = rank_errors(3, body, env=FAST, planner=planner)
    assert time.monotonic() - start < 1.5
    assert isinstance(errors[0], PlanError)
    for e in errors[1:]:
        assert isinstance(e, BlinkInternalError) and "rank 0 failed: plan: no tree spans" in str(e), e


def test_eager_path_mismatch_and_missing_rank() -> None:
    def body(r, comm):
        comm.allreduce(np.ones(64 + (r == 2), np.float32), name="small")

    for e in rank_errors(3, body, env=FAST, eager=True):
        assert isinstance(e, MismatchError) and "rank 2 sent shape [65], rank 0 sent [64]" in str(e), e

    def body2(r, comm):
        if r != 1:
            comm.allreduce(np.ones(64, np.float32))

    errors = rank_errors(3, body2, env=FAST, eager=True)
    assert errors[1] is None
    assert all(isinstance(e, (BlinkTimeoutError, BlinkInternalError)) and "rank 1" in str(e) for e in (errors[0], errors[2]))


def test_a_peer_closing_during_a_collective_is_named_not_decoded() -> None:
    """A GPU communicator's rank posts CLOSING where metadata goes when it closes; a peer that started
    a collective then reads it in its slot and says so, instead of failing to parse it."""
    meta = metadata.encode({"collective": "allreduce", "name": "g", "dtype": "float32", "shape": [4]}, {"g": 1})
    with pytest.raises(BlinkInternalError, match=r"collective 7: local rank 1 closed the communicator .* "
                                                 r"while local ranks 0, 2 started a collective"):
        metadata.check_agreement([meta, metadata.CLOSING, meta], 7)
