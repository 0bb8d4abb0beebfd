"""The FastAPI app: rollout, event and model-registry routes, health, auth — AGL v1's wire API.

    create_app(config) -> FastAPI        config: ServerConfig | Mapping (AGL server.yaml keys)
    ServerConfig, load_server_config                    the settings (agl_lab.server.config)

Routes (Agent Lightning v1's `server/app.py` and `server/routes/*`; paths, JSON shapes, codes and
error texts are AGL's):

    GET    /healthz                                         open
    POST   /api/rollouts                  [RolloutCreate]   201 [Rollout]
    GET    /api/rollouts?state_in=..&limit=500              [Rollout] in creation order
    GET    /api/rollouts/terminal?after=0&limit=1000[&wait_seconds=W]  TerminalPage (completion cursor;
                        agl_lab: with W, a long poll answered at the first state change)
    GET    /api/rollouts/{id}                               {"rollout", "attempts"}
    PATCH  /api/rollouts/{id}[?attempt_id=A]  {"status": {..}}  Rollout | 404 | 409 | 422
    DELETE /api/rollouts/{id}                               204 (idempotent)
    POST   /api/rollouts/claim            {"limit", "runner_id"}  [Rollout] claimed (agl_lab; not in AGL)
    POST   /api/rollouts/release          {"attempts", "reason"}  {"released"}  (agl_lab; not in AGL)
    POST   /api/rollouts/heartbeat        {"rollout_ids"[, "attempt_ids"]}  renew leases (agl_lab; not in AGL)
    POST   /api/rollouts/{id}/attempt/{aid}/events          Event | 404 | 409
    GET    /api/rollouts/{id}/events?event_type=&format=triplet
    POST   /api/models                    [Model]           201 echo (upsert)
    DELETE /api/models                                      {"status": "ok"}
    POST   /proxy/rollout/{id}/attempt/{aid}/mode/{train|val}/openai/v1/{path}   (gateway.py;
                        a plain Starlette route, not in /openapi.json, which AglApp's fast path
                        answers before the middleware stack with the same checks: asgi.py)
    POST   /proxy/pause | /proxy/resume, GET /proxy/state                       (gateway.py)

Everything but /healthz (and the docs with `docs_auth: false`) requires `Authorization:
Bearer <key>` or `x-api-key: <key>` when a key is configured, checked before the body is read
(`agl_lab.server.guard.RequestGuard`, which also bounds body size and refuses cross-site
content types). Agents get a per-rollout token instead (`protocol.rollout_token`): it opens
only their rollout's proxy route and event posts. API handlers run store calls in the thread
pool so a large create or listing never stalls the event loop; the gateway's per-call store
calls and the token check do too for a store that may block (`gateway.store_call`: SQLite,
PostgreSQL; the in-memory store is called inline), so a database outage stalls no loop. Values are checked at write time
(`agl_lab.server.storable`): what is stored reads back, else 422 naming the field.

Claims and attempts (agl_lab): `POST /api/rollouts/claim` hands up to `limit` queued rollouts
to one caller in one request (no list-then-PATCH race: the store moves each to running as a
new attempt in one transaction); AGL clients' list-then-PATCH path works unchanged. A running
rollout whose lease expires is re-queued as the next attempt up to `max_attempts`; `?attempt_id=`
on a PATCH applies it only while that attempt runs (409 otherwise), so a runner that lost its
attempt cannot end the next one.

Departures from AGL: a body that is not JSON answers 400 "Invalid JSON in request body" on
every route (FastAPI would say 422); unknown config keys are rejected with the key's name;
`host` defaults to 127.0.0.1; the store can be SQLite (`store: sqlite:///f.db`) or PostgreSQL
(`store: postgresql://...`, shared by several server processes) and its
terminal log is bounded (`terminal_log_limit`); the upstream retry policy and client are
configurable (`upstream_*`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from agl_lab.protocol import (
    DEFAULT_ATTEMPT_ID,
    ROLLOUT_TOKEN_PREFIX,
    Event,
    EventCreate,
    Model,
    Rollout,
    RolloutCreate,
    RolloutPatch,
    RolloutState,
    RolloutStatusPatch,
    TerminalPage,
    rollout_token,
)
from agl_lab.records import triplet_events
from agl_lab.server.asgi import HEALTH_PATH, AglApp, JsonServerErrors, ProxyFastPath
from agl_lab.server.backends import open_store
from agl_lab.server.config import ServerConfig, load_server_config
from agl_lab.server.gateway import Gateway, RequestRewriter, gateway_router, proxy_route, store_call
from agl_lab.server.guard import DOCS_PATHS, RequestGuard
from agl_lab.server.metrics import (
    CONTENT_TYPE,
    QUEUE_DEPTH_CAP,
    ServerMetrics,
    TimedStore,
    gateway_samples,
    render,
)
from agl_lab.server.seeding import SeededCallsRewriter
from agl_lab.server.storable import INT64_MAX, INT64_MIN, NotStorable, check_storable
from agl_lab.server.store import (
    EventIdReused,
    InvalidTransition,
    RolloutNotFound,
    StaleAttempt,
    Store,
    StoreUnavailable,
)
from agl_lab.server.token_preserving import TokenPreservingRewriter
from agl_lab.server.upstream import open_upstream_client

logger = logging.getLogger("agl_lab.server")

METRICS_PATH = "/metrics"
NO_KEY_WARNING = "AGL_KEY not set — authentication disabled. Do not use in production."
MAX_LIST_LIMIT = 10_000  # listings and terminal pages answer at most this many items per request
MAX_CLAIM_WAIT_SECONDS = 30.0  # longest long poll of POST /api/rollouts/claim
CLAIM_RECHECK_SECONDS = 0.5  # a waiting claim re-checks the queue this often (other server processes)
MAX_TERMINAL_WAIT_SECONDS = 30.0  # longest long poll of GET /api/rollouts/terminal
TERMINAL_RECHECK_SECONDS = 1.0  # a waiting terminal poll re-reads the log this often (other server processes)
EMPTY_TRUST_SECONDS = 2.0  # with LISTEN/NOTIFY: a queue seen empty is taken as empty this long unless notified


# ---------------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------------


class RolloutDetail(BaseModel):
    rollout: Rollout
    attempts: list[str]


class ErrorDetail(BaseModel):
    detail: Any  # a message, or FastAPI's list of validation errors


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error codes a route answers."""
    return {code: {"model": ErrorDetail, "description": ERROR_TEXTS[code]} for code in codes}


ERROR_TEXTS = {
    400: "body is not valid JSON",
    401: "missing or wrong key (checked before the body is read)",
    403: "a server without a key: the Host header names a host outside allowed_hosts",
    404: "no such rollout",
    409: "transition not allowed from the rollout's state, the attempt named is not running, or an event id "
    "already stored with other content",
    413: "body larger than max_body_bytes, or more items than max_batch_items",
    415: "body sent as text/plain or a form (cross-site content types): send application/json",
    422: "invalid field, or a value the store could not read back (named in detail)",
    503: "the store could not write (SQLite busy, PostgreSQL unreachable): nothing was stored, retry",
    507: "the SQLite store's disk is full: nothing was stored",
    500: "unexpected server error (JSON; the connection stays usable)",
}
COMMON_ERRORS = (401, 403, 413, 415, 500, 503, 507)


class HeartbeatRequest(BaseModel):
    rollout_ids: list[str]
    attempt_ids: list[str] | None = None  # parallel to rollout_ids: alive only while it runs that attempt


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limit: int = Field(1, ge=1, description="most rollouts to claim (the server hands at most max_batch_items)")
    runner_id: str = Field("", max_length=200, description="names the caller in the server log")
    wait_seconds: float = Field(
        0.0, ge=0, le=MAX_CLAIM_WAIT_SECONDS, description="with none queued, wait this long for one (long poll)"
    )


class ChangeSignal:
    """Wakes long polls: each waiter holds the generation it took before its look at the store,
    and `notify` sets that generation. Used on the event loop only."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()  # every waiter holds this generation's event and wakes
        self._event = asyncio.Event()

    def generation(self) -> asyncio.Event:
        """Take this before looking at the store: a notify after the look sets it."""
        return self._event

    @staticmethod
    async def wait(generation: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(generation.wait(), seconds)


class QueueSignal(ChangeSignal):
    """Wakes waiting claims when rollouts are queued (created, re-queued or released) in this
    server, and (PostgreSQL: `PostgresStore.listen_queued`, LISTEN/NOTIFY) through any other server
    of the store. The waiters also re-check every CLAIM_RECHECK_SECONDS (a notification lost while
    the database was away). Used on the event loop only.

    Idle claims cheap: where every queueing is announced after its commit (`reliable`: the
    PostgreSQL listener runs), a claim that found the queue empty marks it (`mark_empty`), and
    claims that arrive before the next notification, within EMPTY_TRUST_SECONDS, skip the database
    (`known_empty`) and just wait: hundreds of idle runners cost a few queries a second, not one
    transaction per poll each."""

    def __init__(self) -> None:
        super().__init__()
        self.reliable = False  # set by the app when the store's listener announces every queueing
        self._empty: tuple[asyncio.Event, float] | None = None  # (generation, loop time) seen empty
        self.skipped = 0  # claims answered without a store call (known empty)

    def mark_empty(self, generation: asyncio.Event, now: float) -> None:
        """A claim taken at `generation` found nothing: the queue is empty until the next notify."""
        if self.reliable and generation is self._event:
            self._empty = (generation, now)

    def known_empty(self, now: float) -> bool:
        empty = self._empty
        return empty is not None and empty[0] is self._event and now - empty[1] < EMPTY_TRUST_SECONDS


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempts: dict[str, str] = Field(description="rollout id -> the attempt the caller runs")
    reason: str = Field("runner stopped", max_length=2000)


class ReleaseAnswer(BaseModel):
    released: list[str]  # back to queuing; the others were not running that attempt


class HeartbeatAnswer(BaseModel):
    not_running: list[str]  # unknown, queuing or terminal: the runner should stop their agents
    lease_seconds: float  # renew well within this (0: leases are off)


async def _expire_leases_forever(
    store: Store, lease_seconds: float, max_attempts: int, queued: QueueSignal, changed: ChangeSignal
) -> None:
    """Re-queue (after max_attempts: fail) running rollouts whose lease ran out, every min(5 s, lease/4)."""
    while True:
        try:
            expired = await run_in_threadpool(store.expire_leases, lease_seconds, max_attempts)
            if "requeued" in expired.values():
                queued.notify()
            if expired:
                changed.notify()
            for outcome in ("requeued", "failed"):
                ids = [rid for rid, what in expired.items() if what == outcome]
                if ids:
                    logger.warning(
                        "Lease expired: %s %d running rollout(s) (max_attempts=%d): %s",
                        outcome,
                        len(ids),
                        max_attempts,
                        ids[:10],
                    )
        except Exception:  # never let the sweeper die silently
            logger.exception("Lease sweep failed")
        await asyncio.sleep(min(5.0, lease_seconds / 4))


def create_app(
    config: ServerConfig | Mapping[str, Any] | None,
    *,
    store: Store | None = None,
    rewriters: Sequence[RequestRewriter] = (),
) -> FastAPI:
    """Build the server. `store` defaults to `open_store(config.store)`; `rewriters` are the
    gateway's request rewriters (see `agl_lab.server.gateway.RequestRewriter`); with
    `token_preserving: true` and none given, the token-preserving rewriter is installed.

    The app exposes `app.state.config`, `app.state.store` and `app.state.gateway`.
    """
    cfg = load_server_config(config)
    store = (
        store
        if store is not None
        else open_store(cfg.store, terminal_log_limit=cfg.terminal_log_limit, timeout_seconds=cfg.store_timeout_seconds)
    )
    rewriters = list(rewriters)
    if cfg.call_seed is not None:
        rewriters.insert(0, SeededCallsRewriter(cfg.call_seed))  # before any rewriter copies the body
    if cfg.token_preserving and not any(hasattr(r, "set_tokenizer") for r in rewriters):
        rewriters.append(TokenPreservingRewriter())  # tokenizers: EmbeddedServer.set_tokenizer / --tokenizer-path
    _warn_on_clock_skew(store, cfg.lease_seconds)
    metrics, raw_store = ServerMetrics(), store
    store = TimedStore(store, metrics)  # type: ignore[assignment]  # GET /metrics: store latency, claims, expiries
    gateway = Gateway(cfg, store, rewriters=rewriters)
    queued, changed = QueueSignal(), ChangeSignal()  # changed: a rollout was claimed, patched, expired or released
    if not cfg.key:
        logger.warning(NO_KEY_WARNING)

    app = AglApp(title="Agent Lightning", version="1.0.0", lifespan=_lifespan(cfg, store, gateway, queued, changed))
    app.state.config, app.state.store, app.state.gateway = cfg, raw_store, gateway
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(JsonServerErrors)
    _install_guard(app, cfg, store, gateway)
    _add_health_routes(app, store, gateway, metrics)
    app.include_router(_rollout_router(store, cfg.max_batch_items, cfg.lease_seconds, queued, changed), prefix="/api")
    app.include_router(_event_router(store), prefix="/api")
    app.include_router(_model_router(store, cfg.max_batch_items), prefix="/api")
    app.include_router(gateway_router(gateway), prefix="/proxy")
    return app


def _lifespan(cfg: ServerConfig, store: Store, gateway: Gateway, queued: QueueSignal, changed: ChangeSignal) -> Any:
    """What runs while the app serves: the upstream client, the lease sweeper and (PostgreSQL)
    the listener for rollouts queued through other servers; each stopped when the app stops."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gateway.client = open_upstream_client(
            cfg.upstream_client, cfg.upstream_timeout_seconds, cfg.max_upstream_answer_bytes, cfg.upstream_key
        )
        sweeper = (
            asyncio.ensure_future(_expire_leases_forever(store, cfg.lease_seconds, cfg.max_attempts, queued, changed))
            if cfg.lease_seconds
            else None
        )
        listen = getattr(store, "listen_queued", None)  # PostgreSQL: rollouts queued through other servers
        loop = asyncio.get_running_loop()
        stop_listening = listen(lambda: loop.call_soon_threadsafe(queued.notify)) if listen is not None else None
        queued.reliable = stop_listening is not None
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            if stop_listening is not None:
                await run_in_threadpool(stop_listening)
            client, gateway.client = gateway.client, None
            await client.aclose()

    return lifespan


def _install_guard(app: AglApp, cfg: ServerConfig, store: Store, gateway: Gateway) -> None:
    """Auth and limits (server/guard.py) before any body is read, on the middleware stack and on
    the proxy's fast path alike."""
    open_paths = (HEALTH_PATH,) if cfg.docs_auth else (HEALTH_PATH, *DOCS_PATHS)
    guard = {
        "key": cfg.key,
        "max_body_bytes": cfg.max_body_bytes,
        "open_paths": open_paths,
        "token_check": rollout_token_checker(cfg.key, store, cfg.runner_key),
        "allowed_hosts": tuple(cfg.allowed_hosts),
        "runner_key": cfg.runner_key,
    }
    app.add_middleware(RequestGuard, **guard)  # auth lives here, before the body is read
    # the hot path as a plain Starlette route (no dependency solving), which AglApp's fast path
    # answers before the middleware stack with the same checks (agl_lab.server.asgi)
    route = proxy_route(gateway, _no_check)
    app.router.routes.append(route)
    app.proxy_fast_path = ProxyFastPath(gateway, RequestGuard(None, **guard), route, app.exception_handlers)


def _add_health_routes(app: AglApp, store: Store, gateway: Gateway, metrics: ServerMetrics) -> None:
    """`GET /healthz` and `GET /metrics`."""

    @app.get(HEALTH_PATH, tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness. Served by agl_lab's uvicorn protocol (asgi.HTTP_PROTOCOL) without reaching
        this route; other ASGI servers (and test clients) reach it."""
        return {"status": "ok"}

    @app.get(METRICS_PATH, include_in_schema=False)
    async def prometheus() -> Response:
        """The Prometheus text format (agl_lab/server/metrics.py; needs a key like any route)."""
        samples = [*metrics.samples(), ("agl_inflight_calls", {}, float(gateway.gate.inflight))]
        samples += gateway_samples(gateway.stats)
        try:
            queuing = await run_in_threadpool(store.list_rollouts, ["queuing"], QUEUE_DEPTH_CAP)
            samples.append(("agl_queue_depth", {}, float(len(queuing))))
        except Exception as exc:  # the store is down: the counters still answer (the error is counted)
            logger.warning("GET /metrics: queue depth unavailable: %r", exc)
        return Response(render(samples), media_type=CONTENT_TYPE)


CLOCK_SKEW_WARN_FRACTION = 0.1  # warn at start when this host's clock is off the database's by this much of a lease


def _warn_on_clock_skew(store: Store, lease_seconds: float) -> None:
    """Warn when this host's clock differs from a shared store's (PostgreSQL) by more than a tenth of
    the lease. Leases are stamped and swept on the database's clock, so they stay right; the warning
    is for what this host's clock still stamps (its logs, its runners' view of time)."""
    skew = getattr(store, "clock_skew_seconds", None)
    if skew is not None and lease_seconds and abs(skew) > CLOCK_SKEW_WARN_FRACTION * lease_seconds:
        logger.warning(
            "this host's clock is %.1f s %s the database's (more than %g of lease_seconds=%g): leases use the "
            "database's clock, so they are unaffected, but sync this host's clock (NTP: chrony or "
            "systemd-timesyncd)",
            abs(skew),
            "behind" if skew > 0 else "ahead of",
            CLOCK_SKEW_WARN_FRACTION,
            lease_seconds,
        )


def _no_check(_: Request) -> None:
    """The proxy route's own check: none, RequestGuard authorised the request already."""


def rollout_token_checker(key: str, store: Store, runner_key: str = "") -> Callable[[str, str, str], Awaitable[bool]]:
    """`check(token, method, path)`: a per-rollout token (`rollout_token`) opens only POSTs to
    its rollout's proxy route and event route, and only for the rollout's live attempt: the
    rollout exists with the `created_at` the token was made for (not a re-created one), is
    running (or queuing and never claimed), the path names its live attempt (`last_attempt_id`,
    default "0") and the token was made for that attempt: an agent of a re-queued or released
    attempt is refused. Tokens made from the runner key (a runner holding only that) count too."""
    keys = (key, runner_key) if runner_key else (key,)

    async def check(token: str, method: str, path: str) -> bool:
        if method != "POST" or not token.startswith(ROLLOUT_TOKEN_PREFIX):
            return False
        rollout_id = token[len(ROLLOUT_TOKEN_PREFIX) :].rpartition(".")[0]
        parts = path.split("/")  # "", "proxy"|"api", "rollout"|"rollouts", id, "attempt", aid, ...
        if not rollout_id or len(parts) < 7 or parts[3] != rollout_id or parts[4] != "attempt":
            return False
        proxy = parts[1] == "proxy" and parts[2] == "rollout"
        if not proxy and not (
            parts[1] == "api" and parts[2] == "rollouts" and len(parts) == 7 and parts[6] == "events"
        ):
            return False
        rollout = await store_call(store, store.get_rollout, rollout_id)  # off the loop (a database read)
        if rollout is None:
            return False
        attempt_id, status = unquote(parts[5]), rollout.status
        # Critical: a re-queued rollout (queuing, last_attempt_id set) opens to no attempt: its old
        # attempt's agent may still run; a never-claimed one opens to attempt "0" (AGL's order:
        # spawn the agent, then PATCH running)
        fresh = status.state == RolloutState.QUEUING and status.last_attempt_id is None
        if not (status.state == RolloutState.RUNNING or fresh):
            return False
        if attempt_id != (status.last_attempt_id or DEFAULT_ATTEMPT_ID):
            return False
        made = [rollout_token(k, rollout_id, rollout.status.created_at, attempt_id).encode() for k in keys]
        return any(secrets.compare_digest(token.encode(), expected) for expected in made)

    return check


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RolloutNotFound)
    async def not_found(_: Request, exc: RolloutNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(InvalidTransition)
    @app.exception_handler(StaleAttempt)
    @app.exception_handler(EventIdReused)
    async def conflict(_: Request, exc: InvalidTransition | StaleAttempt | EventIdReused) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(NotStorable)
    async def not_storable(_: Request, exc: NotStorable) -> JSONResponse:
        return JSONResponse({"detail": f"{exc} — nothing was stored"}, status_code=422)

    @app.exception_handler(sqlite3.OperationalError)
    async def store_refused(_: Request, exc: sqlite3.OperationalError) -> JSONResponse:
        # the SQLite store rolled the write back (store._transaction): what reads back is the file
        full = "full" in str(exc)
        hint = "free disk space on the store's filesystem and retry" if full else "retry"
        return JSONResponse(
            {"detail": f"store refused the write ({exc}) — nothing was stored; {hint}"},
            status_code=507 if full else 503,
        )

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        # the PostgreSQL store lost its database (store.postgresql._ConnectionSession): the transaction rolled back
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            return JSONResponse({"detail": "Invalid JSON in request body"}, status_code=400)
        try:
            return await request_validation_exception_handler(request, exc)
        except ValueError:  # the echoed input holds NaN/Infinity or a lone surrogate
            errors = [{k: v for k, v in err.items() if k in ("type", "loc", "msg")} for err in exc.errors()]
            return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


_CREATES, _ROLLOUTS = TypeAdapter(list[RolloutCreate]), TypeAdapter(list[Rollout])


def _parse_json(adapter: TypeAdapter[Any], raw: bytes) -> Any:
    """Parse (stdlib json, as FastAPI: lone surrogates and NaN reach the storable check, which
    names the field) and validate a JSON body; errors become FastAPI's 400/422 answers."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {}}]
        ) from None
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _check_batch(items: Sequence[Any], limit: int) -> None:
    if len(items) > limit:
        raise HTTPException(
            413,
            f"{len(items)} items in one request; at most {limit} (server setting "
            "max_batch_items): send them in several requests",
        )


# Store calls run in the thread pool (`run_in_threadpool`): a large create or listing must not
# stall /healthz and the gateway, which share the event loop. The store's lock serialises them.


def _rollout_router(
    store: Store, max_batch_items: int, lease_seconds: float, queued: QueueSignal, changed: ChangeSignal
) -> APIRouter:
    """The rollout routes: agl_lab's runner routes, then AGL v1's (in this order: the literal
    paths before `/rollouts/{rollout_id}`)."""
    router = APIRouter(tags=["rollouts"], responses=_errors(*COMMON_ERRORS))
    _add_runner_routes(router, store, max_batch_items, lease_seconds, queued, changed)
    _add_agl_rollout_routes(router, store, max_batch_items, queued, changed)
    return router


def _add_runner_routes(
    router: APIRouter,
    store: Store,
    max_batch_items: int,
    lease_seconds: float,
    queued: QueueSignal,
    changed: ChangeSignal,
) -> None:
    """What runners call (agl_lab; AGL v1 has none of these): heartbeat, claim, release."""

    @router.post("/rollouts/heartbeat", response_model=HeartbeatAnswer, responses=_errors(400, 422))
    async def heartbeat(body: HeartbeatRequest) -> HeartbeatAnswer:
        """Renew the leases of running rollouts (agl_lab; AGL has no leases)."""
        _check_batch(body.rollout_ids, max_batch_items)
        if body.attempt_ids is not None and len(body.attempt_ids) != len(body.rollout_ids):
            raise HTTPException(
                422,
                f"attempt_ids has {len(body.attempt_ids)} items for {len(body.rollout_ids)} "
                "rollout_ids: send one attempt id per rollout id, or none",
            )
        not_running = await run_in_threadpool(store.heartbeat, body.rollout_ids, body.attempt_ids)
        return HeartbeatAnswer(not_running=not_running, lease_seconds=lease_seconds)

    @router.post("/rollouts/claim", response_model=list[Rollout], responses=_errors(400, 422))
    async def claim_rollouts(body: ClaimRequest) -> Response:
        """Claim up to `limit` queued rollouts, oldest first, each for this caller only (agl_lab).

        Each comes back `running` with a new `last_attempt_id`; an empty list when none is
        queued after `wait_seconds` (a long poll: idle runners cost the server one request per
        wait, not one per poll interval). One request replaces a listing plus one PATCH per
        rollout, and two callers never get the same rollout (no 409s to retry)."""
        limit = min(body.limit, max_batch_items)  # "up to": a claim may get fewer, never a 413
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.wait_seconds
        while True:
            generation = queued.generation()  # Critical: before the look, or a create in between is missed
            if queued.known_empty(loop.time()):
                claimed, queued.skipped = [], queued.skipped + 1
            else:
                claimed = await run_in_threadpool(store.claim_rollouts, limit, body.runner_id)
                if not claimed:
                    queued.mark_empty(generation, loop.time())
            if claimed:
                changed.notify()  # waiting terminal polls answer: these rollouts now run
            left = deadline - loop.time()
            if claimed or left <= 0:
                return Response(_ROLLOUTS.dump_json(claimed), media_type="application/json")
            await queued.wait(generation, min(left, CLAIM_RECHECK_SECONDS))

    @router.post("/rollouts/release", response_model=ReleaseAnswer, responses=_errors(400, 422))
    async def release_rollouts(body: ReleaseRequest) -> ReleaseAnswer:
        """Give running attempts back to the queue (a runner stopping cleanly; agl_lab)."""
        _check_batch(list(body.attempts), max_batch_items)
        released = await run_in_threadpool(store.release_rollouts, body.attempts, body.reason)
        if released:
            queued.notify()
            changed.notify()
        return ReleaseAnswer(released=released)


def _add_agl_rollout_routes(
    router: APIRouter, store: Store, max_batch_items: int, queued: QueueSignal, changed: ChangeSignal
) -> None:
    """AGL v1's rollout routes: create (a batch), list, the terminal log, get, patch, delete."""

    @router.post(
        "/rollouts",
        status_code=201,
        response_model=list[Rollout],
        responses=_errors(400, 422),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"type": "array", "items": {"$ref": "#/components/schemas/RolloutCreate"}}
                    }
                },
            }
        },
    )
    async def create_rollouts(request: Request) -> Response:
        """Parsing, storing and encoding all run in the thread pool: a batch of 10,000 is
        ~0.1-1 s of CPU that must not stall /healthz and the gateway."""
        raw = await request.body()

        def create() -> bytes:
            creates = _parse_json(_CREATES, raw)
            _check_batch(creates, max_batch_items)
            return _ROLLOUTS.dump_json(store.create_rollouts(creates))

        answer = await run_in_threadpool(create)
        queued.notify()  # waiting claims look again
        return Response(answer, status_code=201, media_type="application/json")

    @router.get("/rollouts", response_model=list[Rollout], responses=_errors(422))
    async def list_rollouts(
        state_in: list[RolloutState] = Query(..., description="repeatable: state_in=queuing&state_in=running"),
        limit: int = Query(500, ge=0, le=INT64_MAX, description=f"answers at most {MAX_LIST_LIMIT}"),
    ) -> Response:
        def listing() -> bytes:
            return _ROLLOUTS.dump_json(store.list_rollouts(state_in, min(limit, MAX_LIST_LIMIT)))

        return Response(await run_in_threadpool(listing), media_type="application/json")

    _add_terminal_route(router, store, changed)  # before /rollouts/{rollout_id}: the literal path wins

    @router.get("/rollouts/{rollout_id}", response_model=RolloutDetail, responses=_errors(404))
    async def get_rollout(rollout_id: str) -> RolloutDetail:
        def detail() -> RolloutDetail:
            rollout = store.get_rollout(rollout_id)
            if rollout is None:
                raise RolloutNotFound(rollout_id)
            return RolloutDetail(rollout=rollout, attempts=store.attempts(rollout_id))

        return await run_in_threadpool(detail)

    @router.patch("/rollouts/{rollout_id}", response_model=Rollout, responses=_errors(400, 404, 409, 422))
    async def patch_rollout(
        rollout_id: str,
        body: RolloutPatch,
        attempt_id: str | None = Query(None, description="agl_lab: apply only while this attempt runs (409 else)"),
    ) -> Rollout:
        rollout = await run_in_threadpool(
            lambda: store.patch_status(rollout_id, body.status or RolloutStatusPatch(), attempt_id=attempt_id)
        )
        changed.notify()  # waiting terminal polls answer
        return rollout

    @router.delete("/rollouts/{rollout_id}", status_code=204)
    async def delete_rollout(rollout_id: str) -> Response:
        await run_in_threadpool(store.delete_rollout, rollout_id)
        return Response(status_code=204)


def _add_terminal_route(router: APIRouter, store: Store, changed: ChangeSignal) -> None:
    """`GET /rollouts/terminal`: AGL's completion cursor, with agl_lab's long poll."""

    @router.get("/rollouts/terminal", response_model=TerminalPage, responses=_errors(422))
    async def terminal_rollouts(
        after: int = Query(0, ge=INT64_MIN, le=INT64_MAX),
        limit: int = Query(1000, ge=INT64_MIN, le=INT64_MAX, description=f"answers at most {MAX_LIST_LIMIT}"),
        wait_seconds: float = Query(
            0.0,
            ge=0,
            le=MAX_TERMINAL_WAIT_SECONDS,
            description="agl_lab: with no entry after `after`, wait this long for a rollout state change (long poll)",
        ),
    ) -> TerminalPage:
        """The terminal log from cursor `after`. With `wait_seconds` (agl_lab; AGL sends none and
        gets the answer at once) an empty page is held until a rollout is claimed, patched,
        released or expired here, a new entry shows on a re-read (other server processes), or
        the wait ends: the trainer's completion check costs one request per change, not one per
        poll interval. Answered early on any change, so a caller tracking `running` can look."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        while True:
            generation = changed.generation()  # Critical: before the look, or a change in between is missed
            page = await run_in_threadpool(store.terminal_page, after, min(limit, MAX_LIST_LIMIT))
            left = deadline - loop.time()
            if page.items or page.next_after > max(after, 0) or left <= 0:
                return page
            await changed.wait(generation, min(left, TERMINAL_RECHECK_SECONDS))
            if generation.is_set():
                return await run_in_threadpool(store.terminal_page, after, min(limit, MAX_LIST_LIMIT))


def _event_router(store: Store) -> APIRouter:
    router = APIRouter(tags=["events"], responses=_errors(*COMMON_ERRORS))

    @router.post(
        "/rollouts/{rollout_id}/attempt/{attempt_id}/events",
        response_model=Event,
        responses=_errors(400, 404, 409, 422),
    )
    async def post_event(rollout_id: str, attempt_id: str, body: EventCreate) -> Event:
        # strict (NaN, int64) on the API; the gateway's bodies are orjson's; NUL may stand in event data
        check_storable(body.data, "data", nul_ok=True)
        return await run_in_threadpool(
            functools.partial(store.append_event, event_id=body.event_id),
            rollout_id,
            attempt_id,
            body.event_type,
            body.data,
        )  # a repeated event_id stores nothing (a client's resend); with other content: 409 naming the id

    @router.get("/rollouts/{rollout_id}/events", response_model=list[Event], responses=_errors(404))
    async def query_events(
        rollout_id: str,
        event_type: str | None = None,
        format: str | None = Query(None, description="'triplet' trims events for RL training"),
    ) -> list[Event]:
        def query() -> list[Event]:
            events = store.events(rollout_id, event_type=event_type)
            return triplet_events(events) if format == "triplet" else events

        return await run_in_threadpool(query)

    return router


def _model_router(store: Store, max_batch_items: int) -> APIRouter:
    router = APIRouter(tags=["models"], responses=_errors(*COMMON_ERRORS))

    @router.post("/models", status_code=201, response_model=list[Model], responses=_errors(400, 422))
    async def register_models(body: list[Model]) -> list[Model]:
        _check_batch(body, max_batch_items)
        return await run_in_threadpool(store.upsert_models, body)

    @router.delete("/models")
    async def clear_models(model: str | None = None) -> dict[str, str]:
        """Forget the registered endpoints of `?model=NAME` (a trainer's own, on a shared store),
        or of every model without it (AGL's behaviour)."""
        await run_in_threadpool(store.clear_models, model)
        return {"status": "ok"}

    return router
