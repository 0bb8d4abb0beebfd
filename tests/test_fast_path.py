"""The proxy's fast path (agl_lab.server.asgi) answers exactly as FastAPI's stack would.

Each request is sent twice over real loopback HTTP to one server: through the fast path
(`AglApp.proxy_fast_path`, counted so we know it answered) and with the fast path switched
off (FastAPI's middleware stack and the Starlette route). Status, the headers an agent reads
and the body must match. Then the one-write uvicorn protocol is driven through its real code
with a recording transport.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from agl_lab.protocol import rollout_token
from agl_lab.server.store import InvalidTransition

KEY = "k"
LIMIT = 4096
PROXY = "/proxy/rollout/{rid}/attempt/0/mode/{mode}/openai/v1/{path}"
CHAT = b'{"messages": [{"role": "user", "content": "hi"}]}'


class Counting:
    """Wraps the app's ProxyFastPath and counts the requests it answered."""

    def __init__(self, fast: Any):
        self.fast, self.answered = fast, 0

    def match(self, path: str) -> Any:
        return self.fast.match(path)

    async def __call__(self, *args: Any) -> None:
        self.answered += 1
        await self.fast(*args)


def crash(call: Any) -> None:
    """A rewriter failing like a bug would (JSON 500), or with a store error (its handler's 409)."""
    if call.rollout.rollout_id == "boom":
        raise RuntimeError("rewriter bug")
    if call.rollout.rollout_id == "conflict":
        raise InvalidTransition("conflict", "succeeded", "running")


@pytest.fixture
def server(embedded_server, fake_upstream):
    s = embedded_server(key=KEY, max_body_bytes=LIMIT, default_proxy={"model_name": "m"}, rewriters=[crash])
    import httpx

    with httpx.Client(base_url=s.url, headers=s.headers, trust_env=False) as admin:
        admin.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).raise_for_status()
        admin.post(
            "/api/rollouts", json=[{"input": {}, "rollout_id": r} for r in ("r1", "r2", "boom", "conflict")]
        ).raise_for_status()
        for state in ("running", "succeeded"):
            admin.patch("/api/rollouts/r2", json={"status": {"state": state}}).raise_for_status()
    return s


class Connection:
    """One keep-alive HTTP/1.1 connection: send raw requests, read whole answers."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None = None,
        chunks: list[bytes] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        lines = [f"{method} {path} HTTP/1.1", "Host: x"] + [f"{k}: {v}" for k, v in headers.items()]
        if chunks is not None:
            lines.append("Transfer-Encoding: chunked")
            payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        else:
            payload = body or b""
            if "Content-Length" not in headers and body is not None:
                lines.append(f"Content-Length: {len(payload)}")
        self.sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
        return self._answer()

    def _answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split(" ")[1]), headers, body

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
CASES: dict[str, tuple[Any, ...]] = {  # name: (method, rollout, mode, path, headers, body, chunks)
    "ok": ("POST", "r1", "train", "chat/completions", AUTH, CHAT, None),
    "ok chunked": ("POST", "r1", "val", "chat/completions", AUTH, None, [CHAT[:10], CHAT[10:]]),
    "chunked over the limit": ("POST", "r1", "train", "chat/completions", AUTH, None, [b" " * 3000] * 2),
    "cross-site type": ("POST", "r1", "train", "chat/completions", {"Content-Type": "text/plain"}, CHAT, None),
    "no key": ("POST", "r1", "train", "chat/completions", {"Content-Type": "application/json"}, CHAT, None),
    "wrong key": ("POST", "r1", "train", "chat/completions", {**AUTH, "Authorization": "Bearer nope"}, CHAT, None),
    "other rollout's token": (
        "POST",
        "r1",
        "train",
        "chat/completions",
        {**AUTH, "Authorization": "token-of:boom"},
        CHAT,
        None,
    ),
    "own token": ("POST", "r1", "train", "chat/completions", {**AUTH, "Authorization": "token-of:r1"}, CHAT, None),
    "length over the limit": (
        "POST",
        "r1",
        "train",
        "chat/completions",
        {**AUTH, "Content-Length": str(LIMIT + 1)},
        None,
        None,
    ),
    "bad mode": ("POST", "r1", "eval", "chat/completions", AUTH, CHAT, None),
    "bad upstream path": ("POST", "r1", "train", "embeddings", AUTH, CHAT, None),
    "unknown rollout": ("POST", "nope", "train", "chat/completions", AUTH, CHAT, None),
    "terminal rollout": ("POST", "r2", "train", "chat/completions", AUTH, CHAT, None),
    "invalid JSON": ("POST", "r1", "train", "chat/completions", AUTH, b"{not json", None),
    "JSON list": ("POST", "r1", "train", "chat/completions", AUTH, b"[1]", None),
    "streaming": ("POST", "r1", "train", "chat/completions", AUTH, b'{"stream": true}', None),
    "handled store error": ("POST", "conflict", "train", "chat/completions", AUTH, CHAT, None),
    "unexpected error": ("POST", "boom", "train", "chat/completions", AUTH, CHAT, None),
    "GET": ("GET", "r1", "train", "chat/completions", AUTH, None, None),
}
NOT_FAST = {"GET"}  # other methods take FastAPI's stack in both runs
COMPARED_HEADERS = ("content-type", "content-length", "www-authenticate", "retry-after", "connection", "allow")


def _with_token(server, headers: dict[str, str]) -> dict[str, str]:
    """`Authorization: token-of:<id>` -> the rollout token of that rollout's life in the server's store."""
    auth = headers.get("Authorization", "")
    if not auth.startswith("token-of:"):
        return headers
    rid = auth.removeprefix("token-of:")
    return {
        **headers,
        "Authorization": f"Bearer {rollout_token(KEY, rid, server.store.get_rollout(rid).status.created_at)}",
    }


def _send(server, case: tuple[Any, ...]) -> tuple[int, dict[str, str], bytes, bytes]:
    method, rid, mode, path, headers, body, chunks = case
    headers = _with_token(server, headers)
    conn = Connection(server.url)
    try:
        status, got_headers, answer = conn.request(
            method, PROXY.format(rid=rid, mode=mode, path=path), headers, body, chunks
        )
        # the connection stays usable after every answer, errors included (keep-alive); not
        # after a refused announced body, which the client never sent
        after = (
            conn.request("GET", "/healthz", {})[2]
            if body is not None or chunks is not None or method == "GET"
            else b'{"status":"ok"}'
        )
    finally:
        conn.close()
    return status, {k: v for k, v in got_headers.items() if k in COMPARED_HEADERS}, answer, after


@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_answers_as_the_fastapi_stack(server, fake_upstream, name):
    counting = server.app.proxy_fast_path = Counting(server.app.proxy_fast_path)
    fast = _send(server, CASES[name])
    assert counting.answered == (0 if name in NOT_FAST else 1)
    server.app.proxy_fast_path = None
    stack = _send(server, CASES[name])
    if name.startswith("ok") or name == "own token":  # upstream answers carry per-call ids: compare the shape
        assert fast[0] == stack[0] == 200, (fast, stack)
        assert fast[1]["content-type"] == stack[1]["content-type"] == "application/json"
    else:
        assert fast[:3] == stack[:3]
    assert fast[3] == stack[3] == b'{"status":"ok"}'


def test_fast_path_status_codes(server):
    """What the differential test compares, pinned: the codes and texts an agent sees."""
    expected = {
        "ok": 200,
        "ok chunked": 200,
        "chunked over the limit": 413,
        "cross-site type": 415,
        "no key": 401,
        "wrong key": 401,
        "other rollout's token": 401,
        "own token": 200,
        "length over the limit": 413,
        "bad mode": 404,
        "bad upstream path": 404,
        "unknown rollout": 404,
        "terminal rollout": 409,
        "invalid JSON": 400,
        "JSON list": 400,
        "streaming": 400,
        "handled store error": 409,
        "unexpected error": 500,
        "GET": 405,
    }
    got = {name: _send(server, case) for name, case in CASES.items()}
    assert {name: answer[0] for name, answer in got.items()} == expected
    assert b"Internal server error: RuntimeError: rewriter bug" in got["unexpected error"][2]
    assert b"Unsupported proxy mode: eval" in got["bad mode"][2]
    assert b"cannot transition succeeded -> running" in got["handled store error"][2]
    assert got["no key"][1]["www-authenticate"] == "Bearer"
    events = server.store.events("boom")
    assert events == []  # the rewriter failed before anything was forwarded or recorded


# ---------------------------------------------------------------------------------------------
# One write per response
# ---------------------------------------------------------------------------------------------


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _exchange(request: bytes, app: Any) -> RecordingTransport:
    import uvicorn
    from uvicorn.server import ServerState

    from agl_lab.server.asgi import HTTP_PROTOCOL

    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
    config.load()
    protocol = HTTP_PROTOCOL(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    for _ in range(50):  # let the ASGI task run
        await asyncio.sleep(0)
    return transport


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    body = b'{"answer": 42}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize(
    "method, connection, body_expected",
    [("POST", "keep-alive", True), ("POST", "close", True), ("HEAD", "keep-alive", False)],
)
def test_head_and_body_go_out_in_one_write(method, connection, body_expected):
    request = f"{method} /x HTTP/1.1\r\nHost: x\r\nConnection: {connection}\r\nContent-Length: 0\r\n\r\n".encode()
    transport = asyncio.run(_exchange(request, _app))
    assert len(transport.writes) == 1, transport.writes
    head, _, body = transport.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 14" in head
    assert body == (b'{"answer": 42}' if body_expected else b"")
    assert transport.closed == (connection == "close")


def test_one_write_protocol_streams_later_chunks_as_uvicorn_does():
    async def streaming(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"a", b"b"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    request = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    writes = asyncio.run(_exchange(request, streaming)).writes
    assert writes[0].startswith(b"HTTP/1.1 200 OK") and writes[0].endswith(b"\r\n\r\n1\r\na\r\n")
    assert writes[1:] == [b"1\r\nb\r\n", b"0\r\n\r\n"]


# ---------------------------------------------------------------------------------------------
# GET /healthz answered by the protocol, without an ASGI task
# ---------------------------------------------------------------------------------------------


async def _no_healthz_route(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def test_healthz_is_answered_by_the_protocol_as_the_app_answers_it():
    """An app without the route still answers it (the protocol does), with the app's own answer."""
    from starlette.testclient import TestClient

    from agl_lab.server.app import create_app

    transport = asyncio.run(_exchange(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", _no_healthz_route))
    (write,) = transport.writes
    head, _, body = write.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"content-type: application/json" in head
    with TestClient(create_app({"key": "k"})) as client:  # the route the protocol stands in for
        assert body == client.get("/healthz").content
    assert not transport.closed  # keep-alive
    # anything else about the path goes to the app: a query string, HEAD, another path
    for request in (
        b"GET /healthz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz/ HTTP/1.1\r\nHost: x\r\n\r\n",
    ):
        assert asyncio.run(_exchange(request, _no_healthz_route)).writes[0].startswith(b"HTTP/1.1 404"), request


def test_healthz_pipelined_and_connection_close_over_a_real_socket(server):
    with socket.create_connection((server.config.host, server.config.port)) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2 + b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + server.config.key.encode() + b"\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        data = b""
        while chunk := sock.recv(65536):  # the server closes after the last answer
            data += chunk
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200"] * 4, data[:500]
    assert answers[2].count(b'"openapi"') == 1  # the app's route, in order between the probes
    assert answers[0].endswith(b'{"status":"ok"}') and b"connection: close" in answers[3]


def test_one_write_protocol_only_where_uvicorn_has_its_hooks():
    # the protocol subclasses uvicorn internals: an installed uvicorn without them gets uvicorn's
    # own httptools protocol (see asgi._fits), never a half-working subclass
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    from agl_lab.server import asgi

    assert asgi._fits(HttpToolsProtocol, RequestResponseCycle)
    assert asgi.HTTP_PROTOCOL is asgi.OneWriteHttpToolsProtocol

    class OlderProtocol(HttpToolsProtocol):
        _start_asgi_task = None  # e.g. a uvicorn from before the hook existed

    class OtherCycle(RequestResponseCycle):
        def __init__(self, scope: Any, transport: Any) -> None:  # fields renamed or gone
            pass

    class SyncSend(RequestResponseCycle):
        def send(self, message: Any) -> None:  # type: ignore[override]
            pass

    assert not asgi._fits(OlderProtocol, RequestResponseCycle)
    assert not asgi._fits(HttpToolsProtocol, OtherCycle)
    assert not asgi._fits(HttpToolsProtocol, SyncSend)
