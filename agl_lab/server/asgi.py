"""The ASGI plumbing around the routes: the proxy's fast path, JSON 500s, one write per response.

    AglApp                 the FastAPI app `create_app` returns; answers the proxy's POSTs itself
    JsonServerErrors       ASGI middleware: unexpected errors -> JSON 500, keep-alive preserved
    HTTP_PROTOCOL          uvicorn's `http=` choice: httptools, a response's head and body in one write,
                           `GET /healthz` answered without an ASGI task, bounded request heads and reads
                           (uvicorn's own httptools protocol instead, with a warning, if the installed
                           uvicorn's internals moved)
    http_protocol(limits)  HTTP_PROTOCOL with a server's ReadLimits (header size, header/body timeouts)
    HandshakeBoundServer   uvicorn's Server with each TLS handshake bounded (by header_timeout_seconds)

Every LLM call of every agent is a POST to the proxy route, so its path through the server is
the hot path. Through FastAPI's stack it passes ~10 layers (ServerErrorMiddleware, FastAPI's
telemetry and body-limit middleware, RequestGuard, JsonServerErrors, ExceptionMiddleware,
AsyncExitStackMiddleware, the router's scan, the route's wrappers, Response.__call__), each a
coroutine and a wrapped `send`. `AglApp.__call__` dispatches a POST whose path matches the
proxy route (with no root_path) to `ProxyFastPath`, which applies the same steps in the same
order: RequestGuard's checks (415, 401, 400/413 on Content-Length, a chunked body read up to
the limit), `Gateway.handle`, exceptions mapped by the app's exception handlers (HTTPException
-> `{"detail": ...}`), anything else a logged JSON 500 with the connection kept. Every other
request (other methods and paths, the management routes, the docs) takes FastAPI's stack.

uvicorn writes a response's status line and headers, then its body, as two `transport.write`
calls: two send syscalls and two wake-ups of the agent per call. `HTTP_PROTOCOL` holds the
head until the first body chunk and writes both at once, and answers `GET /healthz` in the
I/O callback instead of queuing an ASGI task behind the turn's calls (at 256 agents calling
back to back that queue is tens of ms); everything else is uvicorn's.

uvicorn itself bounds neither a request head's size nor how long it may take to arrive (its
keep-alive timer runs only between requests), so a client could hold a connection open forever
idle, mid-head or mid-body, or send a 40 MiB header that is buffered whole. `HTTP_PROTOCOL`
applies `ReadLimits`: a head larger than `max_header_bytes` answers 431 and closes; a head not
complete within `header_timeout_seconds` of the connection (or of its first byte, on a reused
connection) answers 408 and closes; a body with no data for `body_timeout_seconds` while the app
waits for it answers 408 and closes. A request the app is still answering is never cut. With TLS
the handshake comes first and has the same `header_timeout_seconds` (`HandshakeBoundServer`):
one not done by then is closed without an answer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl_lab.server.gateway import Gateway
from agl_lab.server.guard import RequestGuard

logger = logging.getLogger("agl_lab.server")

HEALTH_PATH = "/healthz"  # the liveness route: open, answered by HTTP_PROTOCOL itself when it serves
HEALTH_BODY = b'{"status":"ok"}'

ASGIReceive = Callable[[], Awaitable[Any]]
ASGISend = Callable[[Any], Awaitable[None]]


def internal_error(scope: Any, exc: BaseException) -> JSONResponse:
    """Log `exc` and build the JSON 500 `{"detail": "Internal server error: <type>: <message>"}`."""
    logger.error("Unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
    detail = f"Internal server error: {type(exc).__name__}: {exc}"[:2000]
    return JSONResponse({"detail": detail.encode("utf-8", "backslashreplace").decode()}, status_code=500)


class JsonServerErrors:
    """ASGI middleware: an unexpected exception becomes a JSON 500 and the connection stays usable.

    Starlette's own 500 handler re-raises after answering, which makes uvicorn close the
    keep-alive connection: the client's next request on it then fails. This one logs the
    error and answers `{"detail": "Internal server error: <type>: <message>"}` instead.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:
                logger.exception("Unhandled error on %s %s", scope.get("method"), scope.get("path"))
                raise
            await internal_error(scope, exc)(scope, receive, send)


class ProxyFastPath:
    """The proxy route's POSTs without FastAPI's stack (see the module docstring).

    `guard` is configured as the app's RequestGuard, `route` is the proxy Route (its path
    regex decides what is proxied), `exception_handlers` the app's (FastAPI's defaults + ours).
    """

    def __init__(
        self, gateway: Gateway, guard: RequestGuard, route: Route, exception_handlers: Mapping[Any, Callable[..., Any]]
    ):
        self.gateway, self.guard = gateway, guard
        self._regex, self._convertors = route.path_regex, route.param_convertors
        self._handlers = exception_handlers

    def match(self, path: str) -> dict[str, Any] | None:
        """The route's path parameters, or None when `path` is not the proxy route's."""
        found = self._regex.match(path)
        if found is None:
            return None
        return {name: self._convertors[name].convert(value) for name, value in found.groupdict().items()}

    async def __call__(self, scope: Any, receive: ASGIReceive, send: ASGISend, params: dict[str, Any]) -> None:
        admitted = await self.guard.admit(scope, receive, send)  # RequestGuard's checks, in its order
        if admitted is None:
            return
        try:
            response = await self.gateway.handle(
                lambda: _read_body(admitted),
                admitted,
                params["rollout_id"],
                params["attempt_id"],
                params["mode"],
                params["upstream_path"],
            )
        except Exception as exc:
            response = await self._handled(scope, admitted, exc)
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})

    async def _handled(self, scope: Any, receive: ASGIReceive, exc: Exception) -> Response:
        """The answer FastAPI's ExceptionMiddleware (or else JsonServerErrors) gives for `exc`."""
        handler = None  # FastAPI gives the handlers of 500 and Exception to ServerErrorMiddleware instead
        if isinstance(exc, HTTPException) and exc.status_code != 500:
            handler = self._handlers.get(exc.status_code)
        if handler is None:
            handler = next(
                (self._handlers[cls] for cls in type(exc).__mro__ if cls in self._handlers and cls is not Exception),
                None,
            )
        if handler is None:
            return internal_error(scope, exc)
        try:
            response = handler(Request(scope, receive), exc)
            return await response if inspect.isawaitable(response) else response
        except Exception as error:
            return internal_error(scope, error)


async def _read_body(receive: ASGIReceive) -> bytes:
    """The request body (ClientDisconnect if the agent hangs up first, like Request.body)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class AglApp(FastAPI):
    """FastAPI, with the proxy's POSTs handed to `proxy_fast_path` when it is set."""

    proxy_fast_path: ProxyFastPath | None = None

    async def __call__(self, scope: Any, receive: ASGIReceive, send: ASGISend) -> None:
        fast = self.proxy_fast_path
        if (
            fast is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and not self.root_path
        ):
            params = fast.match(scope["path"])
            if params is not None:
                scope["app"] = self
                await fast(scope, receive, send, params)
                return
        await super().__call__(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# One write per response: uvicorn's httptools protocol, the head held until the body
# ---------------------------------------------------------------------------------------------


class _Held:
    """Stands in for the transport while uvicorn writes a response's head: keeps the bytes."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class _Prefixed:
    """The transport, writing `head` in front of the first write (and before closing)."""

    def __init__(self, transport: Any, head: bytes):
        self.transport, self.head = transport, head

    def write(self, data: bytes) -> None:
        head, self.head = self.head, b""
        self.transport.write(head + data if head else data)

    def flush(self) -> None:
        if self.head:
            self.write(b"")

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


@dataclass(frozen=True)
class ReadLimits:
    """How much of a request head the protocol reads, and how long it waits (ServerConfig keys)."""

    max_header_bytes: int = 64 * 2**10  # request line + headers; larger: 431
    header_timeout_seconds: float = 30.0  # a head must be complete this long after it started: else 408
    body_timeout_seconds: float = 60.0  # longest pause in a body the app is reading: else 408


def _close_with(transport: Any, status: int, reason: bytes, detail: str) -> None:
    """Write a JSON error answer with `connection: close` and close the connection."""
    body = json.dumps({"detail": detail}).encode()
    transport.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )
    transport.close()


def _bytes_waiting(transport: Any) -> bool:
    """Whether the connection's socket holds bytes the event loop has not read yet (a peek: nothing
    is consumed). A stalled loop runs its due timers before it polls the sockets (uvloop), so a
    timer can fire while the bytes that would have satisfied it wait in the kernel's buffer."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:  # a duplicate of the descriptor: uvloop's socket object does not offer recv
        with socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
            return bool(dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (BlockingIOError), or the connection is gone
        return False


# what the classes below rely on in uvicorn's httptools protocol (checked at import: see _fits)
_CYCLE_FIELDS = ("scope", "transport", "flow", "message_event", "keep_alive", "on_response")
_PROTOCOL_HOOKS = (
    "on_headers_complete",
    "on_response_complete",
    "_start_asgi_task",
    "on_body",
    "on_message_complete",
    "data_received",
    "connection_made",
    "connection_lost",
)


def _fits(protocol: Any, cycle: Any) -> bool:
    """Whether this uvicorn's httptools protocol and cycle have the hooks and fields used below
    (they are uvicorn's internals, not its API: a release may change them)."""
    fields = inspect.signature(cycle.__init__).parameters
    return (
        all(callable(getattr(protocol, hook, None)) for hook in _PROTOCOL_HOOKS)
        and all(name in fields for name in _CYCLE_FIELDS)
        and inspect.iscoroutinefunction(getattr(cycle, "send", None))
    )


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
except ImportError:  # pragma: no cover - httptools is a dependency; without it uvicorn's h11
    HTTP_PROTOCOL: Any = "auto"
else:

    class _OneWriteCycle(RequestResponseCycle):
        """uvicorn's request/response cycle with the head written together with the body."""

        _head = b""

        async def send(self, message: Any) -> None:
            if message["type"] == "http.response.start" and not self.response_started:
                transport, self.transport = self.transport, _Held()  # type: ignore[assignment]
                try:
                    await super().send(message)
                    self._head = self.transport.data  # type: ignore[attr-defined]
                finally:
                    self.transport = transport
                return
            if not self._head:
                await super().send(message)
                return
            transport = self.transport
            prefixed = _Prefixed(transport, self._head)
            self._head, self.transport = b"", prefixed  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
            if not self.disconnected:
                prefixed.flush()  # a HEAD answer writes no body

    class OneWriteHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol whose responses go out as one write (head + body), which
        answers `GET /healthz` itself (see `_answer_health`) and applies `limits` (ReadLimits;
        `http_protocol(limits)` makes the subclass of a server's settings)."""

        limits = ReadLimits()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_open, self._head_bytes, self._tail = True, 0, b""  # reading a request head?
            self._head_late = False  # its deadline passed with bytes unread: what they complete decides
            self._read_timer: Any = None
            self._arm(self.limits.header_timeout_seconds, self._head_timed_out)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._head_open:
                if self._read_timer is None:  # the first byte of a head on a reused connection
                    self._arm(self.limits.header_timeout_seconds, self._head_timed_out)
                if self._head_too_big(data):
                    self._disarm()
                    self._head_open = False
                    _close_with(
                        self.transport,
                        431,
                        b"Request Header Fields Too Large",
                        f"request head larger than {self.limits.max_header_bytes} bytes "
                        "(server setting max_header_bytes)",
                    )
                    return
            super().data_received(data)
            if self._head_open and self._head_late and not self.transport.is_closing():
                self._head_late = False
                self._answer_head_timeout()  # the bytes waiting at the deadline did not complete the head

        def _head_too_big(self, data: bytes) -> bool:
            """Count the head's bytes before the parser buffers them (it would hold a 40 MiB header)."""
            window = self._tail + data
            end = window.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
            self._tail = window[-3:]
            return self._head_bytes > self.limits.max_header_bytes

        def on_headers_complete(self) -> None:
            self._head_open = False
            self._disarm()
            super().on_headers_complete()
            if type(self.cycle) is RequestResponseCycle:  # its task has not run yet
                self.cycle.__class__ = _OneWriteCycle
            self._arm(self.limits.body_timeout_seconds, self._body_timed_out)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._arm(self.limits.body_timeout_seconds, self._body_timed_out)  # a pause, not the whole body

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()
            self._head_open, self._head_bytes, self._tail = True, 0, b""  # what follows is the next head
            self._head_late = False

        def _arm(self, seconds: float, handler: Callable[[], None]) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(seconds, handler)

        def _disarm(self) -> None:
            timer, self._read_timer = getattr(self, "_read_timer", None), None
            if timer is not None:
                timer.cancel()

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _head_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing() or not self._head_open:
                return
            if self._answering():  # a pipelined head behind a request in progress: wait for it
                self._arm(self.limits.header_timeout_seconds, self._head_timed_out)
                return
            if not self._head_late and _bytes_waiting(self.transport):
                # bytes that arrived in time but were not read (a stalled loop): read them first;
                # data_received answers 408 if they leave the head incomplete, else this timer does
                self._head_late = True
                self._arm(min(1.0, self.limits.header_timeout_seconds), self._head_timed_out)
                return
            self._answer_head_timeout()

        def _answer_head_timeout(self) -> None:
            self._disarm()
            _close_with(
                self.transport,
                408,
                b"Request Timeout",
                f"request head not complete within {self.limits.header_timeout_seconds:g} s "
                "(server setting header_timeout_seconds)",
            )

        def _body_timed_out(self) -> None:
            self._read_timer = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None or not cycle.more_body:
                return
            if self.flow.read_paused or _bytes_waiting(self.transport):
                # the app has not taken what was sent yet, or the loop (stalled) has not read it: not
                # the client's pause
                self._arm(self.limits.body_timeout_seconds, self._body_timed_out)
                return
            if cycle.response_started:
                self.transport.close()
                return
            cycle.response_started = cycle.response_complete = True  # the app's answer, if any, is dropped
            _close_with(
                self.transport,
                408,
                b"Request Timeout",
                f"no request body data for {self.limits.body_timeout_seconds:g} s "
                "(server setting body_timeout_seconds)",
            )

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
            scope = cycle.scope
            if (
                scope["method"] == "GET"
                and scope["path"] == HEALTH_PATH
                and not scope["query_string"]
                and not self.root_path
            ):
                self._answer_health(cycle)
                return
            super()._start_asgi_task(cycle, app)

        def _answer_health(self, cycle: RequestResponseCycle) -> None:
            """`GET /healthz` → 200 `{"status":"ok"}` (the app's own answer), written from the I/O
            callback: no ASGI task, so a liveness probe waits for the event loop's next turn, not
            behind every call that turn queued. It proves what the route proves (the loop runs)."""
            head = [b"HTTP/1.1 200 OK\r\n"]
            head += [b"%s: %s\r\n" % (name, value) for name, value in self.server_state.default_headers]
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(HEALTH_BODY))
            if not cycle.keep_alive:
                head.append(b"connection: close\r\n")
            self.transport.write(b"".join(head) + b"\r\n" + HEALTH_BODY)
            cycle.response_started = cycle.response_complete = True
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()  # keep-alive timer, pipelined requests: as after any answer

    if _fits(HttpToolsProtocol, RequestResponseCycle):
        HTTP_PROTOCOL = OneWriteHttpToolsProtocol
    else:  # pragma: no cover - depends on the installed uvicorn
        logger.warning(
            "This uvicorn's httptools protocol lacks what agl_lab's one-write protocol hooks into "
            "(%s; cycle fields %s): serving with uvicorn's own httptools protocol, which is correct, "
            "somewhat slower per call, and does not apply max_header_bytes, header_timeout_seconds "
            "and body_timeout_seconds",
            ", ".join(_PROTOCOL_HOOKS),
            ", ".join(_CYCLE_FIELDS),
        )
        HTTP_PROTOCOL = "httptools"


# ---------------------------------------------------------------------------------------------
# TLS: the handshake bounded by header_timeout_seconds
# ---------------------------------------------------------------------------------------------


class HandshakeBoundServer(uvicorn.Server):
    """uvicorn's Server whose TLS handshakes must finish within `handshake_timeout` seconds.

    With TLS the protocol above (and its header timer) only meets a connection once its handshake
    is done, and asyncio and uvloop give a handshake 60 s unless `create_server` is told otherwise —
    which uvicorn does not do: a client that connects and sends nothing held a connection a minute.
    uvicorn calls `loop.create_server` inside `startup`, so for that call the running loop's method
    is given `ssl_handshake_timeout` (an attribute of the loop object, removed after). A handshake
    not done in time is aborted: the connection closes without an answer (there is none to send
    before TLS). Plain HTTP is served as uvicorn serves it.
    """

    def __init__(self, config: uvicorn.Config, handshake_timeout: float):
        super().__init__(config)
        self.handshake_timeout = handshake_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.config.ssl is None:
            await super().startup(sockets=sockets)
            return
        loop = asyncio.get_running_loop()
        # Critical: bound to this loop object only; every server it creates during startup gets it
        loop.create_server = functools.partial(  # type: ignore[method-assign]
            type(loop).create_server, loop, ssl_handshake_timeout=self.handshake_timeout
        )
        try:
            await super().startup(sockets=sockets)
        finally:
            del loop.create_server


def http_protocol(limits: ReadLimits) -> Any:
    """uvicorn's `http=` for a server with `limits`: a subclass of HTTP_PROTOCOL (HTTP_PROTOCOL
    itself when it is uvicorn's, which cannot apply them)."""
    if isinstance(HTTP_PROTOCOL, str):  # pragma: no cover - depends on the installed uvicorn
        return HTTP_PROTOCOL
    return type("AglHttpProtocol", (HTTP_PROTOCOL,), {"limits": limits})


def read_limits(config: Any) -> ReadLimits:
    """The ReadLimits of a ServerConfig."""
    return ReadLimits(
        max_header_bytes=config.max_header_bytes,
        header_timeout_seconds=config.header_timeout_seconds,
        body_timeout_seconds=config.body_timeout_seconds,
    )
