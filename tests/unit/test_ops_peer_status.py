"""Ranks of other servers asked where they are (ops/peer_status.py): real sockets, real threads."""

from __future__ import annotations

import socket
import time

import pytest
from blink_horovod.ops.peer_status import StatusResponder, explain_timeout, query_status

pytestmark = pytest.mark.timeout(30)


def test_a_responder_answers_its_status_and_stops_on_close() -> None:
    calls = []

    def status():
        calls.append(1)
        return {"rank": 3, "round": 7, "state": "idle", "since": 2.5, "last": "allreduce 'w'"}

    r = StatusResponder(status)
    try:
        hosts, port = r.address()
        assert hosts and port > 0
        got = query_status({3: (["127.0.0.1"], port)}, timeout=5)
        assert got == {3: {"rank": 3, "round": 7, "state": "idle", "since": 2.5, "last": "allreduce 'w'"}}
        assert calls == [1]
    finally:
        r.close()
    assert query_status({3: (["127.0.0.1"], port)}, timeout=2) == {3: "gone"}


def test_a_listener_that_never_answers_is_silent_and_bounded() -> None:
    with socket.socket() as s:  # accepts connections (the kernel's backlog) but never replies: a stopped rank
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        got = query_status({5: (["127.0.0.1"], s.getsockname()[1])}, timeout=0.5)
        assert got == {5: "silent"}
        assert time.monotonic() - t0 < 2.0


def test_unresolvable_hosts_are_tried_in_order() -> None:
    r = StatusResponder(lambda: {"round": 1, "state": "negotiating"})
    try:
        got = query_status({1: (["no-such-host.invalid", "127.0.0.1"], r.port)}, timeout=5)
        assert got[1]["state"] == "negotiating"
    finally:
        r.close()


def test_the_line_names_the_ranks_not_arrived_and_why() -> None:
    statuses = {
        2: {"round": 4, "state": "idle", "since": 7.43, "last": "allreduce 'warm'"},
        3: "silent",
        4: {"round": 4, "state": "negotiating", "since": 7.5},
        5: {"round": 5, "state": "running", "since": 0.1},
        6: "gone",
        7: {"round": 4, "state": "broken", "since": 1.0, "error": "rank 9 died"},
    }
    line = explain_timeout("cross-server metadata blink.neg.4", 1, 7.5, 4, statuses)
    assert line.startswith("cross-server metadata blink.neg.4: rank 1 timed out after 7.5 s waiting for rank 2 ")
    assert "ranks not arrived: [2, 3, 6]" in line
    assert "rank 2 has not submitted it (in its own code for 7.4 s, after allreduce 'warm')" in line
    assert "rank 3 does not answer (stopped, hung, or its host unreachable)" in line
    assert "rank 6 has exited" in line
    assert "rank 4 " not in line and "rank 5 " not in line and "rank 7 " not in line


def test_ranks_that_gave_up_are_named_only_where_nobody_is_late() -> None:
    line = explain_timeout("x", 1, 7.5, 4, {7: {"round": 4, "state": "broken", "error": "rank 9 died"},
                                            8: {"round": 4, "state": "negotiating"}})
    assert line == "x: rank 1 timed out after 7.5 s: rank 7 has stopped after an error: rank 9 died " \
                   "(BLINK_TIMEOUT_SECONDS)"


def test_a_rank_behind_by_a_round_is_late_and_everyone_present_says_so() -> None:
    assert "ranks not arrived: [0]" in explain_timeout("x", 1, 3, 6, {0: {"round": 5, "state": "running"}})
    line = explain_timeout("x", 1, 3, 6, {0: {"round": 6, "state": "negotiating"}})
    assert "every other rank of the exchange is in it too" in line and "not arrived" not in line


_ABORTING = """
import sys
from blink_horovod.runtime import last_words
peers = {1: (["127.0.0.1"], int(sys.argv[1]), 4242), 2: (["no-such-host.invalid", "localhost"], int(sys.argv[2]), 77),
         3: ([], 1, 5)}
assert last_words.install(0, peers) == 2, "rank 3 has no address and is not asked"
last_words._library().blink_last_words_selftest(b"Connection closed by peer [127.0.0.1]:4242")
"""


@pytest.mark.timeout(120)
def test_an_uncaught_cpp_exception_names_the_ranks_that_exited_before_aborting() -> None:
    """What Horovod's background thread does when Gloo loses a dead rank, played by a thread of our own."""
    import os
    import signal
    import subprocess
    import sys

    live = StatusResponder(lambda: {"round": 0, "state": "idle"})
    with socket.socket() as s:  # a port nobody listens on any more: a rank that has exited
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-c", _ABORTING, str(dead_port), str(live.port)],
                              capture_output=True, text=True, timeout=100, env=dict(os.environ))
    finally:
        live.close()
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[blink_horovod ERROR] rank 0:")]
    assert len(ours) == 1, proc.stderr
    assert "rank 1 (pid 4242) has exited" in ours[0] and "rank 2" not in ours[0], ours[0]
    assert "Connection closed by peer [127.0.0.1]:4242" in ours[0], ours[0]
    # libstdc++'s own handler still speaks after ours
    assert "terminate called after throwing an instance of 'std::runtime_error'" in proc.stderr, proc.stderr


_REPLACED = """
import sys
from blink_horovod.runtime import last_words
assert last_words.install(0, {1: (["127.0.0.1"], int(sys.argv[1]), 4242)}) == 1
lib = last_words._library()
lib.blink_last_words_selftest_replace(0)  # a library loaded later sets its own handler, which does not chain
lib.blink_last_words_selftest(b"Connection reset by peer")
"""


@pytest.mark.timeout(120)
def test_an_abort_through_another_terminate_handler_still_names_the_ranks_that_exited() -> None:
    """Seen with CUDA tensors under torch: the survivors' terminate handler was not ours; the SIGABRT that
    ends the process then speaks for it."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", _REPLACED, str(dead_port)], capture_output=True, text=True,
                          timeout=100, env=dict(os.environ), check=False)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    assert "newcomer's terminate handler" in proc.stderr, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[blink_horovod ERROR] rank 0:")]
    assert len(ours) == 1, proc.stderr
    assert "rank 1 (pid 4242) has exited" in ours[0] and "the lines before this one say" in ours[0], ours[0]


def test_a_horovod_failure_is_explained_only_where_a_rank_has_exited() -> None:
    from blink_horovod.errors import BlinkInternalError, BlinkTimeoutError
    from blink_horovod.ops.horovod_wait import wait_horovod
    from blink_horovod.ops.peer_status import explain_failure

    def shut_down(_handle):
        raise RuntimeError("Horovod has been shut down")

    def explain_with(statuses):
        return lambda what, waited, cause: (
            explain_timeout(what, 0, waited, 1, statuses) if cause is None
            else explain_failure(what, 0, statuses, {3: 4242}, cause))

    with pytest.raises(BlinkInternalError) as got:
        wait_horovod(lambda h: True, shut_down, None, 1.0, "cross-server metadata blink.neg.1", None,
                     explain_with({3: "gone", 1: {"round": 1, "state": "negotiating"}}))
    assert str(got.value) == ("cross-server metadata blink.neg.1: rank 0 lost rank 3 (pid 4242): has exited "
                              "(status port refuses connections); stock Horovod then failed: RuntimeError: "
                              "Horovod has been shut down")
    with pytest.raises(RuntimeError, match="^Horovod has been shut down$"):  # everyone there: Horovod's own error
        wait_horovod(lambda h: True, shut_down, None, 1.0, "x", None, explain_with({1: {"round": 1}}))
    with pytest.raises(BlinkTimeoutError, match="waiting for rank 3 .*ranks not arrived: \\[3\\]"):
        wait_horovod(lambda h: False, shut_down, None, 0.05, "x", None, explain_with({3: "silent"}))


_UNINSTALLED = """
from blink_horovod.runtime import last_words
last_words.install(0, {1: (["127.0.0.1"], 1, 5)})
assert last_words.uninstall() is True and last_words.uninstall() is False
last_words._library().blink_last_words_selftest(b"after the job")
"""


@pytest.mark.timeout(120)
def test_after_uninstall_an_abort_says_nothing_of_the_job_that_ended() -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _UNINSTALLED], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ), check=False)
    assert "blink_horovod ERROR" not in proc.stderr, proc.stderr
    assert "terminate called after throwing an instance of 'std::runtime_error'" in proc.stderr, proc.stderr
