"""The fault harness itself: a hung rank fails the test in time, kills land, events come back.

These need no runtime: they prove that the cases built on the harness
(conftest.py) cannot hang and measure what they claim to.
"""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = pytest.mark.timeout(60)


def test_events_exit_codes_and_params_come_back(ranks) -> None:
    group = ranks.start(
        2,
        """
        def body():
            emit("hello", value=PARAMS["value"] * (RANK + 1))
            if RANK == 1:
                from blink_horovod.errors import MismatchError
                raise MismatchError("rank 1 sent shape [3], rank 0 sent [2]")
        main(body)
        """,
        params={"value": 21},
        limit=30,
    )
    r0, r1 = group.wait()
    assert r0.returncode == 0 and r0.event("hello")["value"] == 21 and r0.event("done")
    assert r1.returncode == 1 and r1.event("hello")["value"] == 42
    assert r1.event("error")["type"] == "MismatchError"
    assert "BlinkError" in r1.event("error")["mro"]


def test_a_hung_rank_fails_the_test_at_the_limit_and_is_killed(ranks) -> None:
    group = ranks.start(1, "import time\ntime.sleep(600)\n", limit=3)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 3 s: a hang"):
        group.wait()
    assert time.monotonic() - t0 < 6
    assert group.procs[0].poll() is not None  # killed, not left behind


def test_kill_reaches_the_rank_and_its_exit_is_timed(ranks) -> None:
    group = ranks.start(1, "def body():\n    emit('ready')\n    import time; time.sleep(600)\nmain(body)\n", limit=30)
    group.wait_event(0, "ready")
    sent = group.kill(0, signal.SIGKILL)
    gone = group.wait_exit(0)
    assert 0 <= gone - sent < 1.0
    (result,) = group.wait()
    assert result.returncode == -signal.SIGKILL
