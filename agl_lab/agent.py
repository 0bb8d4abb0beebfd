"""The agent-facing API: what an agent author writes against, and what the runner hands it.

Two kinds of agents
    callable     `agent(task, ctx) -> float | None`, run in a thread of the runner's process.
                 `task` is the rollout's input; `ctx` (`AgentContext`) carries the gateway
                 base URL of this rollout, the event URL and key, `emit()` and
                 `openai_client()`. A returned number is posted as the `reward` event
                 `{"value": r}` before the rollout is marked succeeded; an `async def` agent
                 is awaited.
    class name   `"module:Class"` / `"module.Class"` (the runner's `agent`, else the
                 rollout's `config.local.agent_class`), run as an AGL agent in a subprocess
                 of its own session with `AGL_OPENAI_BASE_URL`, `AGL_EVENT_URL`, `AGL_KEY`
                 and the rollout's `config.local.env_map` in its environment (`agent_env`;
                 the subprocess side is `agl_lab._agent_bootstrap`).

    load_agent("my_agents:solve")   the callable `agl_lab.agent=...` names (a class: its spec)
    agl_agent_class_spec(cls)       "module:Qualname" of an AGL agent class
    agent_urls(server, rid, ...)    (openai_base_url, event_url) of one rollout, as AGL v1
    agent_env(rollout, server, key) the AGL_* variables of one rollout plus its env_map
    shared_openai_client(url, key)  an `openai.OpenAI` on one rollout's URL over the process's pool

Everything here is pure but `AgentContext.emit` / `openai_client` (HTTP to the server), and
light to import: no server stack, no numpy (`tests/test_runner_cli.py` checks the runner's).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from agl_lab.client import AglClient
from agl_lab.protocol import DEFAULT_ATTEMPT_ID, Rollout, rollout_token

AgentFn = Callable[[Any, "AgentContext"], float | None]
AgentSpec = AgentFn | str | None


# ---------------------------------------------------------------------------------------------
# Naming and loading an agent; the URLs and environment of one rollout (pure)
# ---------------------------------------------------------------------------------------------


def load_agent(spec: str) -> AgentFn | str:
    """The callable named by `"module:function"` (`agl_lab.agent=...` on the command line).

    A name that is not a function (a class, an AGL agent class) is returned as the string, for
    the runner to run as an AGL agent subprocess."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"agl_lab.agent={spec!r} must be 'module:function' (e.g. my_agents:solve), "
            "importable from the current directory or PYTHONPATH"
        )
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"agl_lab.agent={spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        return spec  # a class: run as an AGL agent (Class().run()) in a subprocess
    if not callable(obj):
        raise ValueError(f"agl_lab.agent={spec!r} names a {type(obj).__name__}, not a function agent(task, ctx)")
    return obj


def agl_agent_class_spec(cls: type) -> str:
    """`"module:Qualname"` of an Agent Lightning agent class (no-argument constructor, `run()`),
    which the runner starts in a subprocess per rollout with `AGL_OPENAI_BASE_URL`,
    `AGL_EVENT_URL` and `AGL_KEY` set — the AGL v1 contract, so the class runs unchanged."""
    if not callable(getattr(cls, "run", None)):
        raise TypeError(
            f"agent={cls.__name__} is a class without run(): pass a function agent(task, ctx), "
            "or an Agent Lightning agent class (no-argument constructor and run())"
        )
    if cls.__module__ in ("__main__", "builtins") or "<locals>" in cls.__qualname__:
        raise TypeError(
            f"agent={cls.__name__}: an Agent Lightning agent class runs in a subprocess, which "
            "imports it by name; define it in a module (not in a notebook cell or a function), "
            "or write the agent as a function agent(task, ctx)"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def agent_urls(
    server_url: str, rollout_id: str, is_train: bool, attempt_id: str = DEFAULT_ATTEMPT_ID
) -> tuple[str, str]:
    """`(openai_base_url, event_url)` of one rollout, exactly as AGL v1 injects them."""
    base = server_url.rstrip("/")
    mode = "train" if is_train else "val"
    return (
        f"{base}/proxy/rollout/{quote(rollout_id, safe='')}/attempt/{quote(attempt_id, safe='')}/mode/{mode}/openai/v1",
        f"{base}/api/rollouts/{quote(rollout_id, safe='')}/attempt/{quote(attempt_id, safe='')}/events",
    )


def resolve_env_path(path: str, rollout_input: Any) -> Any:
    """Value of one `env_map` entry: `"input"`, `"input.a.b.0"` (dict keys / list indices),
    or any other string used literally. A missing step raises
    `ValueError("local.env_map path not found: {path}")`."""
    if path == "input":
        return rollout_input
    if not path.startswith("input."):
        return path
    value = rollout_input
    for part in path.split(".")[1:]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ValueError(f"local.env_map path not found: {path}")
    return value


def resolve_env_map(env_map: dict[str, str], rollout_input: Any) -> dict[str, str]:
    """`{VAR: path}` -> `{VAR: value}`; non-string values are JSON-dumped (`ensure_ascii=False`)."""
    resolved = {}
    for name, path in env_map.items():
        value = resolve_env_path(path, rollout_input)
        resolved[name] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return resolved


def attempt_of(rollout: Rollout) -> str:
    """The attempt a claimed rollout runs (`status.last_attempt_id`, "0" when unset)."""
    return rollout.status.last_attempt_id or DEFAULT_ATTEMPT_ID


def agent_env(rollout: Rollout, server_url: str, key: str) -> dict[str, str]:
    """The AGL variables of one rollout plus its resolved `config.local.env_map`.

    The three `AGL_*` variables are the contract (`AgentContext.env`) and win over an
    `env_map` entry of the same name. `AGL_KEY` is the rollout's own token
    (`protocol.rollout_token`), not the server key: it opens only this rollout's proxy route
    and event posts."""
    local = rollout.config.local
    env = resolve_env_map(local.env_map if local is not None else {}, rollout.input)
    env.update(AgentContext.of(rollout, server_url, key).env)
    return env


# ---------------------------------------------------------------------------------------------
# AgentContext: what a callable agent gets besides its task
# ---------------------------------------------------------------------------------------------


# The agent's OpenAI client waits longer than the gateway's own bound on a call
# (`upstream_call_deadline_seconds`, 1200 s by default): the gateway answers first (a 504 naming
# its limits, the engine's copy aborted) and the agent never resends a call the engine is still
# generating, which would double the work the phase waits for (issue #51: with 300 s it did).
AGENT_CALL_TIMEOUT_SECONDS = 1260.0


@dataclass
class AgentContext:
    """Everything a callable agent needs to talk to the gateway and the store.

    | field      | meaning                                                                  |
    |------------|--------------------------------------------------------------------------|
    | base_url   | OpenAI base URL of this rollout:                                         |
    |            | {server}/proxy/rollout/{rid}/attempt/{aid}/mode/{train,val}/openai/v1     |
    | api_key    | this rollout's token (its proxy route and event posts; "" if auth is off) |
    | event_url  | {server}/api/rollouts/{rid}/attempt/{aid}/events                         |
    | rollout    | the rollout as the store returned it (`protocol.Rollout`)                |
    | cancelled  | set when the runner gave up on this rollout (timeout, shutdown, external) |
    """

    rollout_id: str
    attempt_id: str
    is_train: bool
    base_url: str
    event_url: str
    api_key: str
    rollout: Rollout | None = field(default=None, repr=False)
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    client: AglClient | None = field(default=None, repr=False)

    @classmethod
    def of(cls, rollout: Rollout, server_url: str, key: str, client: AglClient | None = None) -> AgentContext:
        """The context of the attempt `rollout` runs: its URLs on `server_url` and its token
        (`protocol.rollout_token` of the server's `key`; "" when auth is off)."""
        attempt = attempt_of(rollout)
        base_url, event_url = agent_urls(server_url, rollout.rollout_id, rollout.is_train, attempt)
        token = rollout_token(key, rollout.rollout_id, rollout.status.created_at, attempt)
        return cls(
            rollout_id=rollout.rollout_id,
            attempt_id=attempt,
            is_train=rollout.is_train,
            base_url=base_url,
            event_url=event_url,
            api_key=token,
            rollout=rollout,
            client=client,
        )

    @property
    def mode(self) -> str:
        return "train" if self.is_train else "val"

    @property
    def env(self) -> dict[str, str]:
        """The AGL environment variables a subprocess agent of this rollout would get."""
        return {"AGL_OPENAI_BASE_URL": self.base_url, "AGL_EVENT_URL": self.event_url, "AGL_KEY": self.api_key}

    def emit(self, event_type: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST one event of this rollout (e.g. `emit("reward", {"value": 1.0})`); returns it.

        Sent through the runner's `AglClient` (without one: a client of `event_url`'s server), and
        resent on the store's "503, nothing was stored" and on lost connections: the event carries a
        client-made id, so a resend is stored once.
        """
        if self.client is not None:
            event = self.client.add_event(self.rollout_id, self.attempt_id, event_type, dict(data or {}), retry=True)
        else:
            server = self.event_url.partition("/api/rollouts/")[0]
            with AglClient(server, key=self.api_key, timeout=30) as client:
                event = client.add_event(self.rollout_id, self.attempt_id, event_type, dict(data or {}), retry=True)
        return event.model_dump(mode="json")

    def openai_client(self, max_retries: int = 6, timeout: float = AGENT_CALL_TIMEOUT_SECONDS, **kwargs: Any) -> Any:
        """An `openai.OpenAI` client bound to this rollout's gateway URL (`shared_openai_client`:
        the process's connection pool, not a new one per rollout)."""
        return shared_openai_client(self.base_url, self.api_key, max_retries=max_retries, timeout=timeout, **kwargs)

    def async_openai_client(
        self, max_retries: int = 6, timeout: float = AGENT_CALL_TIMEOUT_SECONDS, **kwargs: Any
    ) -> Any:
        """An `openai.AsyncOpenAI` client bound to this rollout's gateway URL."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or "EMPTY", max_retries=max_retries, timeout=timeout, **kwargs
        )


# ---------------------------------------------------------------------------------------------
# One OpenAI connection pool per process
# ---------------------------------------------------------------------------------------------

_POOL_LOCK = threading.Lock()
_POOL: list[Any] = []  # the process's root `openai.OpenAI` (made on first use)


def shared_openai_client(base_url: str, api_key: str = "", **options: Any) -> Any:
    """An `openai.OpenAI` on `base_url` with `api_key` whose HTTP pool is the process's.

    Each rollout has its own URL and token, and the runner runs each callable agent in a thread
    of its own, so neither a per-URL nor a per-thread cache would ever hit; what costs is
    `openai.OpenAI()` itself (a new HTTP client and TLS context: ~0.1 s here, 0.6-0.9 s under
    load, #51). So one root client is made per process and each call returns its
    `with_options(...)` copy, which shares the root's thread-safe `httpx` pool (~0.1 ms).
    `options` (max_retries, timeout, default_headers, ...) apply to the copy only."""
    import openai

    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY"))
    return _POOL[0].with_options(base_url=base_url, api_key=api_key or "EMPTY", **options)
