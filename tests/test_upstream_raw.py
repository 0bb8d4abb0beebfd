"""The raw upstream client (agl_lab.server.upstream.RawUpstream) against real servers on loopback.

A scripted socket server answers per request path: Content-Length, chunked, or a body ended by
closing; `Connection: close`; a keep-alive connection closed while idle (stale in the pool); a
reset mid-answer; garbage. It counts connections, so reuse and reconnects are asserted, not
assumed. uvicorn (the fake OpenAI server) is exercised by every gateway test through "auto".
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest

from agl_lab.server.upstream import (
    RawUpstream,
    UpstreamRefused,
    UpstreamTransportError,
    open_upstream_client,
)

BODY = b'{"ok": true}'


def _head(status: str, *headers: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


class ScriptedServer:
    """Answers each request by its path (see `_answer`); counts connections and requests."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[tuple[str, bytes, bytes]] = []  # (path, head, body)
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self._stop = True
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not, on Linux)
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                path = head.split(b" ")[1].decode()
                self.requests.append((path, head, body))
                if not self._answer(conn, path):
                    return

    def _answer(self, conn: socket.socket, path: str) -> bool:
        """Send the answer `path` asks for; False closes the connection."""
        if path == "/length":
            conn.sendall(_head("200 OK", "Content-Type: application/json", f"Content-Length: {len(BODY)}") + BODY)
        elif path == "/chunked":
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (BODY[:5], BODY[5:])) + b"0\r\n\r\n"
            conn.sendall(_head("200 OK", "Content-Type: application/json", "Transfer-Encoding: chunked") + chunks)
        elif path == "/until-close":
            conn.sendall(_head("200 OK", "Content-Type: application/json") + BODY)
            return False
        elif path == "/close-header":
            conn.sendall(
                _head("200 OK", "Content-Type: application/json", f"Content-Length: {len(BODY)}", "Connection: close")
                + BODY
            )
            return False
        elif path == "/then-idle-close":  # keep-alive answer, then the server drops the idle connection
            conn.sendall(_head("200 OK", "Content-Type: application/json", f"Content-Length: {len(BODY)}") + BODY)
            return False
        elif path == "/retry-after":
            conn.sendall(
                _head(
                    "503 Service Unavailable", "Content-Type: application/json", "Retry-After: 7", "Content-Length: 2"
                )
                + b"{}"
            )
        elif path == "/reset-mid-answer":
            conn.sendall(_head("200 OK", "Content-Type: application/json", "Content-Length: 1000") + b'{"partial')
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            return False
        elif path == "/close-before-answer":
            return False
        elif path == "/garbage":
            conn.sendall(b"this is not HTTP at all\r\n\r\n")
            return False
        return True


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


def run(coro_fn):
    async def main():
        client = RawUpstream()
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_content_length_answer_and_keep_alive_reuse(server):
    async def calls(client):
        return [await client.post_json(server.url("/length"), b'{"n": %d}' % i) for i in range(3)]

    answers = run(calls)
    assert [(a.status_code, a.content_type, a.content, a.retry_after) for a in answers] == [
        (200, "application/json", BODY, None)
    ] * 3
    assert server.connections == 1  # one keep-alive connection for all three
    path, head, body = server.requests[2]
    assert (path, body) == ("/length", b'{"n": 2}')
    assert b"content-type: application/json" in head.lower() and b"content-length: 8" in head.lower()
    assert b"host: 127.0.0.1:%d" % server.port in head.lower()


def test_chunked_and_close_delimited_answers(server):
    async def calls(client):
        return [await client.post_json(server.url(p), b"{}") for p in ("/chunked", "/until-close", "/chunked")]

    answers = run(calls)
    assert [a.content for a in answers] == [BODY] * 3
    assert server.connections == 2  # the close-delimited answer used up its connection


def test_connection_close_header_is_honoured(server):
    async def calls(client):
        return [await client.post_json(server.url("/close-header"), b"{}") for _ in range(2)]

    assert [a.content for a in run(calls)] == [BODY, BODY]
    assert server.connections == 2


def test_stale_pooled_connection_is_retried_on_a_new_one(server):
    async def calls(client):
        first = await client.post_json(server.url("/then-idle-close"), b"{}")
        await asyncio.sleep(0.2)  # the server's FIN arrives while the connection idles in the pool
        second = await client.post_json(server.url("/length"), b"{}")
        return first, second

    first, second = run(calls)
    assert (first.content, second.content) == (BODY, BODY)
    assert server.connections == 2
    assert [p for p, _, _ in server.requests] == ["/then-idle-close", "/length"]  # sent once each


def test_retry_after_and_status_are_returned(server):
    answer = run(lambda client: client.post_json(server.url("/retry-after"), b"{}"))
    assert (answer.status_code, answer.retry_after, answer.content) == (503, "7", b"{}")


@pytest.mark.parametrize(
    "path, message",
    [
        ("/reset-mid-answer", "closed the connection mid-answer"),
        ("/close-before-answer", "closed the connection before answering"),
        ("/garbage", "invalid HTTP answer"),
    ],
)
def test_broken_answers_are_transport_errors_and_not_resent(server, path, message):
    with pytest.raises(UpstreamTransportError, match=message):
        run(lambda client: client.post_json(server.url(path), b"{}"))
    assert [p for p, _, _ in server.requests] == [path]  # a fresh connection is never retried here


def test_broken_connection_is_not_reused(server):
    async def calls(client):
        with pytest.raises(UpstreamTransportError):
            await client.post_json(server.url("/garbage"), b"{}")
        return await client.post_json(server.url("/length"), b"{}")

    assert run(calls).content == BODY
    assert server.connections == 2


def test_refused_connection_and_bad_urls():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UpstreamRefused, match=f"127.0.0.1:{dead}"):
            run(lambda client: client.post_json(f"http://127.0.0.1:{dead}/v1/chat/completions", b"{}"))
    for url in ("ftp://x/v1", "not a url", "http://127.0.0.1:99999/v1"):
        with pytest.raises(UpstreamTransportError, match="model server URL"):
            run(lambda client, url=url: client.post_json(url, b"{}"))


def test_cancelled_call_closes_its_connection(server):
    async def calls(client):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.post_json(server.url("/silent"), b"{}")  # never answered
        return await client.post_json(server.url("/length"), b"{}")

    assert run(calls).content == BODY
    assert server.connections == 2  # the abandoned connection was not put back in the pool


def test_auto_is_the_raw_client():
    assert isinstance(open_upstream_client("auto", 1.0), RawUpstream)
    assert isinstance(open_upstream_client("raw", 1.0), RawUpstream)


def test_reused_connection_closed_before_any_answer_is_resent_once(server):
    """The race the pool check cannot see: the server closes a keep-alive connection just as a
    request goes out on it. Nothing of an answer came back, so the request goes out once more
    on a new connection; when that one fails too, the error is the caller's."""

    async def calls(client):
        await client.post_json(server.url("/length"), b"{}")
        with pytest.raises(UpstreamTransportError, match="before answering"):
            await client.post_json(server.url("/close-before-answer"), b"{}")

    run(calls)
    assert [p for p, _, _ in server.requests] == ["/length", "/close-before-answer", "/close-before-answer"]
    assert server.connections == 2
