"""The store's errors: what a `Store` raises, and `agl_lab.server.app` maps to an HTTP code.

    RolloutNotFound     404   no such rollout
    InvalidTransition   409   a status change the rollout's state does not allow
    EventIdReused       409   an event id posted again with other content
    StoreUnavailable    503   a database server store cannot be reached: nothing was stored
    StoreLocked         -     a second opener of a SQLite file (at start, not per request)

`ReusedAttempt` (an `InvalidTransition`) and `StaleAttempt` read a rollout's attempts and live
with them in `base.py`.
"""

from __future__ import annotations

from agl_lab.protocol import RolloutState


class StoreError(Exception):
    """Base class of the store's errors (mapped to HTTP codes by the app)."""


class RolloutNotFound(StoreError, LookupError):
    def __init__(self, rollout_id: str):
        super().__init__(f"Rollout not found: {rollout_id}")
        self.rollout_id = rollout_id


class StoreLocked(StoreError, RuntimeError):
    """Another process already serves this SQLite file (one server per store file)."""


class StoreUnavailable(StoreError, ConnectionError):
    """A database server store (PostgreSQL) cannot be reached: nothing was stored; retry (app: 503)."""


class InvalidTransition(StoreError, ValueError):
    def __init__(self, rollout_id: str, current: RolloutState, target: RolloutState | None):
        super().__init__(f"Rollout {rollout_id}: cannot transition {current} -> {target}")
        self.rollout_id, self.current, self.target = rollout_id, current, target


class EventIdReused(StoreError, ValueError):
    """An event id posted again with other content (type or data): 409. An id names one event and
    a resend repeats it unchanged, so other content under a stored id is refused, never dropped."""

    def __init__(self, rollout_id: str, attempt_id: str, event_id: str):
        super().__init__(
            f"Rollout {rollout_id}, attempt {attempt_id}: event id {event_id!r} is already stored with other "
            "content (event type or data): an event id names one event — give each event its own id"
        )
        self.rollout_id, self.attempt_id, self.event_id = rollout_id, attempt_id, event_id
