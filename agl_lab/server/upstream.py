"""Upstream clients: how the gateway POSTs a call's JSON to the model server.

    open_upstream_client(kind, timeout_seconds, max_answer_bytes, key="") -> client   kind: "auto" | "raw" | "aiohttp" | "httpx"
    await client.post_json(url, payload, request_id=None) -> UpstreamResponse   (status, content type, body, Retry-After)
    await client.aclose()

One client (one connection pool) per app, opened in the lifespan. Failures are mapped to three
exceptions the gateway's retry loop understands: UpstreamTimeout, UpstreamRefused (no
connection could be opened: the server is down) and UpstreamTransportError (anything else on
the wire), and UpstreamTooLarge: an answer body beyond `max_answer_bytes` (the server setting
`max_upstream_answer_bytes`) is not read further, its connection is closed, and it is not
retried (the same request would get the same answer). `key` (the server setting `upstream_key`)
is sent as `Authorization: Bearer <key>` on every call: the engine's OpenAI server requires it
when bound beyond loopback (`agl_lab.addresses.ENGINE_KEY_ENV`). `request_id` goes out as
`X-Agl-Request-Id`: agl_lab's engine files the generation under it, so the gateway can ask
whether it is still queued or running, and abort it, before it ever sends the call again
(`REQUEST_STATE_PATH`, `ABORT_REQUEST_PATH`, relative to the endpoint's `/v1`). "auto" is the raw client (asyncio + httptools, both dependencies of uvicorn's fast
path): measured on this project's 2-core machine it costs the gateway the least CPU per call
(benchmarks/gateway.py); aiohttp and httpx stay as choices.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
import httpx

_JSON_HEADERS = {"content-type": "application/json"}
REQUEST_ID_HEADER = "x-agl-request-id"
REQUEST_STATE_PATH = "agl/request_state"  # POST {"request_id"} -> {"state": queued|running|unknown, ...}
ABORT_REQUEST_PATH = "agl/abort_request"  # POST {"request_id"} -> {"aborted": bool, "state": ...}


def _headers(key: str) -> dict[str, str]:
    return {**_JSON_HEADERS, "authorization": f"Bearer {key}"} if key else dict(_JSON_HEADERS)


class UpstreamTimeout(Exception):
    """The model server did not answer within `upstream_timeout_seconds`."""


class UpstreamTransportError(Exception):
    """Connecting to or talking with the model server failed (refused, reset, bad URL, ...)."""


class UpstreamRefused(UpstreamTransportError):
    """No connection could be opened to the model server (refused, unreachable): it is down."""


class UpstreamTooLarge(Exception):
    """The model server's answer body is larger than `max_upstream_answer_bytes`."""

    def __init__(self, limit: int):
        super().__init__(
            f"the model server's answer is larger than {limit} bytes (server setting "
            "max_upstream_answer_bytes): ask for fewer tokens or logprobs, or raise the limit"
        )
        self.limit = limit


DEFAULT_MAX_ANSWER_BYTES = 32 * 2**20


@dataclass
class UpstreamResponse:
    status_code: int
    content_type: str
    content: bytes
    retry_after: str | None = None  # the upstream's Retry-After header, if any


class HttpxUpstream:
    """POSTs JSON through one shared httpx.AsyncClient (the portable choice)."""

    def __init__(self, timeout_seconds: float, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, key: str = ""):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        # the wait for the answer is bounded by the gateway's attempt (`Gateway._attempt`), which may
        # extend it while the engine works on the call: no read timeout of the client's own
        timeout = httpx.Timeout(timeout_seconds, read=None)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.max_answer_bytes, self._headers = max_answer_bytes, _headers(key)

    async def post_json(self, url: str, payload: bytes, request_id: str | None = None) -> UpstreamResponse:
        headers = {**self._headers, REQUEST_ID_HEADER: request_id} if request_id else self._headers
        try:
            async with self.client.stream("POST", url, content=payload, headers=headers) as r:
                chunks, size = [], 0
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_answer_bytes:
                        raise UpstreamTooLarge(self.max_answer_bytes)
                    chunks.append(chunk)
                content = b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{type(exc).__name__}: {exc}") from exc
        except httpx.ConnectError as exc:
            raise UpstreamRefused(f"{type(exc).__name__}: {exc}") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise UpstreamTransportError(f"{type(exc).__name__}: {exc}") from exc
        return UpstreamResponse(r.status_code, r.headers.get("content-type", ""), content, r.headers.get("retry-after"))

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpUpstream:
    """POSTs JSON through one shared aiohttp.ClientSession.

    Measured on this project's 2-core machine (benchmarks/gateway.py): the gateway spends
    ~1.0 ms of CPU per call with it against ~2.1 ms with httpx, and its added p50 latency
    drops from ~5-12 ms to ~1 ms on a loaded machine (httpx sends headers and body in two
    writes and runs more event-loop turns per request).
    """

    def __init__(self, timeout_seconds: float, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, key: str = ""):
        import aiohttp

        self.max_answer_bytes, self._headers = max_answer_bytes, _headers(key)
        self._aiohttp = aiohttp
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        # a bound on connecting; the wait for the answer is the gateway's attempt's (`Gateway._attempt`)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_seconds, sock_read=None)
        self.session = aiohttp.ClientSession(connector=connector, trust_env=False, timeout=timeout)

    async def post_json(self, url: str, payload: bytes, request_id: str | None = None) -> UpstreamResponse:
        headers = {**self._headers, REQUEST_ID_HEADER: request_id} if request_id else self._headers
        try:
            async with self.session.post(url, data=payload, headers=headers) as r:
                content = await r.content.read(self.max_answer_bytes + 1)
                while len(content) <= self.max_answer_bytes and not r.content.at_eof():
                    content += await r.content.read(self.max_answer_bytes + 1 - len(content))
                if len(content) > self.max_answer_bytes:
                    r.close()  # the rest is not read: the connection is not reused
                    raise UpstreamTooLarge(self.max_answer_bytes)
                return UpstreamResponse(
                    r.status, r.headers.get("content-type", ""), content, r.headers.get("retry-after")
                )
        except TimeoutError as exc:  # aiohttp's timeouts subclass it
            raise UpstreamTimeout(f"{type(exc).__name__}: {exc}") from exc
        except self._aiohttp.ClientConnectorError as exc:
            raise UpstreamRefused(f"{type(exc).__name__}: {exc}") from exc
        except (self._aiohttp.ClientError, ValueError, OSError) as exc:  # ValueError: malformed URL
            raise UpstreamTransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self.session.close()


class _Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the model server, one request at a time.

    httptools parses the answer (Content-Length, chunked, or until the server closes);
    `answer` is the future of the request in flight.
    """

    def __init__(self, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.max_answer_bytes = max_answer_bytes
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[UpstreamResponse] | None = None
        self.closed = False  # the server closed it or it broke: never reuse
        self.received = False  # a byte of the current answer arrived
        self._reset_answer()

    def _reset_answer(self) -> None:
        self.received, self._status, self._chunks, self._size = False, 0, [], 0
        self._content_type = self._retry_after = ""
        self._headers_done = self._framed = self._complete = False

    def send(self, request: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None and self.answer is None
        self._reset_answer()
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.answer

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: the connection is out of step
            self._break(None)
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._break(UpstreamTransportError(f"the model server sent an invalid HTTP answer ({exc})"))

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self._headers_done and not self._framed and not self._complete:
            self.on_message_complete()  # no Content-Length, not chunked: the body ends with the connection
            return
        cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._fail(
            UpstreamTransportError(
                f"the model server closed the connection before answering{cause}"
                if not self.received
                else f"the model server closed the connection mid-answer{cause}"
            )
        )

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self._content_type = value.decode("latin-1")
        elif name == b"retry-after":
            self._retry_after = value.decode("latin-1")
        elif name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._status, self._headers_done = self.parser.get_status_code(), True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self.max_answer_bytes:
            self._break(UpstreamTooLarge(self.max_answer_bytes))
            return
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        answer, self.answer = self.answer, None
        if not self.closed and not self.parser.should_keep_alive():
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]
        content = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        if answer is not None and not answer.done():
            answer.set_result(UpstreamResponse(self._status, self._content_type, content, self._retry_after or None))

    def _fail(self, error: Exception) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and not answer.done():
            answer.set_exception(error)

    def _break(self, error: Exception | None) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if error is not None:
            self._fail(error)


class RawUpstream:
    """POSTs JSON over its own pool of keep-alive HTTP/1.1 connections (asyncio + httptools).

    The leanest choice (used by "auto"): one write per request, no per-request header
    machinery. Per endpoint (scheme, host, port), idle connections wait in a LIFO pool; a
    connection is reused only if the server has not closed it. A request that meets a pooled
    connection the server closed meanwhile, before any byte of an answer, is sent once more on
    a new connection. The gateway's attempt timeout bounds each call: a call cancelled or
    failed mid-answer closes its connection.
    """

    def __init__(
        self, max_idle_per_endpoint: int = 512, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, key: str = ""
    ):
        self.max_idle, self.max_answer_bytes = max_idle_per_endpoint, max_answer_bytes
        self._auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self._idle: dict[tuple[str, str, int], list[_Exchange]] = {}
        self._busy: set[_Exchange] = set()
        self._targets: dict[str, tuple[tuple[str, str, int], bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post_json(self, url: str, payload: bytes, request_id: str | None = None) -> UpstreamResponse:
        endpoint, head = self._target(url)
        tagged = b"X-Agl-Request-Id: %s\r\n" % request_id.encode("latin-1") if request_id else b""
        request = (
            head + tagged + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )
        while True:
            exchange, reused = await self._connection(endpoint)
            self._busy.add(exchange)
            try:
                response = await exchange.send(request)
            except UpstreamTransportError:
                exchange._break(None)
                if reused and not exchange.received:
                    continue  # a stale pooled connection: the server never saw this request
                raise
            except BaseException:  # cancelled (timeout, agent gone): the answer is not read
                exchange._break(None)
                raise
            finally:
                self._busy.discard(exchange)
            if not exchange.closed:
                idle = self._idle.setdefault(endpoint, [])
                if len(idle) < self.max_idle:
                    idle.append(exchange)
                else:
                    exchange._break(None)
            return response

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes]:
        """((scheme, host, port), the request head up to its Content-Type line) of `url`."""
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamTransportError(
                f"ValueError: unusable model server URL {url!r} (want http(s)://host[:port]/path)"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise UpstreamTransportError(f"ValueError: {exc} in model server URL {url!r}") from None
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{self._auth}".encode("latin-1")
        if len(self._targets) < 4096:
            self._targets[url] = ((parts.scheme, parts.hostname, port), head)
        return (parts.scheme, parts.hostname, port), head

    async def _connection(self, endpoint: tuple[str, str, int]) -> tuple[_Exchange, bool]:
        """A pooled connection the server has not closed (reused=True), else a new one."""
        idle = self._idle.get(endpoint)
        while idle:
            exchange = idle.pop()
            if not exchange.closed and not exchange.transport.is_closing():  # type: ignore[union-attr]
                return exchange, True
        scheme, host, port = endpoint
        tls = None
        if scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            tls = self._ssl
        try:
            _, exchange = await asyncio.get_running_loop().create_connection(
                lambda: _Exchange(self.max_answer_bytes), host, port, ssl=tls, server_hostname=host if tls else None
            )
        except OSError as exc:  # refused, unreachable, unknown host
            raise UpstreamRefused(f"{type(exc).__name__}: cannot connect to {host}:{port}: {exc}") from exc
        return exchange, False

    async def aclose(self) -> None:
        for exchange in [*self._busy, *(e for idle in self._idle.values() for e in idle)]:
            exchange._break(None)
        self._idle.clear()
        self._busy.clear()


UpstreamClient = RawUpstream | HttpxUpstream | AiohttpUpstream


def open_upstream_client(
    kind: str, timeout_seconds: float, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES, key: str = ""
) -> UpstreamClient:
    """`kind`: "raw", "aiohttp", "httpx", or "auto" (the raw client); `key`: sent as a Bearer token."""
    if kind in ("auto", "raw"):  # bounded by the gateway's per-attempt asyncio.timeout
        return RawUpstream(max_answer_bytes=max_answer_bytes, key=key)
    if kind == "aiohttp":
        return AiohttpUpstream(timeout_seconds, max_answer_bytes, key)
    if kind == "httpx":
        return HttpxUpstream(timeout_seconds, max_answer_bytes, key)
    raise ValueError(f"upstream_client must be 'auto', 'raw', 'aiohttp' or 'httpx', got {kind!r}")
