"""The server's front door: auth before the body is read, body size limit, no cross-site bodies.

    RequestGuard(app, key=..., max_body_bytes=..., open_paths=..., token_check=..., allowed_hosts=...,
                 runner_key=...)
    await guard.admit(scope, receive, send)   the checks alone (the proxy's fast path calls them)

Per HTTP request, before any route (and so before FastAPI reads or parses the body):

1. **Cross-site bodies refused.** A body sent as `text/plain`, `application/x-www-form-urlencoded`
   or `multipart/form-data` answers 415: those are the content types a browser may POST to
   any site without a CORS preflight, so a web page could otherwise drive a keyless server on
   loopback (pause the gateway, delete models). Every client of this API sends JSON.
2. **Host names (keyless servers only).** Without a key, a request whose `Host` header names a
   host outside `allowed_hosts` (default: localhost, 127.0.0.1, ::1; "*" allows any) answers
   403: a web page whose DNS name was rebound to 127.0.0.1 sends its own name as `Host`, so it
   cannot pause the gateway, list rollouts or register a model endpoint. With a key set the key
   is the check (a page cannot present it).
3. **Auth.** Unless the path is open (`/healthz`; `/docs`, `/redoc`, `/openapi.json` when
   `docs_auth` is off), the request needs `Authorization: Bearer <key>` or `x-api-key: <key>`
   — or a per-rollout token that `token_check(token, method, path)` accepts (the token covers
   only its rollout's proxy route and event posts; it reads the store in a worker thread, and a
   store it cannot reach answers 503). 401 otherwise, with the body unread.
   **The runner key** (server setting `runner_key`, `agl-lab serve --runner-key-file`) opens
   only what a runner does (`RUNNER_SCOPE`): claim, heartbeat and release rollouts, PATCH a
   rollout, post an attempt's events, read rollouts and `/metrics` — and its agents' tokens are
   made from it.
   Any other route (creating or deleting rollouts, `/api/models`, pausing the gateway) answers
   403 naming the scope: a compromised runner host cannot delete rollouts or re-register models.
4. **Size.** A `Content-Length` above `max_body_bytes` answers 413 at once; a body without
   one (chunked) is read up to the limit and refused past it.

The keys themselves are checked when a command starts (`agl_lab/keys.py`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse

CROSS_SITE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

TokenCheck = Callable[[str, str, str], Awaitable[bool]]  # (token, method, path) -> accepted?

# what the runner key opens: (method, path pattern)
RUNNER_SCOPE = (
    ("POST", re.compile(r"/api/rollouts/(claim|heartbeat|release)")),
    ("PATCH", re.compile(r"/api/rollouts/[^/]+")),
    ("POST", re.compile(r"/api/rollouts/[^/]+/attempt/[^/]+/events")),
    ("GET", re.compile(r"/api/rollouts(/[^/]+)?")),
    ("GET", re.compile(r"/metrics")),
)
RUNNER_SCOPE_TEXT = (
    "claim, heartbeat and release rollouts, PATCH a rollout, post an attempt's events, read rollouts, mint agent tokens"
)


def runner_may(method: str, path: str) -> bool:
    """Whether the runner key opens `method path` (`RUNNER_SCOPE`)."""
    return any(method == m and pattern.fullmatch(path) for m, pattern in RUNNER_SCOPE)


def presented_key(headers: dict[bytes, bytes] | list[tuple[bytes, bytes]]) -> str | None:
    """The key a request presents (`Authorization: Bearer` or `x-api-key`), or None."""
    auth = api_key = None
    for name, value in headers:
        if name == b"authorization":
            auth = value
        elif name == b"x-api-key":
            api_key = value
    if auth is not None and auth.startswith(b"Bearer "):
        return auth[7:].decode("latin-1")
    return api_key.decode("latin-1") if api_key is not None else None


def host_name(headers: Any) -> str | None:
    """The host name of the `Host` header, lower case, without port or IPv6 brackets (None: no header)."""
    raw = next((value for name, value in headers if name == b"host"), None)
    if raw is None:
        return None
    text = raw.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8080
        return text[1 : text.find("]")] if "]" in text else text
    if text.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        text = text.partition(":")[0]
    return text.rstrip(".")


class RequestGuard:
    """ASGI middleware applying the module's three checks (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        *,
        key: str,
        max_body_bytes: int,
        open_paths: tuple[str, ...] = ("/healthz",),
        token_check: TokenCheck | None = None,
        allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
        runner_key: str = "",
    ):
        self.app, self.key, self.max_body_bytes = app, key, max_body_bytes
        self._runner_key = runner_key.encode() if runner_key else None
        self.open_paths, self.token_check = frozenset(open_paths), token_check
        hosts = frozenset(h.strip().lower().strip("[]").rstrip(".") for h in allowed_hosts)
        self.allowed_hosts = None if key or "*" in hosts else hosts  # None: any Host name
        self._expected = key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admitted = await self.admit(scope, receive, send)
        if admitted is not None:
            await self.app(scope, admitted, send)

    async def admit(self, scope: Any, receive: Any, send: Any) -> Any:
        """Apply the checks: the `receive` the app must read the body from (a chunked body was
        read up to the limit and is replayed), or None when the request was refused (answered)."""
        try:
            token_ok = await self._token_ok(scope)
        except ConnectionError as exc:  # the store (StoreUnavailable): nothing was checked, nothing stored
            await _refuse(scope, receive, send, 503, f"cannot check the rollout token: {exc}")
            return None
        refusal, length_known = self._screen(scope, token_ok)
        if refusal is not None:
            await _refuse(scope, receive, send, *refusal)
            return None
        if length_known:
            return receive
        body = await self._read_bounded(receive)
        if body is None:
            await _refuse(scope, receive, send, 413, self._too_big_detail())
            return None
        return _replay(body, receive)

    async def _token_ok(self, scope: Any) -> bool:
        """Whether the request presents a rollout token `token_check` accepts (awaited: it reads the
        store in a worker thread). False without asking when no token check applies."""
        path = scope["path"]
        if self.token_check is None or not self.key or path in self.open_paths:
            return False
        presented = presented_key(scope["headers"])
        if presented is None or secrets.compare_digest(presented.encode(), self._expected):
            return False
        if self._runner_key is not None and secrets.compare_digest(presented.encode(), self._runner_key):
            return False  # the runner key itself: its scope is `_authorized`'s
        return await self.token_check(presented, scope["method"], path)

    def _screen(self, scope: Any, token_ok: bool = False) -> tuple[tuple[int, str] | None, bool]:
        """Checks 1-3 on the headers: ((status, detail) to refuse with, or None; whether the
        body has a Content-Length — without one, `_read_bounded` must read it). `token_ok`:
        `_token_ok`'s answer, awaited before."""
        headers = scope["headers"]
        content_type = length = None
        for name, value in headers:
            if name == b"content-type":
                content_type = value.decode("latin-1").split(";")[0].strip().lower()
            elif name == b"content-length":
                length = value
        if content_type in CROSS_SITE_TYPES:
            return (415, f"Content-Type {content_type} is not accepted: send the body as application/json"), True
        if self.allowed_hosts is not None and scope["path"] not in self.open_paths:
            host = host_name(headers)
            if host not in self.allowed_hosts:
                return (
                    403,
                    f"Host {host!r} is not allowed on a server without a key (server setting allowed_hosts: "
                    f"{', '.join(sorted(self.allowed_hosts))}): connect by one of those names, add "
                    "yours to allowed_hosts, or set a key",
                ), True
        authorized = True if token_ok else self._authorized(scope, headers)
        if authorized is None:
            return (
                403,
                f"the runner key may not {scope['method']} {scope['path']}: its scope is {RUNNER_SCOPE_TEXT}; "
                "this route needs the admin key (AGL_KEY)",
            ), True
        if not authorized:
            return (401, "Invalid or missing API key"), True
        if length is None:
            return None, False
        try:
            too_big = int(length) > self.max_body_bytes
        except ValueError:
            return (400, "Invalid Content-Length header"), True
        return ((413, self._too_big_detail()) if too_big else None), True

    def _authorized(self, scope: Any, headers: Any) -> bool | None:
        """True: admitted; False: no valid key (401); None: the runner key, outside its scope (403)."""
        path = scope["path"]
        if not self.key or path in self.open_paths:
            return True
        presented = presented_key(headers)
        if presented is None:
            return False
        if secrets.compare_digest(presented.encode(), self._expected):
            return True
        if self._runner_key is not None and secrets.compare_digest(presented.encode(), self._runner_key):
            return True if runner_may(scope["method"], path) else None
        return False  # a rollout token: `_token_ok`, awaited before

    def _too_big_detail(self) -> str:
        return (
            f"Request body larger than {self.max_body_bytes} bytes (server setting max_body_bytes); "
            "send fewer items per request"
        )

    async def _read_bounded(self, receive: Any) -> bytes | None:
        """A body without Content-Length, read up to the limit (None: it is larger)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI `receive` that answers `body` once, then defers to `receive` (disconnects)."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _refuse(scope: Any, receive: Any, send: Any, status: int, detail: str) -> None:
    """Answer `status` with `{"detail": detail}` (401s with WWW-Authenticate: Bearer)."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)
