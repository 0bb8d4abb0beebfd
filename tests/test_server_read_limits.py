"""What the server reads is bounded: request head size, how long a head or a body may stall,
and how large a model answer may be — each a ServerConfig key, each on a real socket."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.conftest import scaled
from tests.fakes import FakeOpenAI

KEY = "limits-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROXY = "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"
SAFETY_NET = 60  # seconds a socket waits before the test gives up (not a timing assertion)


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _connect(server) -> socket.socket:
    sock = socket.create_connection((server.config.host, server.config.port))
    sock.settimeout(SAFETY_NET)
    return sock


@pytest.fixture
def strict(embedded_server):
    return embedded_server(
        key=KEY,
        default_proxy={"model_name": "m"},
        header_timeout_seconds=scaled(0.5),
        body_timeout_seconds=scaled(0.5),
        max_header_bytes=8192,
    )


def test_an_idle_connection_is_closed(strict):
    with _connect(strict) as sock:
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout_seconds" in answer


def test_a_stalled_request_head_is_closed(strict):
    with _connect(strict) as sock:
        sock.sendall(b"POST /api/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout_seconds" in answer


def test_a_stalled_request_body_is_closed(strict):
    head = (
        f"POST /api/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n[{"input"'
    ).encode()
    with _connect(strict) as sock:
        sock.sendall(head)
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_seconds" in answer
    assert strict.store.list_rollouts(["queuing"]) == []


def test_a_huge_request_head_is_refused_unread(strict):
    with _connect(strict) as sock:
        sock.sendall(b"GET /api/rollouts?state_in=queuing HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        try:
            for _ in range(64):  # 4 MiB more; the server closes after the first 8 KiB
                sock.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = _until_closed(sock)
        except ConnectionResetError:  # it closed with our unread bytes in its buffer
            answer = b"reset"
    assert answer == b"reset" or (answer.startswith(b"HTTP/1.1 431") and b"max_header_bytes" in answer)
    with httpx.Client(base_url=strict.url, headers=strict.headers, trust_env=False) as c:  # still serving
        assert c.get("/api/rollouts", params={"state_in": "queuing"}, headers={"X-Fine": "a" * 4000}).status_code == 200


def test_a_head_at_the_limit_passes_and_one_past_it_does_not(strict):
    def send(extra: int) -> bytes:
        head = (
            f"GET /api/rollouts?state_in=queuing HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Connection: close\r\nX-Pad: "
        ).encode()
        head += b"p" * (8192 - len(head) - 4 + extra) + b"\r\n\r\n"
        with _connect(strict) as sock:
            sock.sendall(head)
            return _until_closed(sock)

    assert send(0).startswith(b"HTTP/1.1 200")
    assert send(1).startswith(b"HTTP/1.1 431")


def test_timeouts_never_cut_a_request_being_answered(embedded_server):
    slow = FakeOpenAI(delay_seconds=3.0)  # 3 × the read timeouts, which a client stalled between its
    slow.serve()  # connect and its send must not hit (1 s: a loaded host stalls a thread for 0.3 s)
    try:
        server = embedded_server(
            key=KEY, default_proxy={"model_name": "m"}, header_timeout_seconds=1.0, body_timeout_seconds=1.0
        )
        with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=SAFETY_NET) as c:
            c.post("/api/models", json=[{"model": "m", "endpoint": slow.base_url}]).raise_for_status()
            c.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}]).raise_for_status()
            for _ in range(2):  # and the kept-alive connection serves the next call too
                assert c.post(PROXY, json=CHAT).status_code == 200
    finally:
        slow.stop()


@pytest.mark.parametrize("client", ["raw", "aiohttp", "httpx"])
def test_an_oversized_model_answer_is_refused_not_stored(embedded_server, fake_upstream, client):
    fake_upstream.reply = "x" * 300_000  # > 256 KiB of content alone (the fake adds token ids)
    server = embedded_server(
        key=KEY,
        default_proxy={"model_name": "m", "include_log_probs": False},
        upstream_client=client,
        max_upstream_answer_bytes=256 * 2**10,
    )
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=SAFETY_NET) as c:
        c.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).raise_for_status()
        c.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}]).raise_for_status()
        r = c.post(PROXY, json=CHAT)
        assert r.status_code == 502 and "max_upstream_answer_bytes" in r.json()["cause"], r.text[:300]
        (event,) = server.store.events("r1")
        assert event.data["http_status"] == 502 and len(str(event.data)) < 10_000
        assert len(fake_upstream.requests) == 1  # not retried: the same request gets the same answer
        fake_upstream.reply = "small"
        assert c.post(PROXY, json=CHAT).status_code == 200


def _stall_loop_after_connect(server, seconds: float) -> None:
    """Once the server has taken a connection (its head timer armed), block the server's event
    loop for `seconds` inside an I/O callback, and return when the block has begun.

    The block sits where a starved thread or a slow callback of another socket stalls a server:
    after the loop polled its sockets, before it runs its due timers. Bytes that arrive meanwhile
    wait in the kernel while the head timer is due."""
    connections = server._uvicorn._server.server_state.connections
    deadline = time.monotonic() + SAFETY_NET
    while not connections:
        assert time.monotonic() < deadline, "the server never took the connection"
        time.sleep(0.005)
    (protocol,) = tuple(connections)
    loop, (mine, theirs) = protocol.loop, socket.socketpair()
    stalled = threading.Event()

    def stall() -> None:
        loop.remove_reader(mine.fileno())
        stalled.set()
        time.sleep(seconds)

    loop.call_soon_threadsafe(loop.add_reader, mine.fileno(), stall)
    theirs.send(b"x")  # the reader runs in the loop's poll phase
    assert stalled.wait(SAFETY_NET)
    mine.close(), theirs.close()  # closing is safe: the reader is removed


def test_a_stalled_server_reads_what_arrived_before_it_times_a_head_out(embedded_server):
    """The head's bytes arrive while the loop is blocked past header_timeout_seconds: when it runs
    again its timer is due and the bytes unread; the server reads them first and answers."""
    header_timeout = scaled(1.0)  # the send below must come within the loop's stall (3 of it)
    server = embedded_server(key=KEY, header_timeout_seconds=header_timeout)
    with _connect(server) as sock:
        _stall_loop_after_connect(server, 3 * header_timeout)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_a_stalled_server_still_times_out_a_head_the_waiting_bytes_leave_incomplete(embedded_server):
    header_timeout = scaled(1.0)  # the send below must come within the loop's stall (3 of it)
    server = embedded_server(key=KEY, header_timeout_seconds=header_timeout)
    with _connect(server) as sock:
        _stall_loop_after_connect(server, 3 * header_timeout)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Part")
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"header_timeout_seconds" in answer
