"""Who holds a cross-server exchange up: every rank answers its engine's state over TCP.

Within a server the ranks see each other's progress in shared memory, so a
stalled rank is named by its server-mates (:mod:`blink_horovod.runtime.transport`).
Across servers the only channel is stock Horovod, and a Horovod collective
that never completes says nothing of who has not submitted it (its stall
inspector logs "Missing ranks" on rank 0 alone, after
``HOROVOD_STALL_CHECK_TIME_SECONDS``).  Where no rank shares a server with the
stalled one (one rank per server, or a whole server stalled) the others
would time out without a name.

So, in a job of several servers, every rank runs a :class:`StatusResponder`:
a daemon thread with a listening socket that answers one line of JSON,
the state of the rank's engine (its round, whether it is negotiating,
running, idle in the caller's code, or stopped, and since when).  The
addresses are exchanged once, at ``hvd.init``, through Horovod itself.
When a cross-server wait times out, the rank asks its process set's members
(:func:`query_status`) and :func:`explain_timeout` names those that have not
reached the round it waits in -- a thread of a rank asleep in its own code
still answers -- and those that do not answer at all (stopped, hung, gone).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["StatusResponder", "explain_failure", "explain_timeout", "local_hosts", "machine_id", "query_status"]

log = logging.getLogger("blink_horovod.ops")

_REQUEST = b"blink-status\n"
_MAX_REPLY = 1 << 16


def machine_id() -> str:
    """What tells this machine from the job's others: the kernel's boot id (processes of one machine,
    containers too, see the same GPUs), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        return socket.gethostname()


def local_hosts() -> list[str]:
    """Names and addresses other hosts may reach this process on, most likely first.

    The address of the interface that routes to Horovod's Gloo rendezvous server (which every
    rank reaches), then the host names Horovod and the system give (resolved by the asker)."""
    out: list[str] = []
    driver = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if driver:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((driver, 9))  # UDP: no packet is sent, the kernel just picks the route
                out.append(s.getsockname()[0])
        except OSError:
            pass
    # (no getfqdn: a reverse lookup can take seconds where DNS is broken, and this runs in hvd.init)
    for name in (os.environ.get("HOROVOD_HOSTNAME"), socket.gethostname()):
        if name and name not in out:
            out.append(name)
    return out


class StatusResponder:
    """A daemon thread answering ``status()`` (a JSON-able dict) to each connection, one line each."""

    def __init__(self, status: Callable[[], Mapping[str, Any]]) -> None:
        self._status = status
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.5)  # so that close() ends the thread within half a second
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="blink-status", daemon=True)
        self._thread.start()

    def address(self) -> tuple[list[str], int]:
        """``(hosts, port)``: what the other ranks need to ask this one."""
        return local_hosts(), self.port

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(1.0)
                    if conn.recv(len(_REQUEST)) != _REQUEST:
                        continue
                    conn.sendall(json.dumps(dict(self._status())).encode() + b"\n")
                except Exception as exc:  # noqa: BLE001 - an asker gone mid-answer must not end the thread
                    log.debug("blink: status answer: %s", exc)

    def close(self) -> None:
        """Stop answering (idempotent)."""
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)


def _ask(hosts: Sequence[str], port: int, deadline: float) -> dict | str:
    """One rank's status, or why it could not be had ("gone", "silent", "unreachable: ...")."""
    why = "unreachable: no address"
    for host in hosts:
        left = deadline - time.monotonic()
        if left <= 0:
            return "silent"
        try:
            with socket.create_connection((host, port), timeout=left) as s:
                s.settimeout(max(deadline - time.monotonic(), 0.01))
                s.sendall(_REQUEST)
                data = b""
                while not data.endswith(b"\n") and len(data) < _MAX_REPLY:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            return json.loads(data)
        except ConnectionRefusedError:
            why = "gone"  # the host answers but nobody listens on the port: the process has exited
        except TimeoutError:
            return "silent"  # connected or not, no answer in time: stopped or hung
        except (OSError, ValueError) as exc:
            why = f"unreachable: {exc}"
    return why


def query_status(addresses: Mapping[int, tuple[Sequence[str], int]], timeout: float = 1.5) -> dict[int, dict | str]:
    """Ask every rank of ``addresses`` (``rank -> (hosts, port)``) at once; all answers within ``timeout``."""
    deadline = time.monotonic() + timeout
    if not addresses:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(addresses)), thread_name_prefix="blink-ask") as pool:
        futures = {r: pool.submit(_ask, hosts, port, deadline) for r, (hosts, port) in addresses.items()}
        return {r: f.result() for r, f in futures.items()}


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s:.0f} s"


def _why_late(status: dict | str, my_round: int) -> str | None:
    """Why a rank is not in round ``my_round``'s exchange (None: it is there or past it, or has stopped)."""
    if status == "gone":
        return "has exited (its status port refuses connections)"
    if status == "silent":
        return "does not answer (stopped, hung, or its host unreachable)"
    if isinstance(status, str):
        return f"cannot be asked ({status})"
    state, rnd, since = status.get("state"), int(status.get("round", -1)), float(status.get("since", 0.0))
    if state in ("broken", "closed"):
        return None  # it was there, and gave up (most likely on this very wait): see _why_stopped
    last = status.get("last")
    after = f", after {last}" if last else ""
    if rnd < my_round or (rnd == my_round and state == "idle"):
        return f"has not submitted it (in its own code for {_seconds(since)}{after})"
    return None


def _why_stopped(status: dict | str) -> str | None:
    if isinstance(status, dict) and status.get("state") == "broken":
        return f"has stopped after an error: {status.get('error', '?')}"
    if isinstance(status, dict) and status.get("state") == "closed":
        return "has shut Horovod down"
    return None


def explain_timeout(what: str, me: int, waited: float, my_round: int, statuses: Mapping[int, dict | str]) -> str:
    """The error line of a cross-server wait that timed out, naming the ranks that hold it up.

    ``statuses`` are the answers of the process set's other members (:func:`query_status`).
    As the waits within a server say it: "... waiting for rank 3 ...; ranks not arrived: [3]".
    Ranks that stopped after an error of their own (most likely this same wait's timeout) are
    not among those not arrived; they are named only where nobody else is."""
    late = {r: why for r in sorted(statuses) if (why := _why_late(statuses[r], my_round)) is not None}
    if not late:
        stopped = {r: why for r in sorted(statuses) if (why := _why_stopped(statuses[r])) is not None}
        if stopped:
            details = "; ".join(f"rank {r} {why}" for r, why in stopped.items())
            return f"{what}: rank {me} timed out after {waited:g} s: {details} (BLINK_TIMEOUT_SECONDS)"
        return (f"{what}: rank {me} timed out after {waited:g} s; every other rank of the exchange is in it "
                f"too (stock Horovod did not complete it) (BLINK_TIMEOUT_SECONDS)")
    first = min(late)
    details = "; ".join(f"rank {r} {why}" for r, why in late.items())
    return (f"{what}: rank {me} timed out after {waited:g} s waiting for rank {first} (cross-server exchange); "
            f"ranks not arrived: {sorted(late)}: {details} (BLINK_TIMEOUT_SECONDS)")


def explain_failure(what: str, me: int, statuses: Mapping[int, dict | str], pids: Mapping[int, int],
                    cause: BaseException) -> str | None:
    """The error line of a cross-server stage that stock Horovod failed (typically "Horovod has been
    shut down" after Gloo lost a rank), naming the ranks that have exited -- or None where every rank
    is still there (then Horovod's own error says more than this would)."""
    gone = sorted(r for r, st in statuses.items() if st == "gone")
    if not gone:
        return None
    names = ", ".join(f"rank {r} (pid {pids[r]})" if r in pids else f"rank {r}" for r in gone)
    verb = "has" if len(gone) == 1 else "have"
    return (f"{what}: rank {me} lost {names}: {verb} exited (status port refuses connections); "
            f"stock Horovod then failed: {type(cause).__name__}: {cause}")
