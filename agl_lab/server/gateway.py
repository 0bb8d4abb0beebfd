"""The LLM gateway: an OpenAI-compatible reverse proxy that records every call of a rollout.

An agent gets `{server}/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1` as its
OpenAI `base_url`; the URL path alone attributes the call to the rollout. Per call (AGL v1,
Agent Lightning v1's `server/proxy.py`, in this order):

    validate  mode -> upstream path -> rollout exists -> (agl_lab) rollout not terminal
              -> client configured -> JSON body -> a server registered for the model
    rewrite   train: model, temperature, return_token_ids, logprobs ; val: no logprobs
              then the pluggable request rewriters (e.g. the token-preserving mode)
    gate      paused -> 429 + Retry-After + X-Agl-Paused, nothing recorded ; else inflight += 1
    forward   stream:true -> 400 ; POST with retries on timeouts, transport errors, 408, 409,
              429 and >= 500, backoff min(base*2^i, max)*U(0.75, 1.25); a timed-out attempt the
              engine reports queued or running waits longer instead, never sent twice (`_attempt`)
    record    one `model_request` event (errors too), then answer with the upstream JSON

Server choice is pinned per rollout: the pool of endpoints registered for the model, sorted
by endpoint, indexed by the first 8 bytes of sha256(rollout_id) (big-endian) mod its size, so
every turn of a rollout hits the same replica's prefix cache.

Departures from AGL (docs/architecture.md): a call for a rollout already succeeded/failed answers
409 and records nothing; a rollout deleted while its call was in flight still gets the
upstream answer (AGL answered 404 after a successful generation); `model_version` is the
registered Model's version, which agl_lab engines set to the policy version.

Speed (every LLM call of every agent passes here; benchmarks/gateway.py measures it against
AGL). The proxy's POSTs skip FastAPI's middleware stack: `agl_lab.server.asgi.AglApp` hands
them to `Gateway.handle` with the same checks and error answers; uvicorn runs on uvloop with
httptools and writes each answer's head and body in one write; the upstream client is the
raw one (`upstream_client: auto`, agl_lab.server.upstream: one write per request, httptools
parsing, a keep-alive pool); bodies go through orjson; the agent's disconnect is watched by
one task; the stores keep the per-call append cheap. Side by side on this project's 2-core
VM at one agent and a 5 ms upstream, this took the gateway's CPU per call from ~1.2 ms to
~0.7 ms and its added p50 latency, which tracks that CPU, from ~1.3 ms to ~0.7 ms; a bare
uvloop+httptools proxy that only forwards bytes costs ~0.24 ms (the floor).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
import random
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import anyio.to_thread
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from starlette.routing import Route

from agl_lab.protocol import Model, PauseRequest, PauseState, Rollout
from agl_lab.server.config import DefaultProxyConfig, ServerConfig
from agl_lab.server.storable import NotStorable
from agl_lab.server.store import RolloutNotFound, Store
from agl_lab.server.upstream import (
    ABORT_REQUEST_PATH,
    REQUEST_STATE_PATH,
    UpstreamClient,
    UpstreamRefused,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamTransportError,
)

try:  # orjson parses/serialises the request and response bodies several times faster
    import orjson

    _dumps, _loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

logger = logging.getLogger("agl_lab.server.gateway")
T = TypeVar("T")

MODES = ("train", "val")
UPSTREAM_PATHS = ("chat/completions", "completions")
RETRYABLE_STATUS = frozenset({408, 409, 429})
# what agl_lab's engine answers for a call it still works on ("answered": done, its answer on the way
# back); "no_reply": the engine's server did not answer the question within ENGINE_ASK_SECONDS (too
# loaded to: sending the call again would not help)
WORKING_STATES = frozenset({"queued", "running", "answered", "no_reply"})
ENGINE_ASK_SECONDS = 30.0


class _BarredTimeout(UpstreamTimeout):
    """An attempt agl_lab's engine did not know (never arrived, answered long ago, or still in
    transit), its id barred there: a retry is the only generation (`Gateway._attempt`)."""


def proxy_base_url(server_url: str, rollout_id: str, attempt_id: str = "0", mode: str = "train") -> str:
    """The OpenAI `base_url` an agent uses for one rollout attempt (AGL_OPENAI_BASE_URL)."""
    rid, aid = quote(rollout_id, safe=""), quote(attempt_id, safe="")
    return f"{server_url.rstrip('/')}/proxy/rollout/{rid}/attempt/{aid}/mode/{mode}/openai/v1"


# ---------------------------------------------------------------------------------------------
# Pure pieces: server pinning, body rewrite, backoff
# ---------------------------------------------------------------------------------------------


def select_server(pool: Sequence[Model], rollout_id: str) -> Model:
    """Pin a rollout to one endpoint: sha256(rollout_id)[:8] big-endian mod len(pool)."""
    if len(pool) == 1:
        return pool[0]
    ordered = sorted(pool, key=lambda m: m.endpoint)
    return ordered[_pin_hash(rollout_id) % len(ordered)]


@functools.lru_cache(maxsize=65536)
def _pin_hash(rollout_id: str) -> int:
    """sha256(rollout_id)[:8] as a big-endian int (cached: every turn of a rollout asks again)."""
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big")


def rewrite_request(body: dict[str, Any], mode: str, proxy: DefaultProxyConfig) -> dict[str, Any]:
    """Shallow-merge the forced sampling parameters over the agent's body."""
    if mode == "train":
        forced: dict[str, Any] = {
            "model": proxy.model_name,
            "temperature": proxy.train.temperature,
            "return_token_ids": True,
        }
        if proxy.include_log_probs:
            forced["logprobs"] = True
    elif mode == "val":
        forced = {"model": proxy.model_name, "temperature": proxy.val.temperature, "return_token_ids": True}
    else:
        raise ValueError(f"Unsupported proxy mode: {mode} (use one of {MODES})")
    return {**body, **forced}


# Sampling parameters the gateway forces whose agent value is worth reporting when it differs.
OVERRIDE_REPORTED = ("temperature",)


def overridden_params(body: dict[str, Any], request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{name: {"agent": asked, "served": forced}}` for each reported parameter the agent set to
    another value than the one the gateway serves with (recorded on the call, said once)."""
    return {
        k: {"agent": body[k], "served": request[k]}
        for k in OVERRIDE_REPORTED
        if k in body and body[k] is not None and body[k] != request.get(k)
    }


def backoff_seconds(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Sleep before retry `attempt` (0-based): min(base * 2^attempt, cap) * U(0.75, 1.25)."""
    return min(base * 2.0**attempt, cap) * rng.uniform(0.75, 1.25)


# ---------------------------------------------------------------------------------------------
# Request rewriters (the plug-in point of the token-preserving mode)
# ---------------------------------------------------------------------------------------------


ResponseHook = Callable[[Any, int], Any]


@dataclass
class ProxyCall:
    """One proxied call as a rewriter sees it, after the standard rewrite, before forwarding.

    A rewriter may:
    - mutate/replace `request`: the agent's body after the standard rewrite; sent upstream
      unless `upstream_request` is set, and recorded as the event's `request`;
    - set `upstream_request` and/or `upstream_path` ("chat/completions" | "completions") to
      send another body to another route (both are then recorded too, as `upstream_request`
      and `upstream_path`);
    - append `response_hooks`: `hook(payload, http_status) -> payload` turns the upstream JSON
      into what the agent gets and what is recorded as `response` (run in order, also on
      errors; a hook may be async);
    - add keys to `annotations`, merged into the recorded `model_request` data (the
      gateway's own keys win on a clash).
    """

    rollout: Rollout
    attempt_id: str
    mode: str
    upstream_path: str
    server: Model
    request: dict[str, Any]
    store: Store
    annotations: dict[str, Any] = field(default_factory=dict)
    upstream_request: dict[str, Any] | None = None
    response_hooks: list[ResponseHook] = field(default_factory=list)
    agent_path: str = field(init=False)  # the path the agent called

    def __post_init__(self) -> None:
        self.agent_path = self.upstream_path

    @property
    def rerouted(self) -> bool:
        """True when a rewriter sends another body or path upstream than the agent's."""
        return self.upstream_request is not None or self.upstream_path != self.agent_path


RequestRewriter = Callable[[ProxyCall], Awaitable[None] | None]


# ---------------------------------------------------------------------------------------------
# Pause gate
# ---------------------------------------------------------------------------------------------


class PauseGate:
    """Pause flag + inflight counter. A thread lock (not an asyncio one): the trainer may flip
    it from a notebook thread while the server's loop admits calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.paused, self.retry_after_seconds, self.reason, self.inflight = False, 5, None, 0

    def state(self) -> PauseState:
        with self._lock:
            return self._state()

    def _state(self) -> PauseState:
        return PauseState(
            paused=self.paused, retry_after_seconds=self.retry_after_seconds, reason=self.reason, inflight=self.inflight
        )

    def pause(self, retry_after_seconds: int = 5, reason: str | None = None) -> PauseState:
        with self._lock:
            self.paused, self.retry_after_seconds, self.reason = True, retry_after_seconds, reason
            return self._state()

    def resume(self) -> PauseState:
        with self._lock:
            self.paused, self.reason = False, None
            return self._state()

    def enter(self) -> PauseState | None:
        """Admit a call (inflight += 1, returns None) or return the state that refused it."""
        with self._lock:
            if self.paused:
                return self._state()
            self.inflight += 1
            return None

    def leave(self) -> None:
        with self._lock:
            self.inflight = max(0, self.inflight - 1)


# ---------------------------------------------------------------------------------------------
# The gateway's own answers for calls the model server did not serve
# ---------------------------------------------------------------------------------------------


class UpstreamFailure(Exception):
    """The gateway's own answer for a call the model server did not serve (502/503/504).

    `detail` goes to the agent, `cause` into the recorded error event (and the log).
    """

    def __init__(self, status: int, detail: str, cause: str, retry_after: float | None = None):
        super().__init__(f"{status} {detail}: {cause}")
        self.status, self.detail, self.cause, self.retry_after = status, detail, cause, retry_after

    def response(self) -> JSONResponse:
        headers = {} if self.retry_after is None else {"Retry-After": str(max(1, round(self.retry_after)))}
        return JSONResponse({"detail": self.detail, "cause": self.cause}, status_code=self.status, headers=headers)


# ---------------------------------------------------------------------------------------------
# The gateway
# ---------------------------------------------------------------------------------------------


class Gateway:
    """Validates, rewrites, gates, forwards and records proxied calls; owns the pause gate.

    `client` (one shared upstream connection pool, see `open_upstream_client`) is set by the
    app's lifespan; without it the proxy answers 503 "Proxy not configured".
    """

    def __init__(self, config: ServerConfig, store: Store, rewriters: Sequence[RequestRewriter] = ()):
        self.config, self.store = config, store
        self.rewriters: list[RequestRewriter] = list(rewriters)
        self.gate = PauseGate()
        self.client: UpstreamClient | None = None
        self._rng = random.Random()
        self._down_until: dict[str, float] = {}  # endpoint -> loop time its breaker closes again
        # GET /proxy/upstream_stats: attempts extended while the engine worked on them, calls failed
        # past the cap (the engine's copy aborted), attempts the engine did not know (barred, sent
        # again: the call's event counts them in retry_count); each extension is in the call's event
        self.stats = {"timeout_extensions": 0, "aborted_past_cap": 0, "resent_unknown": 0}
        self._aborts: set[asyncio.Future[Any]] = set()  # engine aborts of calls the agent hung up on
        self._said_override = False  # the agent-temperature override is logged once per gateway

    async def handle(
        self,
        read_body: Callable[[], Awaitable[bytes]],
        receive: Callable[[], Awaitable[Any]],
        rollout_id: str,
        attempt_id: str,
        mode: str,
        upstream_path: str,
    ) -> Response:
        """The proxy route: validate in AGL's order, then forward (`_forward`).

        `read_body()` returns the request body; `receive` is the request's ASGI receive, which
        after the body only answers the agent's disconnect (`_forward_until_disconnect`).
        """
        if mode not in MODES:
            raise HTTPException(404, f"Unsupported proxy mode: {mode}")
        if upstream_path not in UPSTREAM_PATHS:
            raise HTTPException(404, f"Unsupported upstream path: {upstream_path}")
        model_name = self.config.default_proxy.model_name
        rollout, pool = await store_call(self.store, self._lookup, rollout_id, model_name)
        if rollout is None:
            raise HTTPException(404, f"Rollout not found: {rollout_id}")
        if rollout.is_terminal:
            raise HTTPException(
                409,
                f"Rollout {rollout_id} is {rollout.status.state}: the gateway only "
                "forwards calls of queuing or running rollouts (create a new rollout "
                "to run the task again)",
            )
        if self.client is None:
            raise HTTPException(503, "Proxy not configured")
        body = _parse_body(await read_body())
        if not pool:
            raise HTTPException(503, f"No servers available for model '{model_name}'")
        server = select_server(pool, rollout_id)
        call = ProxyCall(
            rollout=rollout,
            attempt_id=attempt_id,
            mode=mode,
            upstream_path=upstream_path,
            server=server,
            request=rewrite_request(body, mode, self.config.default_proxy),
            store=self.store,
        )
        overridden = overridden_params(body, call.request)
        if overridden:
            call.annotations["overridden"] = overridden
            if not self._said_override:
                self._said_override = True
                logger.warning(
                    "the gateway samples with %s, not the agent's %s (%s mode): the policy is trained on "
                    "its own sampling distribution (actor_rollout_ref.rollout.temperature; validation: "
                    "agl_lab.server.val_temperature). Each such call records it in "
                    "triplet.metadata['overridden']; said once.",
                    ", ".join(f"{k}={v['served']}" for k, v in overridden.items()),
                    ", ".join(f"{k}={v['agent']}" for k, v in overridden.items()),
                    mode,
                )
        for rewriter in self.rewriters:
            result = rewriter(call)
            if inspect.isawaitable(result):
                await result
        return await self._forward_until_disconnect(call, receive)

    def _lookup(self, rollout_id: str, model_name: str) -> tuple[Rollout | None, list[Model]]:
        """The rollout and the model's pool, in one worker-thread hop (`store_call`)."""
        rollout = self.store.get_rollout(rollout_id)
        return rollout, ([] if rollout is None or rollout.is_terminal else self.store.models_for(model_name))

    async def _forward_until_disconnect(self, call: ProxyCall, receive: Callable[[], Awaitable[Any]]) -> Response:
        """`_forward`, cancelled (upstream call, retries and backoff) if the agent hangs up.

        The body is read, so the next ASGI `receive()` only returns on disconnect (or when the
        response is complete). `_forward` runs in this task; one watcher task cancels it when
        the agent disconnects. A cancelled call records an error event with status 499.
        """
        task = asyncio.current_task()
        assert task is not None
        hung_up = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, task, hung_up))
        try:
            return await self._forward(call)
        except asyncio.CancelledError:
            if not hung_up.done() or task.uncancel() > 0:
                raise  # cancelled from outside (server shutdown): not the agent's hang-up
            cause = "the agent disconnected before the model server answered; the upstream call was cancelled"
            logger.warning("Rollout %s: %s", call.rollout.rollout_id, cause)
            await self._record_failure(call, UpstreamFailure(499, "Client disconnected", cause), 0)
            return Response(status_code=499)
        finally:
            watch.cancel()

    async def _forward(self, call: ProxyCall) -> Response:
        refused = self.gate.enter()
        if refused is not None:  # paused: the agent retries after Retry-After; nothing recorded
            return JSONResponse(
                {"error": "gateway paused", "reason": refused.reason},
                status_code=429,
                headers={"Retry-After": str(refused.retry_after_seconds), "X-Agl-Paused": "true"},
            )
        started = time.perf_counter()
        try:
            if call.request.get("stream"):
                raise HTTPException(400, "Streaming responses are not supported")
            if call.upstream_path not in UPSTREAM_PATHS:
                raise ValueError(
                    f"a request rewriter set upstream_path={call.upstream_path!r}; use one of {UPSTREAM_PATHS}"
                )
            url = call.server.endpoint.rstrip("/") + "/" + call.upstream_path
            body = call.request if call.upstream_request is None else call.upstream_request
            upstream, retry_count = await self._send_with_retries(url, _dumps(body), call)
            latency_ms = (time.perf_counter() - started) * 1000.0
            content, payload = _json_of(upstream)
            if call.response_hooks:
                for hook in call.response_hooks:
                    payload = hook(payload, upstream.status_code)
                    if inspect.isawaitable(payload):
                        payload = await payload
                content = _dumps(payload)
            unrecordable = await self._record(call, payload, upstream.status_code, latency_ms, retry_count)
            if unrecordable is not None and upstream.status_code < 400:
                return UpstreamFailure(502, "The model server's answer cannot be recorded", unrecordable).response()
            headers = (
                {"Retry-After": upstream.retry_after} if upstream.retry_after and upstream.status_code >= 400 else None
            )
            return Response(
                content=content, status_code=upstream.status_code, media_type="application/json", headers=headers
            )
        except UpstreamFailure as failure:
            logger.warning("Rollout %s: %s", call.rollout.rollout_id, failure)
            await self._record_failure(call, failure, (time.perf_counter() - started) * 1000.0)
            return failure.response()
        finally:
            self.gate.leave()

    async def _send_with_retries(self, url: str, payload: bytes, call: ProxyCall) -> tuple[UpstreamResponse, int]:
        """POST until a non-retryable answer or the last attempt; returns (response, retry_count).

        Bounds: each attempt `upstream_timeout_seconds` start to end (extended while the engine
        works on it: `_attempt`), the whole call (attempts, extensions and backoff)
        `upstream_call_deadline_seconds`. An upstream `Retry-After` lengthens the backoff. An
        endpoint that refuses connections trips its breaker (`_check_breaker`).
        Raises UpstreamFailure (502/503/504) when no answer came back.
        """
        assert self.client is not None
        cfg, loop, endpoint = self.config, asyncio.get_running_loop(), call.server.endpoint
        attempts, deadline = cfg.upstream_max_attempts, loop.time() + cfg.upstream_call_deadline_seconds
        for attempt in range(attempts):
            last, barred = attempt == attempts - 1, False
            self._check_breaker(endpoint, loop.time())
            try:
                response = await self._attempt(url, payload, call, deadline)
            except (UpstreamTimeout, TimeoutError) as exc:
                barred = isinstance(exc, _BarredTimeout)
                if last or loop.time() >= deadline:
                    raise UpstreamFailure(
                        504,
                        "Upstream model server timed out",
                        _timeout_cause(
                            exc, attempt + 1, cfg.upstream_timeout_seconds, cfg.upstream_call_deadline_seconds
                        ),
                    ) from exc
                reason = f"timeout ({str(exc) or 'attempt timed out'})"
            except UpstreamTooLarge as exc:  # the same request would get the same answer: not retried
                raise UpstreamFailure(502, "The model server's answer is too large", str(exc)) from exc
            except UpstreamRefused as exc:
                if cfg.upstream_breaker_seconds > 0:
                    self._down_until[endpoint] = loop.time() + cfg.upstream_breaker_seconds
                    raise UpstreamFailure(
                        503,
                        f"Model server {endpoint} is down: it refused the connection",
                        str(exc),
                        retry_after=cfg.upstream_breaker_seconds,
                    ) from exc
                if last:
                    raise UpstreamFailure(502, "Upstream model server request failed", str(exc)) from exc
                reason = f"transport error ({exc})"
            except UpstreamTransportError as exc:
                if last:
                    raise UpstreamFailure(502, "Upstream model server request failed", str(exc)) from exc
                reason = f"transport error ({exc})"
            else:
                retryable = response.status_code in RETRYABLE_STATUS or response.status_code >= 500
                if last or not retryable:
                    return response, attempt
                reason = f"HTTP {response.status_code}"
            delay = backoff_seconds(
                attempt, cfg.upstream_backoff_base_seconds, cfg.upstream_backoff_max_seconds, self._rng
            )
            delay = max(delay, _retry_after_seconds(response) if reason.startswith("HTTP") else 0.0)
            if loop.time() + delay >= deadline:
                if reason.startswith("HTTP"):
                    return response, attempt  # the upstream's own answer beats a 504 of ours
                raise UpstreamFailure(
                    504,
                    "Upstream model server timed out",
                    f"the call deadline (upstream_call_deadline_seconds="
                    f"{cfg.upstream_call_deadline_seconds:g}) leaves no time to retry after {reason}",
                )
            if barred:  # counted where it is sent again, not where it was barred
                self.stats["resent_unknown"] += 1
            logger.warning(
                "Retrying upstream request to %s after %s (attempt %d/%d, sleeping %.2fs)",
                url,
                reason,
                attempt + 1,
                attempts,
                delay,
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _attempt(self, url: str, payload: bytes, call: ProxyCall, deadline: float) -> UpstreamResponse:
        """One attempt: `upstream_timeout_seconds`, extended while the engine works on the call.

        The POST carries a fresh request id. When a window passes with no answer, the engine is
        asked about that id (`REQUEST_STATE_PATH`): queued, running or answered (its answer on the
        way) → wait another window, at most `upstream_timeout_extensions` times, each counted (the
        call's `timeout_extensions`, the gateway's `stats`) — sending it again would queue the same
        generation a second time behind the first (#51: under load that doubled the decode batch).
        Past the cap or the call deadline the engine's copy is aborted (`ABORT_REQUEST_PATH`) and the
        call fails: UpstreamFailure 504, no retry. An engine that does not know the id (never
        arrived, answered long ago, or still in transit: on a loaded host the POST can trail the
        question) is told to abort it all the same — agl_lab's engine bars the id, so a copy
        arriving late never runs beside the resend (`_BarredTimeout`; `resent_unknown` counts the
        resends); an upstream without these routes (vLLM, SGLang abort a request whose client hung
        up) sees its connection closed: both raise UpstreamTimeout, so the caller may retry. A call
        cancelled meanwhile (the agent hung up) asks the engine to abort its copy on the way out.
        """
        assert self.client is not None
        cfg, loop, endpoint = self.config, asyncio.get_running_loop(), call.server.endpoint
        request_id = uuid.uuid4().hex
        sent = asyncio.ensure_future(self.client.post_json(url, payload, request_id))
        try:
            while True:
                window = min(cfg.upstream_timeout_seconds, deadline - loop.time())
                if window > 0:
                    done, _ = await asyncio.wait({sent}, timeout=window)
                    if done:
                        return sent.result()
                answer = await self._ask_engine(endpoint, REQUEST_STATE_PATH, request_id)
                state = answer.get("state") if answer else None
                if state not in WORKING_STATES:
                    timed_out = f"no answer in {cfg.upstream_timeout_seconds:g} s"
                    if answer is None:
                        raise UpstreamTimeout(timed_out)
                    # never arrived, answered long ago, or still in transit: barred before any retry
                    await self._ask_engine(endpoint, ABORT_REQUEST_PATH, request_id)
                    raise _BarredTimeout(f"{timed_out}; the engine reports it {state}, so it is barred there")
                extended = call.annotations.get("timeout_extensions", 0)
                if extended < cfg.upstream_timeout_extensions and deadline - loop.time() > 0:
                    call.annotations["timeout_extensions"] = extended + 1
                    self.stats["timeout_extensions"] += 1
                    logger.warning(
                        "Rollout %s: no answer from %s in %g s, but the engine reports the call %s: waiting "
                        "another window, not sending it again (extension %d of upstream_timeout_extensions=%d)",
                        call.rollout.rollout_id, endpoint, cfg.upstream_timeout_seconds, state, extended + 1,
                        cfg.upstream_timeout_extensions,
                    )  # fmt: skip
                    continue
                aborted = await self._ask_engine(endpoint, ABORT_REQUEST_PATH, request_id)
                self.stats["aborted_past_cap"] += 1
                raise UpstreamFailure(
                    504,
                    "Upstream model server timed out",
                    f"the engine still had the call {state} after {extended} extension(s) of "
                    f"upstream_timeout_seconds={cfg.upstream_timeout_seconds:g} (upstream_timeout_extensions="
                    f"{cfg.upstream_timeout_extensions}, upstream_call_deadline_seconds="
                    f"{cfg.upstream_call_deadline_seconds:g}); its generation was "
                    f"{'aborted' if aborted and aborted.get('aborted') else 'asked to abort'}, not sent again: "
                    "raise those limits or give the engine less work",
                )
        except asyncio.CancelledError:  # the agent hung up (or shutdown): stop the engine's copy too
            if not sent.done():
                abort = asyncio.ensure_future(self._ask_engine(endpoint, ABORT_REQUEST_PATH, request_id))
                self._aborts.add(abort)  # held until done: asyncio keeps only weak references to tasks
                abort.add_done_callback(self._aborts.discard)
            raise
        finally:
            if not sent.done():
                sent.cancel()  # closes the connection (vLLM aborts on that); agl_lab's engine was asked
            sent.add_done_callback(_consume)

    async def _ask_engine(self, endpoint: str, path: str, request_id: str) -> dict[str, Any] | None:
        """agl_lab's engine's JSON answer about `request_id` at `path`; {"state": "no_reply"} when it
        does not answer within ENGINE_ASK_SECONDS; None when the upstream has no such route."""
        assert self.client is not None
        url = endpoint.rstrip("/") + "/" + path
        try:
            async with asyncio.timeout(ENGINE_ASK_SECONDS):
                answer = await self.client.post_json(url, _dumps({"request_id": request_id}))
        except (UpstreamTimeout, TimeoutError):
            return {"state": "no_reply", "aborted": False}
        except (UpstreamTransportError, UpstreamTooLarge):
            return None
        try:
            payload = _loads(answer.content) if answer.status_code == 200 else None
        except ValueError:
            return None
        return payload if isinstance(payload, dict) else None

    def _check_breaker(self, endpoint: str, now: float) -> None:
        """Fail fast (503 + Retry-After) while `endpoint`'s breaker is open; it closes by itself
        after `upstream_breaker_seconds` and the next call probes the endpoint again."""
        until = self._down_until.get(endpoint)
        if until is None:
            return
        if now >= until:
            del self._down_until[endpoint]
            return
        raise UpstreamFailure(
            503,
            f"Model server {endpoint} is down: it refused a connection recently",
            f"failing fast for {until - now:.1f}s more (upstream_breaker_seconds="
            f"{self.config.upstream_breaker_seconds:g}); start or restart the model server",
            retry_after=until - now,
        )

    async def _record_failure(self, call: ProxyCall, failure: UpstreamFailure, latency_ms: float) -> None:
        """The error event of a call the gateway answered itself (no upstream payload)."""
        error = {"error": {"message": failure.detail, "cause": failure.cause, "type": "gateway_error"}}
        await self._record(call, error, failure.status, latency_ms, 0)

    async def _record(
        self, call: ProxyCall, response: Any, http_status: int, latency_ms: float, retry_count: int
    ) -> str | None:
        """`_record_now` off the event loop (`store_call`)."""
        return await store_call(self.store, self._record_now, call, response, http_status, latency_ms, retry_count)

    def _record_now(
        self, call: ProxyCall, response: Any, http_status: int, latency_ms: float, retry_count: int
    ) -> str | None:
        """Append the model_request event (AGL's data dict + rewriter annotations).

        Returns why the call could not be recorded as is (then an error event says so), else None.
        """
        server = call.server
        choices = response.get("choices") if isinstance(response, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        finish_reason = first.get("finish_reason")
        usage = response.get("usage") if isinstance(response, dict) else None
        data = {
            **call.annotations,
            "model": server.model,
            "model_version": server.version,
            "request": call.request,
            "response": response,
            "server": {"model": server.model, "endpoint": server.endpoint, "version": server.version},
            "latency_ms": latency_ms,
            "http_status": http_status,
            "status": "ok" if http_status < 400 else "error",
            "retry_count": retry_count,
            "usage": usage if isinstance(usage, dict) else None,
            "finish_reason": finish_reason if isinstance(finish_reason, str) and finish_reason else None,
        }
        if call.rerouted:
            data["upstream_path"] = call.upstream_path
            data["upstream_request"] = call.request if call.upstream_request is None else call.upstream_request
        try:
            try:
                self.store.append_event(call.rollout.rollout_id, call.attempt_id, "model_request", data)
            except NotStorable as exc:  # e.g. an answer nested too deep: record why, tell the agent
                keep = ("model", "model_version", "server", "latency_ms", "retry_count")
                data = {
                    **{k: data[k] for k in keep},
                    "request": None,
                    "usage": None,
                    "finish_reason": None,
                    "response": {"error": {"message": f"call not recordable: {exc}"}},
                    "http_status": 502,
                    "status": "error",
                }
                self.store.append_event(call.rollout.rollout_id, call.attempt_id, "model_request", data)
                return str(exc)
        except RolloutNotFound:
            logger.warning(
                "Rollout %s was deleted while its model call was in flight: the answer is "
                "returned to the agent but no model_request event is recorded",
                call.rollout.rollout_id,
            )
        return None


_STORE_THREADS = 32  # worker threads the gateway's store calls may hold at once (per event loop)
_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()


async def store_call(store: Store, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, a call into `store`, run in a worker thread when the store may block
    (`Store.BLOCKING`: SQLite, PostgreSQL), so that a slow or unreachable database stalls no
    event loop (no other agent's call, no /healthz) and concurrent calls wait side by side.
    At most `_STORE_THREADS` such calls run at once per loop; the rest queue for a thread."""
    if not store.BLOCKING:
        return fn(*args)
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(_STORE_THREADS)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)


def _parse_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        body = _loads(raw)
    except ValueError:  # orjson.JSONDecodeError and json.JSONDecodeError are ValueErrors
        raise HTTPException(400, "Invalid JSON in request body") from None
    if not isinstance(body, dict):
        raise HTTPException(400, f"Request body must be a JSON object, got {type(body).__name__}")
    return body


def _json_of(response: UpstreamResponse) -> tuple[bytes, Any]:
    """(bytes to return, parsed JSON).

    A successful (2xx) answer that is not a JSON object (HTML, invalid JSON, NaN logprobs)
    raises UpstreamFailure 502 naming the cause; an error answer that is not JSON counts as
    `{}` like AGL.
    """
    problem = None
    if response.content_type.startswith("application/json"):
        try:
            payload = _loads(response.content)
        except ValueError as exc:  # orjson also refuses NaN/Infinity
            problem = f"invalid JSON ({exc})"
        else:
            if response.status_code >= 300 or isinstance(payload, dict):
                return response.content, payload
            problem = f"a JSON {type(payload).__name__}, not an object"
    else:
        problem = f"content-type {response.content_type or 'none'!r}, not application/json"
    if response.status_code < 300:
        snippet = response.content[:200].decode("utf-8", "replace")
        raise UpstreamFailure(
            502,
            "The model server answered with an unusable body",
            f"HTTP {response.status_code} with {problem}: {snippet!r}",
        )
    logger.warning("Upstream answered HTTP %d with %s", response.status_code, problem)
    return b"{}", {}


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a dropped attempt's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _retry_after_seconds(response: UpstreamResponse | None) -> float:
    """The upstream's Retry-After in seconds (0 when absent or an HTTP date)."""
    value = response.retry_after if response is not None else None
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


def _timeout_cause(exc: BaseException, attempts: int, per_attempt: float, deadline: float) -> str:
    return (
        f"{attempts} attempt(s) timed out ({str(exc) or 'no answer in time'}); bounds: "
        f"upstream_timeout_seconds={per_attempt:g} per attempt, upstream_call_deadline_seconds={deadline:g} per call"
    )


async def _cancel_on_disconnect(
    receive: Callable[[], Awaitable[Any]], task: asyncio.Task[Any], hung_up: asyncio.Future[None]
) -> None:
    """Wait for the agent's disconnect, then mark `hung_up` done and cancel `task`. (Recording a
    call's event is synchronous: a hang-up never lands between its answer and its event.)"""
    while (await receive())["type"] != "http.disconnect":
        pass
    hung_up.set_result(None)
    task.cancel()


# ---------------------------------------------------------------------------------------------
# Routes: the proxy (a plain Starlette route) and the management routes (/proxy/...)
# ---------------------------------------------------------------------------------------------


PROXY_PATH = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{upstream_path:path}"


def proxy_route(gateway: Gateway, check_key: Callable[[Request], None]) -> Route:
    """The proxy as a plain Starlette route (POST PROXY_PATH).

    It is the one route on every agent's LLM call, so it skips FastAPI's per-request dependency
    solving and body validation (~0.3 ms of CPU per call on this project's 2-core machine);
    `check_key` applies the same auth as the other routes. It is left out of /openapi.json.
    """

    async def proxy(request: Request) -> Response:
        check_key(request)
        p = request.path_params
        return await gateway.handle(
            request.body, request.receive, p["rollout_id"], p["attempt_id"], p["mode"], p["upstream_path"]
        )

    return Route(PROXY_PATH, proxy, methods=["POST"], include_in_schema=False)


def gateway_router(gateway: Gateway) -> APIRouter:
    """Management routes, mounted under /proxy with auth: pause, resume, state, upstream_stats, config."""
    errors = {
        code: {"description": text}
        for code, text in (
            (401, "missing or wrong key"),
            (413, "body larger than max_body_bytes"),
            (415, "cross-site content type: send application/json"),
            (422, "invalid field"),
            (500, "unexpected error"),
        )
    }
    router = APIRouter(tags=["proxy"], responses=errors)

    @router.post("/pause", response_model=PauseState)
    async def pause(body: PauseRequest | None = None) -> PauseState:
        body = body or PauseRequest()
        return gateway.gate.pause(body.retry_after_seconds, body.reason)

    @router.post("/resume", response_model=PauseState)
    async def resume() -> PauseState:
        return gateway.gate.resume()

    @router.get("/state", response_model=PauseState)
    async def state() -> PauseState:
        return gateway.gate.state()

    @router.get("/upstream_stats")
    async def upstream_stats() -> dict[str, int]:
        """Timed-out attempts extended because the engine was working on them, and calls failed
        past `upstream_timeout_extensions` (their generation aborted), since the server started."""
        return dict(gateway.stats)

    @router.get("/config")
    async def config() -> dict[str, Any]:
        """What the gateway forces on proxied calls: the model name engines must register
        under, the sampling temperatures, logprobs (a Trainer on an external server checks
        them against its engine, agl_lab.execution)."""
        proxy = gateway.config.default_proxy
        return {
            "model_name": proxy.model_name,
            "train_temperature": proxy.train.temperature,
            "val_temperature": proxy.val.temperature,
            "include_log_probs": proxy.include_log_probs,
        }

    return router
