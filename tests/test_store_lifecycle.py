"""Store lifecycle: connections survive a 500, ids are validated and quoted, one
server per SQLite file, and a deleted + re-created id appears once in the terminal cursor."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from agl_lab.client import AglClient, AglHTTPError
from agl_lab.protocol import RolloutCreate
from agl_lab.server.backends import open_store
from agl_lab.server.store import StoreLocked

KEY = "k"


@pytest.fixture
def store_url(every_store_url):  # this file runs on every backend: memory, SQLite, PostgreSQL
    return every_store_url


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as c:
        yield c


# -- finding 5: an unexpected error is a JSON 500 on a connection that stays usable ---------------------


def test_unexpected_error_is_json_500_and_the_connection_stays_usable(server):
    store = server.app.state.store
    real, failures = store.patch_status, iter(range(1))

    def flaky(rollout_id, patch, **kwargs):  # fault injection: the first PATCH hits a bug in the store
        if next(failures, None) is not None:
            raise RuntimeError("boom")
        return real(rollout_id, patch, **kwargs)

    store.patch_status = flaky
    with AglClient(server.url, key=KEY, backoff_base=0.001) as client:
        ids = [r.rollout_id for r in client.create_rollouts([RolloutCreate(input={}) for _ in range(31)])]
        with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as raw:
            r = raw.patch(f"/api/rollouts/{ids[0]}", json={"status": {"state": "running"}})
            assert r.status_code == 500 and r.json()["detail"] == "Internal server error: RuntimeError: boom"
            assert r.headers.get("connection") != "close"
            for rid in ids[1:]:  # the same keep-alive connection: every non-retried call succeeds
                assert raw.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).status_code == 200
        for rid in ids[1:]:
            client.patch_status(rid, state="succeeded")  # sent once, no retry


# -- finding 7: rollout ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rid", ["a/b", "a?b", "a#b", "a b", "", "x" * 129, "é", "a%2Fb", ".", ".."]
)  # dot segments: clients drop them from a path, nothing could end them
def test_invalid_rollout_ids_are_refused(client, rid):
    r = client.post("/api/rollouts", json=[{"input": {}, "rollout_id": rid}])
    assert r.status_code == 422 and "rollout_id" in r.json()["detail"] and "A-Z" in r.json()["detail"], r.text
    listed = client.get("/api/rollouts", params={"state_in": "queuing"}).json()
    assert listed == []


def test_ids_with_every_allowed_character_round_trip_through_the_client(server):
    rid = "Ab9._:@+=-" + "x" * 118
    with AglClient(server.url, key=KEY, backoff_base=0.001) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id=rid)])
        client.patch_status(rid, state="running", last_attempt_id="0")
        client.add_event(rid, "0", "reward", {"value": 1.0})
        assert client.get_events(rid)[0]["data"] == {"value": 1.0}
        client.patch_status(rid, state="succeeded")
        assert client.delete_rollout(rid)
        with pytest.raises(AglHTTPError, match="404"):
            client.get_rollout(rid)


def test_client_quotes_ids_in_urls():
    from agl_lab.agent import agent_urls
    from agl_lab.client import _patch_status_call

    assert _patch_status_call("a/b?c#d", {}).path == "/api/rollouts/a%2Fb%3Fc%23d"
    base, events = agent_urls("http://s", "a/b", True)
    assert "/proxy/rollout/a%2Fb/attempt/0/" in base and events.endswith("/api/rollouts/a%2Fb/attempt/0/events")


# -- finding 8: one server per SQLite file ------------------------------------------------------------


def test_a_second_store_on_one_sqlite_file_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path}/one.db"
    first = open_store(url)
    try:
        with pytest.raises(StoreLocked, match="already open in another store or server process"):
            open_store(url)
        code = f"from agl_lab.server.backends import open_store; open_store({url!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "StoreLocked" in proc.stderr and "stop that server" in proc.stderr
    finally:
        first.close()
    open_store(url).close()  # closed: the file is free again


# -- finding 10: delete + re-create appears once in the terminal cursor -------------------------------


def test_deleted_and_recreated_id_appears_once_in_the_cursor(client):
    for _ in range(3):
        assert client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "again"}]).status_code == 201
        client.patch("/api/rollouts/again", json={"status": {"state": "running"}})
        client.patch("/api/rollouts/again", json={"status": {"state": "succeeded"}})
        page = client.get("/api/rollouts/terminal", params={"after": 0}).json()
        assert [i["rollout_id"] for i in page["items"]] == ["again"]
        client.delete("/api/rollouts/again")
    assert page["total_terminal"] == 3 and page["next_after"] == 3


def test_superseded_entries_in_a_bounded_log(embedded_server, store_url):
    server = embedded_server(default_proxy={"model_name": "m"}, store=store_url, terminal_log_limit=3)
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        for rid in ["a", "b", "a", "c", "a"]:
            c.delete(f"/api/rollouts/{rid}")
            c.post("/api/rollouts", json=[{"input": {}, "rollout_id": rid}])
            c.patch(f"/api/rollouts/{rid}", json={"status": {"state": "failed"}})
        page = c.get("/api/rollouts/terminal", params={"after": 0}).json()
        assert [i["rollout_id"] for i in page["items"]] == ["c", "a"] and page["next_after"] == 5


class _ResetThenAnswer:
    """A loopback HTTP server that resets the first `n_resets` requests, then answers 200 JSON.

    It counts only the requests this test's client sends (`GET /healthz`, `PATCH …/rollouts/r1…`):
    on a loaded machine a stale client of an earlier test's server, whose ephemeral port this
    one reuses, can connect too (CI saw `requests == 2` after one PATCH, with no retry logged)."""

    def __init__(self, n_resets: int):
        import socket
        import struct
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0

        def serve() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                line = data.split(b"\r\n", 1)[0]
                if not (line.startswith(b"GET /healthz ") or (line.startswith(b"PATCH ") and b"/r1" in line)):
                    conn.close()  # not this test's client
                    continue
                self.requests += 1
                if self.requests <= n_resets:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
                else:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
                        b'connection: close\r\n\r\n{"status":"ok"}'
                    )
                conn.close()

        threading.Thread(target=serve, daemon=True).start()

    def close(self) -> None:
        import socket

        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not, on Linux)
        self.sock.close()


def test_client_retries_idempotent_calls_on_a_reset_connection_only():
    from agl_lab.client import AglConnectionError

    server = _ResetThenAnswer(n_resets=2)
    try:
        with AglClient(server.url, backoff_base=0.001) as client:
            assert client.healthz() == {"status": "ok"} and server.requests == 3  # 2 resets, then the answer
            server.requests = 0
            with pytest.raises(AglConnectionError):
                client.patch_status("r1", state="running")  # not idempotent: sent once, never resent
            assert server.requests == 1
    finally:
        server.close()
