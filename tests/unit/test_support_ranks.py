"""The test rank runner hands every rank's failure back, with the rank's own traceback."""

from __future__ import annotations

import threading
import traceback

import pytest
from support.ranks import rank_outcomes, run_ranks

pytestmark = pytest.mark.timeout(30)


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(lambda r: r * r, 4) == [0, 1, 4, 9]


def test_a_failing_rank_is_raised_with_its_traceback_and_rank() -> None:
    def rank_body(r: int) -> int:
        if r in (1, 3):
            raise ValueError(f"bad value on {r}")
        return r

    with pytest.raises(ValueError, match="bad value on 1") as info:
        run_ranks(rank_body, 4)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "rank_body" in frames  # the rank's own frames, not only the runner's
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 4" in notes and "rank 3: ValueError: bad value on 3" in notes
    assert "rank_body" in info.value.rank_tracebacks[1] and info.value.rank_tracebacks[0] == ""


def test_a_rank_still_running_is_named() -> None:
    release = threading.Event()

    def rank_body(r: int) -> None:
        if r == 2:
            release.wait(5)

    try:
        with pytest.raises(AssertionError, match=r"ranks \[2\] still running after 0.2 s"):
            rank_outcomes(rank_body, 3, timeout=0.2)
    finally:
        release.set()
