"""HTTP client of the agl server: retries where they are safe, cursor-based waiting.

`AglClient` — used by the trainer, the rollout managers and the runner — speaks the AGL v1
wire protocol (`agl_lab.protocol`). Three choices differ from AGL v1's client, each on purpose:

1. **Retry only what can succeed on retry.** Idempotent calls (every GET, the batch
   `POST /api/rollouts` with client-assigned ids, `POST /api/models` upserts, pause/resume,
   DELETEs) retry transport errors, 429 and 5xx with capped exponential backoff
   `min(backoff_base * 2**attempt, backoff_cap)` (a `Retry-After` header lengthens the wait).
   Other 4xx fail at once: AGL v1 retried a 401 for ~3.5 minutes before surfacing it.
   Non-idempotent calls (status PATCH, event POST) are sent once unless the caller passes
   `retry=True` because it can tolerate a resend (the runner's terminal PATCH and reward).
2. **Errors carry the server's words.** `AglHTTPError` holds method, path, status and the
   server's `detail`; a 401 is an `AglAuthError` that names the config key to fix.
3. **One request per poll.** `poll_terminal` follows the append-only terminal log
   (`GET /api/rollouts/terminal?after=cursor`) instead of one GET per rollout per second, and
   with `wait_seconds` an agl_lab server holds an empty answer until a rollout changes state (a
   long poll; an AGL server ignores the parameter and answers at once); the
   rollout managers' timeout error (`RolloutWaitTimeout`) names the unfinished rollouts with
   their current states (`states_of`).

4. **Fail-over across servers of one ledger.** `AglClient("http://s0:8080,http://s1:8080")` (or a
   list) talks to the first server and, when one is never reached (the connection refused, or not
   made within `connect_timeout`: a host that drops packets), moves on to the next at once (any
   call may be resent: the request never left), counted in `failovers`; the retry policy's
   backoff starts only after every server failed. A call that reaches no server for
   `unreachable_seconds` (30 s by default) fails with `AglConnectionError` instead of retrying on.
5. **A wrong address says so, once.** A certificate the client cannot verify, an `http://` URL
   on a TLS port (or `https://` on a plain one) and an answer that is not JSON (a web page) raise
   `AglWrongServer` naming the URL and the cause, never retried.

The request/response shapes live in small pure helpers (`_Call` builders and parsers) and the
retry decisions in one `_RetryPolicy.outcome`, so there is one request/retry path.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from agl_lab.protocol import (
    Event,
    EventCreate,
    Model,
    PauseRequest,
    PauseState,
    Rollout,
    RolloutCreate,
    RolloutState,
    RolloutStatusPatch,
    TerminalItem,
    TerminalPage,
)

logger = logging.getLogger(__name__)

AUTH_FIX = "agl server rejected the API key (401): check agentlightning.agl_key / --key"
TERMINAL_PAGE_LIMIT = 1000
_MAX_NAMED_IN_ERROR = 20


# =============================================================================================
# Errors
# =============================================================================================


class AglHTTPError(RuntimeError):
    """A non-2xx answer of the agl server; `detail` is the server's own explanation."""

    def __init__(self, method: str, path: str, status_code: int, detail: str, attempts: int = 1):
        self.method, self.path, self.status_code, self.detail = method, path, status_code, detail
        self.attempts = attempts
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{method} {path} -> {status_code}{tries}: {detail}")


class AglAuthError(AglHTTPError):
    """401: the key the client sends does not match the server's `key`."""

    def __init__(self, method: str, path: str, detail: str):
        super().__init__(method, path, 401, detail)
        self.args = (f"{AUTH_FIX} [{method} {path}: {detail}]",)


class AglConnectionError(ConnectionError):
    """The server could not be reached (transport error or timeout on every attempt)."""


class AglWrongServer(AglConnectionError):
    """The address answers, but not as an agl server this client can use: a certificate it cannot
    verify, the other scheme (http:// on a TLS port, https:// on a plain one), or an answer that
    is not JSON. Never retried: the next attempt would meet the same server."""


class RolloutWaitTimeout(TimeoutError):
    """Rollouts did not all reach a terminal state in time.

    `unfinished` maps each unfinished rollout id to its current state as the server reports
    it (`"missing"` when the server no longer knows the id).
    """

    def __init__(self, timeout: float, unfinished: dict[str, str], n_total: int):
        self.timeout, self.unfinished, self.n_total = timeout, dict(unfinished), n_total
        named = list(self.unfinished.items())[:_MAX_NAMED_IN_ERROR]
        listing = ", ".join(f"{rid} ({state})" for rid, state in named)
        more = len(self.unfinished) - len(named)
        if more > 0:
            listing += f", ... and {more} more"
        super().__init__(
            f"timed out after {timeout:g}s waiting for {len(self.unfinished)} of {n_total} "
            f"rollouts to finish: {listing}. Are runners connected to this server, and is "
            f"each rollout's config.timeout_seconds enforced by them?"
        )


def _q(segment: str) -> str:
    """One URL path segment, percent-quoted (an id with `/`, `?` or `#` stays one segment)."""
    return quote(str(segment), safe="")


def _detail_of(response: httpx.Response) -> str:
    """The server's `detail` (FastAPI), `error` (gateway) or raw text of an error response."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        for key in ("detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)


# =============================================================================================
# Calls: what to send (pure) and how to read the answer (pure)
# =============================================================================================


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    params: Any = None
    json: Any = None
    retry: bool = False  # idempotent: safe to resend after a lost or 429/5xx answer
    timeout: float | None = None


def _create_rollouts_call(requests: Sequence[RolloutCreate]) -> _Call:
    body = [r.model_dump(mode="json", exclude_none=True) for r in requests]
    # Critical: retrying is only safe because every request carries its own rollout_id.
    return _Call("POST", "/api/rollouts", json=body, retry=all(r.rollout_id for r in requests))


def _parse_rollouts(body: Any, expected: int | None = None) -> list[Rollout]:
    rollouts = [Rollout.model_validate(r) for r in body]
    if expected is not None and len(rollouts) != expected:
        raise RuntimeError(f"agl server returned {len(rollouts)} rollouts, expected {expected}")
    return rollouts


def _parse_rollout_with_attempts(body: Any) -> tuple[Rollout, list[str]]:
    if isinstance(body, dict) and "rollout" in body:  # AGL v1 shape; a bare rollout also works
        return Rollout.model_validate(body["rollout"]), list(body.get("attempts") or [])
    return Rollout.model_validate(body), []


def _patch_status_call(
    rollout_id: str, fields: dict[str, Any], retry: bool = False, attempt_id: str | None = None
) -> _Call:
    patch = RolloutStatusPatch(**fields)  # unknown fields fail here, naming the field
    body = {"status": patch.model_dump(mode="json", exclude_unset=True)}
    params = None if attempt_id is None else {"attempt_id": attempt_id}
    return _Call("PATCH", f"/api/rollouts/{_q(rollout_id)}", params=params, json=body, retry=retry)


def _events_call(rollout_id: str, event_type: str | None, fmt: str | None) -> _Call:
    params = {k: v for k, v in (("event_type", event_type), ("format", fmt)) if v is not None}
    return _Call("GET", f"/api/rollouts/{_q(rollout_id)}/events", params=params, retry=True)


def _add_event_call(rollout_id: str, attempt_id: str, event_type: str, data: dict, retry: bool = False) -> _Call:
    """A retried event carries a fresh client-made `event_id`: the server stores a resend of it
    once (a 503 after which the store had nothing, or an answer lost after it stored the event)."""
    event_id = uuid.uuid4().hex if retry else None
    body = EventCreate(event_type=event_type, data=dict(data or {}), event_id=event_id).model_dump(
        mode="json", exclude_none=True
    )
    return _Call("POST", f"/api/rollouts/{_q(rollout_id)}/attempt/{_q(attempt_id)}/events", json=body, retry=retry)


def _terminal_call(after: int, limit: int, wait_seconds: float = 0.0, timeout: float | None = None) -> _Call:
    params: dict[str, Any] = {"after": after, "limit": limit}
    if wait_seconds > 0:  # a plain call stays byte-for-byte AGL's
        params["wait_seconds"] = float(wait_seconds)
    return _Call("GET", "/api/rollouts/terminal", params=params, retry=True, timeout=timeout)


def _pause_call(reason: str | None, retry_after_seconds: int, timeout: float) -> _Call:
    body = PauseRequest(retry_after_seconds=retry_after_seconds, reason=reason).model_dump()
    return _Call("POST", "/proxy/pause", json=body, retry=True, timeout=timeout)


def _select_terminal(page: TerminalPage, wanted: set[str]) -> list[TerminalItem]:
    return [item for item in page.items if item.rollout_id in wanted]


def _page_is_full(page: TerminalPage) -> bool:
    return page.next_after < page.total_terminal


# =============================================================================================
# Retry policy and request arguments shared by both clients (and, through AglClient, the runner)
# =============================================================================================


class _RetryPolicy:
    def __init__(self, max_retries: int, backoff_base: float, backoff_cap: float, unreachable_seconds: float):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not unreachable_seconds > 0:
            raise ValueError(f"unreachable_seconds must be > 0, got {unreachable_seconds}")
        self.max_retries, self.backoff_base, self.backoff_cap = max_retries, backoff_base, backoff_cap
        self.unreachable_seconds = unreachable_seconds

    def attempts(self, call: _Call) -> int:
        return self.max_retries + 1 if call.retry else 1

    @staticmethod
    def retryable(status: int) -> bool:
        return status == 429 or status >= 500

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        delay = min(self.backoff_base * 2**attempt, self.backoff_cap)
        retry_after = response.headers.get("retry-after") if response is not None else None
        if retry_after is not None:
            try:
                delay = max(delay, min(float(retry_after), self.backoff_cap))
            except ValueError:
                pass
        return delay

    def outcome(
        self, base_url: str, call: _Call, attempt: int, answer: httpx.Response | Exception, elapsed: float = 0.0
    ) -> tuple[bool, Any]:
        """What to do after attempt `attempt` of `call` got `answer` (a response or a transport error),
        `elapsed` seconds after the call's first attempt started.

        `(True, body)`: done, `body` is the decoded JSON (None if empty). `(False, delay)`: wait
        `delay` seconds and send again. Raises `AglAuthError` (401, never retried),
        `AglHTTPError` (other errors, or the last attempt), `AglWrongServer` (never retried) or
        `AglConnectionError` (the last attempt, or no server reached for `unreachable_seconds`).
        """
        last = attempt + 1 >= self.attempts(call)
        if isinstance(answer, Exception):
            wrong = _certificate_refused(base_url, answer) or _scheme_mismatch(base_url, answer)
            if wrong is not None:
                raise wrong from answer
            delay = self.delay(attempt, None)
            # Critical: a server never reached is given `unreachable_seconds`, not the whole retry budget.
            if last or (never_reached(answer) and elapsed + delay > self.unreachable_seconds):
                raise _unreachable(base_url, call, attempt + 1, answer, elapsed) from answer
            self._log_retry(call, attempt, repr(answer), delay)
            return False, delay
        if answer.is_success:
            return True, _json_of(base_url, call, answer)
        if answer.status_code == 401:
            raise AglAuthError(call.method, call.path, _detail_of(answer))
        if not self.retryable(answer.status_code) or last:
            raise AglHTTPError(call.method, call.path, answer.status_code, _detail_of(answer), attempt + 1)
        delay = self.delay(attempt, answer)
        self._log_retry(call, attempt, f"HTTP {answer.status_code}", delay)
        return False, delay

    def _log_retry(self, call: _Call, attempt: int, what: str, delay: float) -> None:
        logger.warning(
            "%s %s failed (attempt %d/%d): %s; retrying in %.2fs",
            call.method,
            call.path,
            attempt + 1,
            self.attempts(call),
            what,
            delay,
        )


def _request_args(call: _Call, connect_timeout: float) -> dict[str, Any]:
    """Keyword arguments of `httpx.Client.request` for `call`; a call's own (longer) timeout keeps
    the client's connect timeout: waiting longer for a connection never helps a slow answer."""
    timeout: Any = httpx.USE_CLIENT_DEFAULT
    if call.timeout is not None:
        timeout = httpx.Timeout(call.timeout, connect=min(connect_timeout, call.timeout))
    return {"method": call.method, "url": call.path, "params": call.params, "json": call.json, "timeout": timeout}


def _auth_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _certificate_refused(base_url: str, exc: Exception) -> AglWrongServer | None:
    """The error for a TLS certificate this client could not verify (never retried: the next
    attempt would meet the same certificate), or None for another transport error."""
    if "CERTIFICATE_VERIFY_FAILED" not in str(exc):
        return None
    return AglWrongServer(
        f"the TLS certificate of {base_url} could not be verified ({exc}): point SSL_CERT_FILE at the "
        "CA file that signed it (agl-lab runner --ssl-ca-file PATH)"
    )


def _unreachable(base_url: str, call: _Call, attempts: int, exc: Exception, elapsed: float) -> AglConnectionError:
    return AglConnectionError(
        f"cannot reach the agl server at {base_url} ({call.method} {call.path}) after "
        f"{attempts} attempt(s) in {elapsed:.1f} s: {type(exc).__name__}: {exc}"
    )


def never_reached(exc: Exception) -> bool:
    """Whether the request never left: the connection was refused or not made within the connect
    timeout (a host that drops packets). Any call may then be resent, to this server or another."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


# OpenSSL's words when an https:// client meets a plain-HTTP answer to its hello (1.1 and 3.x)
_PLAIN_ANSWER_TO_TLS = (
    "WRONG_VERSION_NUMBER",
    "wrong version number",
    "record layer failure",
    "packet length too long",
)


def _scheme_mismatch(base_url: str, exc: Exception) -> AglWrongServer | None:
    """The error for a URL whose scheme the server does not speak, or None.

    https:// to a plain port: OpenSSL reads the server's HTTP answer as a TLS record. http:// to a
    TLS port: the server drops the connection without an answer; a TLS handshake then succeeds."""
    host_port = base_url.split("://", 1)[-1]
    if base_url.startswith("https://") and any(word in str(exc) for word in _PLAIN_ANSWER_TO_TLS):
        return AglWrongServer(
            f"{base_url} answered the TLS handshake in plain HTTP ({exc}): it is not a TLS port; "
            f"use http://{host_port}, or start the server with --ssl-certfile/--ssl-keyfile"
        )
    if base_url.startswith("http://") and isinstance(exc, httpx.RemoteProtocolError) and _speaks_tls(base_url):
        return AglWrongServer(
            f"{base_url} is a TLS port (it completed a TLS handshake and dropped the plain HTTP request): "
            f"use https://{host_port}"
        )
    return None


def _speaks_tls(url: str, timeout: float = 3.0) -> bool:
    """Whether the server at `url` completes a TLS handshake (certificate not checked: only the
    protocol is asked)."""
    import socket
    import ssl

    parsed = httpx.URL(url)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((parsed.host, parsed.port or 80), timeout=timeout) as sock:
            with context.wrap_socket(sock, server_hostname=parsed.host):
                return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


def _json_of(base_url: str, call: _Call, answer: httpx.Response) -> Any:
    """The JSON body of a 2xx answer (None if empty); `AglWrongServer` naming what answered when it
    is not JSON (a web page, a proxy's login form): the URL is not an agl server's."""
    if not answer.content:
        return None
    try:
        return answer.json()
    except ValueError:
        raise AglWrongServer(
            f"{base_url}{call.path} answered {answer.status_code} "
            f"{answer.headers.get('content-type', 'without a content type')}, not JSON: "
            f"{answer.content[:80]!r}: this is not an agl_lab / Agent Lightning server; check the URL "
            "(agentlightning.agl_base_url, agl-lab runner --server)"
        ) from None


# =============================================================================================
# Sync client
# =============================================================================================


def server_key(key: str | None, key_file: str | None, environ: Mapping[str, str], prog: str) -> str:
    """The server key of a command (`agl-lab serve`, `agl-lab runner`): `key` (--key), else the
    content of `key_file` (--key-file), else $AGL_KEY, else "" (auth off). SystemExit naming
    `prog` for both flags, an unreadable or an empty key file."""
    if key is not None and key_file is not None:
        raise SystemExit(f"{prog}: give --key or --key-file, not both")
    if key is not None:
        return key
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"{prog}: cannot read --key-file {key_file}: {exc}") from None
        except UnicodeDecodeError:
            raise SystemExit(
                f"{prog}: --key-file {key_file} is not UTF-8 text: write the key (ASCII) into it"
            ) from None
        if not key:
            raise SystemExit(f"{prog}: --key-file {key_file} is empty")
        return key
    return environ.get("AGL_KEY", "")


def server_urls(base_url: str | Sequence[str]) -> list[str]:
    """The servers of `agentlightning.agl_base_url`: one URL, several comma-separated, or a list."""
    parts = base_url.split(",") if isinstance(base_url, str) else [str(u) for u in base_url]
    urls = [u.strip().rstrip("/") for u in parts if u.strip()]
    if not urls:
        raise ValueError(f"agentlightning.agl_base_url={base_url!r} names no server: give http://host:port[,…]")
    return urls


class AglClient:
    """Blocking client of one agl server (or an AGL v1 server), or of several servers of one ledger.

    Args:
        base_url: server root, e.g. `http://127.0.0.1:8080` (no `/api`); several servers of one
            ledger comma-separated (or a list): when one is never reached (refused, or no
            connection within `connect_timeout`) the next one is used (`base_url` is then the
            one in use, `failovers` counts the moves).
        key: bearer key; empty sends no Authorization header.
        timeout: per-request timeout in seconds (reading the answer: a slow server is waited for).
        connect_timeout: seconds to make the connection (a host that drops packets is left after it).
        max_retries: extra attempts for idempotent calls (11 attempts in all by default).
        backoff_base, backoff_cap: wait `min(backoff_base * 2**attempt, backoff_cap)` seconds
            between attempts (tests pass a tiny base).
        unreachable_seconds: a call that has reached no server for this long fails
            (`AglConnectionError`) instead of retrying on; answers (5xx, 429) keep the retry budget.
        transport, event_hooks: passed to `httpx.Client` (tests count requests with them).
    """

    def __init__(
        self,
        base_url: str,
        key: str = "",
        timeout: float = 120.0,
        max_retries: int = 10,
        backoff_base: float = 1.0,
        backoff_cap: float = 30.0,
        *,
        connect_timeout: float = 5.0,
        unreachable_seconds: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        event_hooks: dict[str, list] | None = None,
    ):
        self._urls = server_urls(base_url)
        self.base_url = self._urls[0]
        self.failovers = 0
        self._policy = _RetryPolicy(max_retries, backoff_base, backoff_cap, unreachable_seconds)
        self._connect_timeout = min(connect_timeout, timeout)
        self._timeout = float(timeout)
        timeouts = httpx.Timeout(timeout, connect=self._connect_timeout)
        self._clients = [
            httpx.Client(
                base_url=url, headers=_auth_headers(key), timeout=timeouts, transport=transport, event_hooks=event_hooks
            )
            for url in self._urls
        ]
        self._current = 0
        self.http = self._clients[0]

    # -- plumbing ------------------------------------------------------------------------

    def _send(self, call: _Call) -> Any:
        """Send `call` with the retry policy; return the decoded JSON body (None if empty)."""
        started = time.monotonic()
        for attempt in itertools.count():
            for _hop in range(len(self._urls)):  # a server never reached: the next one, at once
                try:
                    answer: httpx.Response | Exception = self.http.request(**_request_args(call, self._connect_timeout))
                except httpx.TransportError as exc:
                    answer = exc
                if not isinstance(answer, Exception) or not never_reached(answer) or len(self._urls) == 1:
                    break
                self._fail_over(answer)
            done, value = self._policy.outcome(self.base_url, call, attempt, answer, time.monotonic() - started)
            if done:
                return value
            time.sleep(value)
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def urls(self) -> list[str]:
        """The servers this client may use, in fail-over order."""
        return list(self._urls)

    def _fail_over(self, exc: Exception) -> None:
        """Use the next server of `base_url`'s list (this one was never reached)."""
        failed = self.base_url
        self._current = (self._current + 1) % len(self._urls)
        self.http, self.base_url = self._clients[self._current], self._urls[self._current]
        self.failovers += 1
        logger.warning("server %s was not reached (%r); failing over to %s", failed, exc, self.base_url)

    def _best_effort(self, call: _Call) -> bool:
        try:
            self._send(call)
            return True
        except AglAuthError:
            raise  # a wrong key is a configuration error, never "best effort"
        except (AglHTTPError, AglConnectionError) as exc:
            logger.warning("best-effort %s %s failed: %s", call.method, call.path, exc)
            return False

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self) -> AglClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rollouts ------------------------------------------------------------------------

    def create_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        """POST /api/rollouts; retried when every request carries a `rollout_id`."""
        return _parse_rollouts(self._send(_create_rollouts_call(requests)), len(requests))

    def get_rollout(self, rollout_id: str) -> tuple[Rollout, list[str]]:
        """GET /api/rollouts/{id} -> (rollout, attempt ids that have events)."""
        return _parse_rollout_with_attempts(self._send(_Call("GET", f"/api/rollouts/{_q(rollout_id)}", retry=True)))

    def list_rollouts(self, states: Iterable[str | RolloutState], limit: int = 500) -> list[Rollout]:
        params = {"state_in": [str(s) for s in states], "limit": limit}
        return _parse_rollouts(self._send(_Call("GET", "/api/rollouts", params=params, retry=True)))

    def patch_status(
        self, rollout_id: str, *, retry: bool = False, attempt_id: str | None = None, **fields: Any
    ) -> Rollout:
        """PATCH the status (state, last_attempt_id, error_message, k8s_job_name).

        Sent once unless `retry`: resending a terminal PATCH is safe when the caller reads a
        409 on the resend as "already done" (the runner does). `attempt_id` (an agl_lab
        server's `?attempt_id=`) applies the patch only while that attempt runs (409 else).
        """
        return Rollout.model_validate(self._send(_patch_status_call(rollout_id, fields, retry, attempt_id)))

    def claim_rollouts(self, limit: int, runner_id: str = "", wait_seconds: float = 0.0) -> list[Rollout]:
        """Claim up to `limit` queued rollouts for this caller alone (`POST /api/rollouts/claim`,
        agl_lab); each comes back running with its new `last_attempt_id`. With none queued the
        server waits up to `wait_seconds` for one (a long poll) before answering [].

        Sent once: a resend after a lost answer would claim other rollouts; the ones the lost
        answer held go back to the queue when their lease expires. An AGL server answers 404/405."""
        body: dict[str, Any] = {"limit": int(limit), "runner_id": runner_id}
        if wait_seconds:
            body["wait_seconds"] = float(wait_seconds)
        return _parse_rollouts(self._send(_Call("POST", "/api/rollouts/claim", json=body)))

    def release_rollouts(self, attempts: dict[str, str], reason: str) -> list[str]:
        """Give running attempts ({rollout id: attempt id}) back to the queue; the ids released."""
        body = {"attempts": dict(attempts), "reason": reason}
        return list(self._send(_Call("POST", "/api/rollouts/release", json=body, retry=True))["released"])

    def heartbeat(self, rollout_ids: Sequence[str], attempt_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """Renew the leases of running rollouts: `{"not_running": [...], "lease_seconds": s}`.
        With `attempt_ids` (one per rollout id) a rollout counts only while it runs that attempt."""
        body: dict[str, Any] = {"rollout_ids": list(rollout_ids)}
        if attempt_ids is not None:
            body["attempt_ids"] = list(attempt_ids)
        return self._send(_Call("POST", "/api/rollouts/heartbeat", json=body, retry=True))

    def fail_rollouts(self, rollout_ids: Sequence[str], reason: str) -> list[str]:
        """PATCH each queuing or running rollout to failed with `reason`; returns those failed.

        Rollouts already terminal (409) or gone (404) are skipped: the state is the same either way."""
        failed = []
        for rid in rollout_ids:
            try:
                self.patch_status(rid, state=RolloutState.FAILED.value, error_message=reason, retry=True)
                failed.append(rid)
            except AglHTTPError as exc:
                if exc.status_code not in (404, 409):
                    raise
        return failed

    def delete_rollout(self, rollout_id: str) -> bool:
        """Best-effort DELETE (the server answers 204 even for unknown ids)."""
        return self._best_effort(_Call("DELETE", f"/api/rollouts/{_q(rollout_id)}", retry=True))

    # -- events --------------------------------------------------------------------------

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict, *, retry: bool = False) -> Event:
        """POST one event; sent once unless `retry`: then resent on 503s and lost connections under one
        client-made `event_id`, which an agl_lab server stores once (an AGL v1 server ignores the id:
        a resend there may record the event twice)."""
        return Event.model_validate(self._send(_add_event_call(rollout_id, attempt_id, event_type, data, retry)))

    def get_events(
        self, rollout_id: str, event_type: str | None = None, fmt: str | None = None
    ) -> list[dict[str, Any]]:
        """Events of the rollout's last attempt, in insertion order; `fmt="triplet"` reduces them."""
        return list(self._send(_events_call(rollout_id, event_type, fmt)))

    # -- completion ----------------------------------------------------------------------

    def terminal_page(
        self, after: int = 0, limit: int = TERMINAL_PAGE_LIMIT, wait_seconds: float = 0.0
    ) -> TerminalPage:
        """One page of the terminal log from cursor `after`; with `wait_seconds` an agl_lab server
        holds an empty page up to that long, answering at the first rollout state change."""
        timeout = self._timeout + wait_seconds if wait_seconds > 0 else None
        return TerminalPage.model_validate(self._send(_terminal_call(after, limit, wait_seconds, timeout)))

    def poll_terminal(
        self, ids: Iterable[str], after: int, wait_seconds: float = 0.0
    ) -> tuple[list[TerminalItem], int]:
        """Terminal items among `ids` logged at or after cursor `after`, and the new cursor.

        One request, unless more than `TERMINAL_PAGE_LIMIT` rollouts finished since `after`;
        `wait_seconds` makes the first a long poll (`terminal_page`).
        """
        wanted, found = set(ids), []
        while True:
            page = self.terminal_page(after, wait_seconds=wait_seconds)
            wait_seconds = 0.0  # the rest of a full log is read at once
            found += _select_terminal(page, wanted)
            after = page.next_after
            if not _page_is_full(page):
                return found, after

    def states_of(self, ids: Iterable[str], limit: int = _MAX_NAMED_IN_ERROR) -> dict[str, str]:
        """Current state of (at most `limit` of) `ids`, `"missing"` for unknown ids (for errors)."""
        ids = sorted(ids)
        states: dict[str, str] = {}
        for rid in ids[:limit]:
            try:
                states[rid] = str(self.get_rollout(rid)[0].status.state)
            except AglHTTPError as exc:
                states[rid] = "missing" if exc.status_code == 404 else f"unknown ({exc.status_code})"
        states.update({rid: "not fetched" for rid in ids[limit:]})
        return states

    # -- models and gateway ----------------------------------------------------------------

    def register_models(self, models: Sequence[Model]) -> list[Model]:
        body = [m.model_dump(mode="json") for m in models]
        return [Model.model_validate(m) for m in self._send(_Call("POST", "/api/models", json=body, retry=True))]

    def delete_models(self, model: str | None = None) -> bool:
        """Best-effort DELETE /api/models: the endpoints of `model` (None: of every model)."""
        params = {"model": model} if model is not None else None
        return self._best_effort(_Call("DELETE", "/api/models", params=params, retry=True))

    def pause(self, reason: str | None = None, retry_after_seconds: int = 5, timeout: float = 300.0) -> PauseState:
        return PauseState.model_validate(self._send(_pause_call(reason, retry_after_seconds, timeout)))

    def resume(self) -> PauseState:
        return PauseState.model_validate(self._send(_Call("POST", "/proxy/resume", retry=True)))

    def proxy_state(self) -> PauseState:
        return PauseState.model_validate(self._send(_Call("GET", "/proxy/state", retry=True)))

    def proxy_config(self) -> dict[str, Any]:
        """GET /proxy/config: the gateway's model name, train/val temperatures and logprobs flag."""
        return self._send(_Call("GET", "/proxy/config", retry=True))

    def healthz(self) -> dict[str, Any]:
        return self._send(_Call("GET", "/healthz", retry=True))
