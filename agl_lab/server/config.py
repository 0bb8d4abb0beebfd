"""Server settings: the AGL `server.yaml` keys plus agl_lab's additions (a leaf of `server/`).

    ServerConfig            host, port, key, store, terminal log, upstream retry policy, modes
      LIMITS                its limits, each with its `agl-lab serve` flag and help: the one list
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
from pydantic.fields import FieldInfo

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


def _limit(default: Any, flag: str, text: str, **bounds: Any) -> Any:
    """A limit of the server: a field with its `agl-lab serve` flag and help text (see LIMITS)."""
    return Field(default, description=text, json_schema_extra={"flag": flag}, **bounds)


class ServerConfig(_Strict):
    """Server settings. `default_proxy.model_name` must equal the model the engine registers."""

    host: str = "127.0.0.1"  # AGL binds 0.0.0.0; loopback is the safe default
    port: int = Field(8080, ge=0, le=65535)
    key: str = ""
    runner_key: str = ""  # a key scoped to what runners do (server/guard.py RUNNER_SCOPE); needs `key`
    default_proxy: DefaultProxyConfig = Field(default_factory=DefaultProxyConfig)
    store: str = "memory"  # or "sqlite:///path/to/store.db", "postgresql://user:pass@host:5432/db" (shared)
    # The limits: each is an `agl-lab serve` flag and an `agl_lab.server.<key>` of a training config
    # (LIMITS below); `text` is the flag's help, which ends with the default.
    terminal_log_limit: int = _limit(
        DEFAULT_TERMINAL_LOG_LIMIT, "--terminal-log-limit", "terminal rollouts kept for the managers' polls", ge=1
    )
    store_timeout_seconds: float = _limit(  # keep it well below lease_seconds
        2.0, "--store-timeout", "a store call waits this long for a PostgreSQL connection, then answers 503", gt=0
    )
    # Sized for a loaded CPU (docs/robustness.md, #51): an attempt the engine reports queued or running
    # waits another window instead of being sent again, so a busy engine gets up to 300 s × (1 + 3).
    upstream_timeout_seconds: float = _limit(300.0, "--upstream-timeout", "bound on each upstream attempt", gt=0)
    upstream_timeout_extensions: int = _limit(
        3,
        "--upstream-timeout-extensions",
        "times a timed-out attempt waits another --upstream-timeout while the engine reports the call queued "
        "or running (never sent twice meanwhile); past it the engine's copy is aborted and the call fails; 0: off",
        ge=0,
    )
    upstream_call_deadline_seconds: float = _limit(
        1200.0, "--upstream-call-deadline", "bound on a whole call, retries and extensions included", gt=0
    )
    upstream_max_attempts: int = _limit(
        6, "--upstream-max-attempts", "tries per call on timeouts, 408/409/429/5xx", ge=1
    )
    # retry i sleeps min(base*2^i, max)*U(.75,1.25)
    upstream_backoff_base_seconds: float = _limit(0.5, "--upstream-backoff-base", "first retry's backoff", ge=0)
    upstream_backoff_max_seconds: float = _limit(8.0, "--upstream-backoff-max", "longest backoff", ge=0)
    upstream_breaker_seconds: float = _limit(  # 503 + Retry-After meanwhile
        5.0,
        "--upstream-breaker-seconds",
        "fail fast this long after the model server refused a connection; 0: retry",
        ge=0,
    )
    upstream_key: str = ""  # sent upstream as a Bearer token: the engine's key (AGL_ENGINE_KEY), which
    #                        its OpenAI server requires when bound beyond loopback
    upstream_client: Literal["auto", "raw", "aiohttp", "httpx"] = "auto"  # auto: the raw client (least CPU per call)
    max_body_bytes: int = _limit(  # checked before reading
        32 * 2**20, "--max-body-bytes", "larger request bodies answer 413", ge=1
    )
    max_header_bytes: int = _limit(64 * 2**10, "--max-header-bytes", "a larger request head answers 431", ge=1024)
    header_timeout_seconds: float = _limit(  # counted from the head's first byte; 408
        30.0, "--header-timeout", "a request head must arrive within this", gt=0
    )
    body_timeout_seconds: float = _limit(  # while the app reads it; 408
        60.0, "--body-timeout", "longest pause within a request body", gt=0
    )
    max_upstream_answer_bytes: int = _limit(  # refused, not stored
        32 * 2**20, "--max-upstream-answer-bytes", "a larger model answer is refused with 502", ge=1
    )
    max_batch_items: int = _limit(10_000, "--max-batch-items", "items per POST of rollouts or models, 413 beyond", ge=1)
    # Runners renew every min(10 s, lease/10); keep it well below the trainer's wait
    # (agentlightning.rollout_timeout_seconds + 60 s)
    lease_seconds: float = _limit(
        60.0,
        "--lease-seconds",
        "re-queue a running rollout (as a new attempt: its runner died) with no heartbeat, event or "
        "status change this long; 0: off",
        ge=0,
    )
    max_attempts: int = _limit(  # releases count too
        3, "--max-attempts", "attempts per rollout before an expired lease fails it, with the reason", ge=1
    )
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


# The server's limits, listed once (the fields made by `_limit`): `agl-lab serve`'s flags
# (server/embedded.py) and the `agl_lab.server` keys of a training config (config.py) derive from it.
LIMITS: dict[str, FieldInfo] = {
    key: field
    for key, field in ServerConfig.model_fields.items()
    if isinstance(field.json_schema_extra, dict) and "flag" in field.json_schema_extra
}


def limit_help(key: str) -> str:
    """The help of limit `key`'s flag: its text, then its default (sizes in KiB/MiB)."""
    field = LIMITS[key]
    default = field.default
    if key.endswith("_bytes") and default % 2**20 == 0:
        shown = f"{default // 2**20} MiB"
    elif key.endswith("_bytes") and default % 2**10 == 0:
        shown = f"{default // 2**10} KiB"
    else:
        shown = f"{default:g}"
    return f"{field.description} (default {shown})"


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
