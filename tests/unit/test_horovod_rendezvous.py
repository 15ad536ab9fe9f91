"""The Gloo rendezvous server of the Horovod we install (patches/horovod-0.28.1.patch) forgets no scope.

horovodrun's HTTP store clears a scope's keys once every rank of it has finished (sent DELETE).
Horovod 0.28.1 then reset the finished-rank lists of *every* scope, so the ranks that had already
finished another scope were forgotten and that scope kept its keys for the rest of the job.  A
second ``hvd.init()`` in the job (after ``hvd.shutdown()``) then read a peer's address of the first
init: Gloo failed with "connect ...: Connection refused" or with a send that never completed (seen
in CI: tests/parallel/test_ops_torch_exact.py, which re-initialises, about one run in twenty).
"""

from __future__ import annotations

import http.client

import pytest

pytestmark = [pytest.mark.timeout(60)]

hosts = pytest.importorskip("horovod.runner.common.util.hosts")
http_server = pytest.importorskip("horovod.runner.http.http_server")


def _plan() -> list:
    """Two hosts of two slots, as ``horovodrun -np 4 -H a:2,b:2``."""
    return [hosts.SlotInfo(hostname=h, rank=2 * i + lr, local_rank=lr, cross_rank=i, size=4, local_size=2,
                           cross_size=2) for i, h in enumerate("ab") for lr in range(2)]


def _request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Length": str(len(body or b""))})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.fixture()
def server():
    srv = http_server.RendezvousServer()
    port = srv.start()
    srv.init(_plan())
    yield port
    srv.stop()


def test_a_scope_finished_by_every_rank_is_cleared_whatever_the_order(server) -> None:
    port = server
    for scope, ranks in (("global", range(4)), ("local_a", (0, 1)), ("cross_0", (0, 2))):
        for r in ranks:
            assert _request(port, "PUT", f"/{scope}/{r}", f"addr-of-{r}".encode()) == 200
    # rank 0 is fast: done with its local scope before the slowest rank leaves the global one
    assert _request(port, "DELETE", "/local_a/0") == 200
    for r in range(4):
        assert _request(port, "DELETE", f"/global/{r}") == 200
    assert _request(port, "DELETE", "/local_a/1") == 200
    assert _request(port, "GET", "/global/1") == 404
    assert _request(port, "GET", "/local_a/1") == 404, "local_a kept rank 1's stale address"
    # a scope finished by only some ranks keeps its keys
    assert _request(port, "DELETE", "/cross_0/0") == 200
    assert _request(port, "GET", "/cross_0/2") == 200
    assert _request(port, "DELETE", "/cross_0/2") == 200
    assert _request(port, "GET", "/cross_0/2") == 404
