"""Server settings: the AGL `server.yaml` keys plus agl_lab's additions (a leaf of `server/`).

    ServerConfig            host, port, key, store, terminal log, upstream retry policy, modes
      default_proxy         DefaultProxyConfig: model name, logprobs, train/val temperatures
    load_server_config(x)   ServerConfig | dict | OmegaConf -> ServerConfig (errors name the key)

Both the app (`server/app.py`) and the gateway (`server/gateway.py`) read these; keeping
them here, not in the app, is what lets the gateway import them without an import cycle.
Unknown keys are rejected (`extra="forbid"`) so a typo fails at start-up, not silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agl_lab.server.store import DEFAULT_TERMINAL_LOG_LIMIT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainProxyConfig(_Strict):
    temperature: float = 1.0


class ValProxyConfig(_Strict):
    temperature: float = 0.7


class DefaultProxyConfig(_Strict):
    model_name: str = "Qwen/Qwen2.5-7B-Instruct"
    include_log_probs: bool = True
    train: TrainProxyConfig = Field(default_factory=TrainProxyConfig)
    val: ValProxyConfig = Field(default_factory=ValProxyConfig)


class ServerConfig(_Strict):
    """Server settings. `default_proxy.model_name` must equal the model the engine registers."""

    host: str = "127.0.0.1"  # AGL binds 0.0.0.0; loopback is the safe default
    port: int = Field(8080, ge=0, le=65535)
    key: str = ""
    runner_key: str = ""  # a key scoped to what runners do (server/guard.py RUNNER_SCOPE); needs `key`
    default_proxy: DefaultProxyConfig = Field(default_factory=DefaultProxyConfig)
    store: str = "memory"  # or "sqlite:///path/to/store.db", "postgresql://user:pass@host:5432/db" (shared)
    terminal_log_limit: int = Field(DEFAULT_TERMINAL_LOG_LIMIT, ge=1)
    store_timeout_seconds: float = Field(2.0, gt=0)  # PostgreSQL: a store call waits at most this long for a
    #     connection, then answers 503 (nothing stored; retry); keep it well below lease_seconds
    upstream_timeout_seconds: float = Field(300.0, gt=0)  # bounds each upstream attempt, start to end
    upstream_call_deadline_seconds: float = Field(600.0, gt=0)  # bounds a whole call: attempts + backoff
    upstream_max_attempts: int = Field(6, ge=1)
    upstream_backoff_base_seconds: float = Field(0.5, ge=0)  # retry i sleeps min(base*2^i, max)*U(.75,1.25)
    upstream_backoff_max_seconds: float = Field(8.0, ge=0)
    upstream_breaker_seconds: float = Field(5.0, ge=0)  # an endpoint that refused connections fails fast
    #                                                     this long (503 + Retry-After); 0: retry instead
    upstream_key: str = ""  # sent upstream as a Bearer token: the engine's key (AGL_ENGINE_KEY), which
    #                        its OpenAI server requires when bound beyond loopback
    upstream_client: Literal["auto", "raw", "aiohttp", "httpx"] = "auto"  # auto: the raw client (least CPU per call)
    max_body_bytes: int = Field(32 * 2**20, ge=1)  # larger request bodies answer 413 (checked before reading)
    max_header_bytes: int = Field(64 * 2**10, ge=1024)  # a request head (line + headers) beyond this: 431
    header_timeout_seconds: float = Field(30.0, gt=0)  # a request head not complete this long after it began: 408
    body_timeout_seconds: float = Field(60.0, gt=0)  # no body data this long while the app reads it: 408
    max_upstream_answer_bytes: int = Field(32 * 2**20, ge=1)  # a larger model answer is refused (502), not stored
    max_batch_items: int = Field(10_000, ge=1)  # items per POST /api/rollouts or /api/models (413 beyond)
    lease_seconds: float = Field(60.0, ge=0)  # a running rollout without heartbeat/event/status change this
    #     long is re-queued as a new attempt (its runner died); 0 disables leases. Runners renew every
    #     min(10 s, lease/10); well below the trainer's wait (agentlightning.rollout_timeout_seconds + 60 s)
    max_attempts: int = Field(3, ge=1)  # attempts per rollout: a lease expiry re-queues until this many ran,
    #                                     then fails the rollout with the reason (releases count too)
    allowed_hosts: list[str] = Field(default_factory=lambda: ["localhost", "127.0.0.1", "::1"])  # Host names a
    #                      server without a key answers (403 otherwise: DNS rebinding); "*": any; unused with a key
    docs_auth: bool = True  # /docs, /redoc and /openapi.json need the key too (false: open like /healthz)
    token_preserving: bool = False  # flag only; the mode plugs in as a gateway request rewriter
    call_seed: int | None = None  # seed calls that carry none from their position (server/seeding.py)

    @model_validator(mode="after")
    def _runner_key_beside_a_key(self) -> ServerConfig:
        if self.runner_key and not self.key:
            raise ValueError("runner_key needs key (the admin key) set too: without a key, auth is off")
        if self.runner_key and self.runner_key == self.key:
            raise ValueError("runner_key must differ from key: the runner key is the one with less power")
        return self


def load_server_config(config: ServerConfig | Mapping[str, Any] | None) -> ServerConfig:
    """Validate a ServerConfig, a dict or an OmegaConf DictConfig; errors name the key."""
    if config is None:
        raise ValueError("server config is required")
    if isinstance(config, ServerConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"server config must be a ServerConfig or a mapping, got {type(config).__name__}")
    try:
        return ServerConfig.model_validate(_plain(config))
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise ValueError(
            f"invalid server config ({problems}); valid keys: {', '.join(ServerConfig.model_fields)}"
        ) from None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
