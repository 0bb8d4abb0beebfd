"""The FastAPI app: rollout, event and model-registry routes, health, auth — AGL v1's wire API.

    create_app(config) -> FastAPI        config: ServerConfig | Mapping (AGL server.yaml keys)
    ServerConfig, load_server_config                    the settings (agl_lab.server.config)

Routes (upstream-reference §2; paths, JSON shapes, codes and error texts are AGL's):

    GET    /healthz                                         open
    POST   /api/rollouts                  [RolloutCreate]   201 [Rollout]
    GET    /api/rollouts?state_in=..&limit=500              [Rollout] in creation order
    GET    /api/rollouts/terminal?after=0&limit=1000        TerminalPage (completion cursor)
    GET    /api/rollouts/{id}                               {"rollout", "attempts"}
    PATCH  /api/rollouts/{id}             {"status": {..}}  Rollout | 404 | 409 | 422
    DELETE /api/rollouts/{id}                               204 (idempotent)
    POST   /api/rollouts/{id}/attempt/{aid}/events          Event | 404
    GET    /api/rollouts/{id}/events?event_type=&format=triplet
    POST   /api/models                    [Model]           201 echo (upsert)
    DELETE /api/models                                      {"status": "ok"}
    POST   /proxy/rollout/{id}/attempt/{aid}/mode/{train|val}/openai/v1/{path}   (gateway.py;
                                                     a plain Starlette route, not in /openapi.json)
    POST   /proxy/pause | /proxy/resume, GET /proxy/state                       (gateway.py)

Everything but /healthz requires `Authorization: Bearer <key>` or `x-api-key: <key>` when a
key is configured. Handlers are `async` and call the store directly: store calls are short
and lock-protected, and skipping the thread pool keeps the per-call overhead low.

Departures from AGL: a body that is not JSON answers 400 "Invalid JSON in request body" on
every route (FastAPI would say 422); unknown config keys are rejected with the key's name;
`host` defaults to 127.0.0.1; the store can be SQLite (`store: sqlite:///f.db`) and its
terminal log is bounded (`terminal_log_limit`); the upstream retry policy and client are
configurable (`upstream_*`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from agl_lab.protocol import (
    Event,
    EventCreate,
    Model,
    Rollout,
    RolloutCreate,
    RolloutPatch,
    RolloutState,
    RolloutStatusPatch,
    TerminalPage,
)
from agl_lab.records import triplet_events
from agl_lab.server.config import ServerConfig, load_server_config
from agl_lab.server.gateway import Gateway, RequestRewriter, gateway_router, open_upstream_client, proxy_route
from agl_lab.server.seeding import SeededCallsRewriter
from agl_lab.server.store import InvalidTransition, RolloutNotFound, Store, open_store
from agl_lab.server.token_preserving import TokenPreservingRewriter

logger = logging.getLogger("agl_lab.server")

NO_KEY_WARNING = "AGL_KEY not set — authentication disabled. Do not use in production."


# ---------------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------------


class RolloutDetail(BaseModel):
    rollout: Rollout
    attempts: list[str]


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
    store = store if store is not None else open_store(cfg.store, terminal_log_limit=cfg.terminal_log_limit)
    rewriters = list(rewriters)
    if cfg.call_seed is not None:
        rewriters.insert(0, SeededCallsRewriter(cfg.call_seed))  # before any rewriter copies the body
    if cfg.token_preserving and not any(hasattr(r, "set_tokenizer") for r in rewriters):
        rewriters.append(TokenPreservingRewriter())  # tokenizers: EmbeddedServer.set_tokenizer / --tokenizer-path
    gateway = Gateway(cfg, store, rewriters=rewriters)
    if not cfg.key:
        logger.warning(NO_KEY_WARNING)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        gateway.client = open_upstream_client(cfg.upstream_client, cfg.upstream_timeout_seconds)
        try:
            yield
        finally:
            client, gateway.client = gateway.client, None
            await client.aclose()

    app = FastAPI(title="Agent Lightning", version="1.0.0", lifespan=lifespan)
    app.state.config, app.state.store, app.state.gateway = cfg, store, gateway
    _install_error_handlers(app)
    check_key = key_checker(cfg.key)
    auth = [Depends(_auth_dependency(check_key))]
    # the hot path first, as a plain Starlette route: no route scan, no dependency solving
    app.router.routes.append(proxy_route(gateway, check_key))

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.include_router(_rollout_router(store), prefix="/api", dependencies=auth)
    app.include_router(_event_router(store), prefix="/api", dependencies=auth)
    app.include_router(_model_router(store), prefix="/api", dependencies=auth)
    app.include_router(gateway_router(gateway), prefix="/proxy", dependencies=auth)
    return app


def key_checker(key: str) -> Callable[[Request], None]:
    """`check(request)` raises 401 unless `Authorization: Bearer <key>` or `x-api-key: <key>`
    matches; a no-op for an empty key."""
    expected = key.encode()

    def check(request: Request) -> None:
        if not key:
            return
        bearer = request.headers.get("authorization", "")
        if bearer.startswith("Bearer ") and secrets.compare_digest(bearer[7:].encode(), expected):
            return
        api_key = request.headers.get("x-api-key")
        if api_key is not None and secrets.compare_digest(api_key.encode(), expected):
            return
        raise HTTPException(status_code=401, detail="Invalid or missing API key")

    return check


def _auth_dependency(check: Callable[[Request], None]) -> Callable[[Request], Awaitable[None]]:
    async def require_key(request: Request) -> None:
        check(request)

    return require_key


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RolloutNotFound)
    async def not_found(_: Request, exc: RolloutNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(InvalidTransition)
    async def conflict(_: Request, exc: InvalidTransition) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            return JSONResponse({"detail": "Invalid JSON in request body"}, status_code=400)
        return await request_validation_exception_handler(request, exc)


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


def _rollout_router(store: Store) -> APIRouter:
    router = APIRouter(tags=["rollouts"])

    @router.post("/rollouts", status_code=201, response_model=list[Rollout])
    async def create_rollouts(body: list[RolloutCreate]) -> list[Rollout]:
        return store.create_rollouts(body)

    @router.get("/rollouts", response_model=list[Rollout])
    async def list_rollouts(
        state_in: list[RolloutState] = Query(..., description="repeatable: state_in=queuing&state_in=running"),
        limit: int = Query(500, ge=0),
    ) -> list[Rollout]:
        return store.list_rollouts(state_in, limit)

    # declared before /rollouts/{rollout_id} so the literal path wins
    @router.get("/rollouts/terminal", response_model=TerminalPage)
    async def terminal_rollouts(after: int = 0, limit: int = 1000) -> TerminalPage:
        return store.terminal_page(after, limit)

    @router.get("/rollouts/{rollout_id}", response_model=RolloutDetail)
    async def get_rollout(rollout_id: str) -> RolloutDetail:
        rollout = store.get_rollout(rollout_id)
        if rollout is None:
            raise RolloutNotFound(rollout_id)
        return RolloutDetail(rollout=rollout, attempts=store.attempts(rollout_id))

    @router.patch("/rollouts/{rollout_id}", response_model=Rollout)
    async def patch_rollout(rollout_id: str, body: RolloutPatch) -> Rollout:
        return store.patch_status(rollout_id, body.status or RolloutStatusPatch())

    @router.delete("/rollouts/{rollout_id}", status_code=204)
    async def delete_rollout(rollout_id: str) -> Response:
        store.delete_rollout(rollout_id)
        return Response(status_code=204)

    return router


def _event_router(store: Store) -> APIRouter:
    router = APIRouter(tags=["events"])

    @router.post("/rollouts/{rollout_id}/attempt/{attempt_id}/events", response_model=Event)
    async def post_event(rollout_id: str, attempt_id: str, body: EventCreate) -> Event:
        return store.append_event(rollout_id, attempt_id, body.event_type, body.data)

    @router.get("/rollouts/{rollout_id}/events", response_model=list[Event])
    async def query_events(
        rollout_id: str,
        event_type: str | None = None,
        format: str | None = Query(None, description="'triplet' trims events for RL training"),
    ) -> list[Event]:
        events = store.events(rollout_id, event_type=event_type)
        return triplet_events(events) if format == "triplet" else events

    return router


def _model_router(store: Store) -> APIRouter:
    router = APIRouter(tags=["models"])

    @router.post("/models", status_code=201, response_model=list[Model])
    async def register_models(body: list[Model]) -> list[Model]:
        return store.upsert_models(body)

    @router.delete("/models")
    async def clear_models() -> dict[str, str]:
        store.clear_models()
        return {"status": "ok"}

    return router
