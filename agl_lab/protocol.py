"""Wire schemas shared by the server, the client, the runner and the trainer.

These pydantic models are byte-compatible with Agent Lightning v1 (`agentlightning/schemas.py`),
so an AGL agent, controller or trainer talks to an agl_lab server unchanged:

    Rollout  = {rollout_id, input, is_train, config, metadata, status}
    Event    = {event_type, rollout_id, attempt_id, timestamp, data}
    Model    = {model, endpoint, version}

A rollout moves queuing -> running -> succeeded | failed (or queuing -> failed); the store
enforces these transitions and answers 409 for anything else.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import sys
import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

DEFAULT_ATTEMPT_ID = "0"


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic's lax int takes false/true as 0/1
        raise ValueError("expected an integer, got a boolean")
    return value


# An integer field of the wire: signed 64-bit (SQLite's and orjson's range), never a boolean
Int64 = Annotated[int, BeforeValidator(_not_bool), Field(ge=-(2**63), le=2**63 - 1)]


class RolloutState(str, enum.Enum):
    QUEUING = "queuing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    def __str__(self) -> str:  # behave like a StrEnum in f-strings and error texts
        return self.value


TERMINAL_STATES = frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED})

VALID_TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    RolloutState.QUEUING: frozenset({RolloutState.RUNNING, RolloutState.FAILED}),
    RolloutState.RUNNING: frozenset({RolloutState.SUCCEEDED, RolloutState.FAILED}),
    RolloutState.SUCCEEDED: frozenset(),
    RolloutState.FAILED: frozenset(),
}


ROLLOUT_TOKEN_PREFIX = "agl-rt."


def rollout_token(key: str, rollout_id: str, created_at: float, attempt_id: str = DEFAULT_ATTEMPT_ID) -> str:
    """The per-rollout token an agent gets as `AGL_KEY` instead of the server's admin key.

    `agl-rt.<rollout_id>.<hex hmac-sha256(key, rollout_id NUL repr(created_at)[ NUL attempt])[:32]>`,
    where `created_at` is the rollout's `status.created_at`: a rollout deleted and re-created under
    the same id has another, so the old token does not open the new one; the attempt id (not
    part of the message for attempt "0") makes each attempt's token its own, so the agent of a
    re-queued attempt cannot open the next one. The server accepts it only for that rollout's
    proxy route and event posts, and only while that rollout runs that attempt. Empty when
    auth is off (empty key).
    """
    if not key:
        return ""
    life = f"{rollout_id}\0{float(created_at)!r}"
    if attempt_id != DEFAULT_ATTEMPT_ID:
        life += f"\0{attempt_id}"
    mac = hmac.new(key.encode(), life.encode(), hashlib.sha256).hexdigest()[:32]
    return f"{ROLLOUT_TOKEN_PREFIX}{rollout_id}.{mac}"


def new_rollout_id() -> str:
    """A server- or client-generated rollout id: 32 hex characters."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------


class RolloutLocalConfig(BaseModel):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class RolloutK8sConfig(BaseModel):
    job_template: str | None = None


class RolloutConfig(BaseModel):
    timeout_seconds: Int64 = 3600
    local: RolloutLocalConfig | None = None
    k8s: RolloutK8sConfig | None = None


class RolloutMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    batch_idx: Int64 | None = None
    sample_idx_in_batch: Int64 | None = None


class RolloutLifecycleStatus(BaseModel):
    state: RolloutState = RolloutState.QUEUING
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None
    version: int = 1
    created_at: float
    updated_at: float


class Rollout(BaseModel):
    rollout_id: str
    input: Any = None
    is_train: bool = True
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: RolloutMetadata = Field(default_factory=RolloutMetadata)
    status: RolloutLifecycleStatus

    @property
    def is_terminal(self) -> bool:
        return self.status.state in TERMINAL_STATES


class RolloutCreate(BaseModel):
    input: Any
    is_train: bool = True
    config: RolloutConfig | None = None
    metadata: RolloutMetadata | dict[str, Any] | None = None
    rollout_id: str | None = None

    def to_rollout(self, now: float | None = None) -> Rollout:
        """The stored rollout this request creates (defaults filled in, fresh status)."""
        now = time.time() if now is None else now
        metadata = self.metadata
        if isinstance(metadata, dict):
            metadata = RolloutMetadata(**metadata)
        return Rollout(
            rollout_id=self.rollout_id or new_rollout_id(),
            input=self.input,
            is_train=self.is_train,
            config=self.config or RolloutConfig(),
            metadata=metadata or RolloutMetadata(),
            status=RolloutLifecycleStatus(created_at=now, updated_at=now),
        )


class RolloutStatusPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: RolloutState | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(BaseModel):
    status: RolloutStatusPatch | None = None


class TerminalItem(BaseModel):
    rollout_id: str
    state: RolloutState
    data_id: str
    is_train: bool


class TerminalPage(BaseModel):
    items: list[TerminalItem]
    next_after: int
    total_terminal: int


def data_id_of(rollout_input: Any) -> str:
    """The group key projected into the terminal cursor: `input.data_id` or `input.instance_id`."""
    if not isinstance(rollout_input, dict):
        return ""
    return str(rollout_input.get("data_id") or rollout_input.get("instance_id") or "")


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


class EventCreate(BaseModel):
    event_type: str
    data: dict[str, Any] = Field(default_factory=dict)
    # agl_lab: a client-made id (e.g. a uuid4); a second post of one id under one (rollout, attempt)
    # stores nothing, so a client may resend an event whose answer it did not get
    event_id: str | None = Field(None, min_length=1, max_length=200)


class Event(BaseModel):
    event_type: str
    rollout_id: str
    attempt_id: str
    timestamp: float
    data: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Rewards: the `reward` event's `{"value": r}`
# ---------------------------------------------------------------------------------------------


def is_number(value: Any) -> bool:
    """An int, a float or a numpy number (numpy is not imported here: a numpy scalar exists only
    where numpy already is), never a bool."""
    # Critical: bool is an int subclass; a `True` reward is a bug in the agent, not 1.0.
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.number) and not isinstance(value, np.bool_)


# The largest float32, numpy.finfo(numpy.float32).max: a reward beyond it overflows the float32 tensors of a batch
FLOAT32_MAX = 3.4028234663852886e38


def reward_problem(value: Any) -> str | None:
    """Why `value` is not a usable reward (None when it is): a reward is a finite float32.

    Bools, text, lists, None, NaN, +-Infinity and numbers beyond float32 (|x| > 3.4e38, e.g.
    1e39 or a 401-digit integer) are refused — they would silently become 0.0 or NaN advantages.
    """
    if not is_number(value):
        return f"reward value {_brief(value)} is not a number"
    try:
        f = float(value)
    except OverflowError:
        return f"reward value {_brief(value)} is beyond float32"
    if not math.isfinite(f):
        return f"reward value {f} is not finite"
    if abs(f) > FLOAT32_MAX:
        return f"reward value {f:g} is beyond float32 (|x| <= {FLOAT32_MAX:.4g})"
    return None


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"


# ---------------------------------------------------------------------------------------------
# Model registry
# ---------------------------------------------------------------------------------------------


class Model(BaseModel):
    model: str
    endpoint: str
    version: Int64 = 0


# ---------------------------------------------------------------------------------------------
# Gateway pause state
# ---------------------------------------------------------------------------------------------


class PauseRequest(BaseModel):
    retry_after_seconds: Annotated[int, BeforeValidator(_not_bool), Field(ge=0, le=86_400)] = 5
    reason: str | None = None


class PauseState(BaseModel):
    paused: bool
    retry_after_seconds: int
    reason: str | None
    inflight: int
