"""The rollout store: the ledger of rollouts, their events, the model registry and the
terminal-order log.

One `Store` interface, three backends chosen by URL (`agl_lab.server.backends.open_store`):

    "memory" | None          -> MemoryStore   (default; lost when the process ends)
    "sqlite:///path/to.db"   -> SqliteStore   (a restarted kernel re-attaches to it)
    "postgresql://..."       -> PostgresStore (agl_lab.server.store_pg: several server processes share it)

The semantics (AGL v1's data model, `agentlightning/schemas.py` and `server/store.py`) live once, in the `Store` base class; a backend
only implements storage primitives (`_load`, `_insert`, `_append_event`, ...). So all
backends answer every question identically, and the tests run the same suite on each.

    rollouts   rollout_id -> Rollout                 (creation order kept)
    events     rollout_id -> attempt_id -> [Event]   (append-only; position is identity)
    models     model name -> endpoint -> Model       (upsert by (model, endpoint))
    terminal   [rollout_id]                          (appended on each terminal transition)

Design decisions:
- Thread-safe: every public method holds one re-entrant lock (`_lock`), because the embedded server's
  event loop and a notebook thread may use the same store at once. Each call is short. (PostgreSQL
  replaces the lock with a connection checkout and excludes with transactions and row locks.)
- The terminal log is bounded (`terminal_log_limit`): cursor indices stay absolute, entries
  older than the retained window are gone, and a cursor behind the window restarts at the
  oldest retained entry. `total_terminal` is the absolute count of terminal transitions.
- No HTTP here: errors are `RolloutNotFound` / `InvalidTransition` / `NotStorable`, mapped to
  404 / 409 / 422 by `agl_lab.server.app`; a second opener of a SQLite file gets `StoreLocked`.
- Write-time rule (`agl_lab.server.storable`): what is stored can be read back and sent, on
  both backends. The triplet view the app serves (`triplet_events`) is a pure function
  over events and lives in `agl_lab.records`, beside the code that consumes it.
- Claims and attempts (agl_lab; AGL v1 always uses attempt "0"): `claim_rollouts` hands each
  queued rollout to exactly one caller as a new attempt (`last_attempt_id` "0", then "1", ...);
  a running rollout holds a lease (`heartbeat`, events of its running attempt); `expire_leases`
  re-queues an idle one as the next attempt up to `max_attempts`, then fails it with the
  reason; `release_rollouts` gives a stopping runner's attempts back. Reads follow
  `last_attempt_id`, so an old attempt's late events are kept but not read. The storage side
  is three primitives (`_lock_queued`, `_touch`, `_idle_running`) whose docstrings say what a
  backend shared by several processes must lock.
- Objects returned by `MemoryStore` are the stored ones (treat them as read-only), except event
  data: each read decodes a fresh copy of the stored JSON bytes. `models_for` answers from a
  cache on both backends: its `Model`s are shared too (the list is the caller's).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from agl_lab.protocol import (
    DEFAULT_ATTEMPT_ID,
    TERMINAL_STATES,
    VALID_TRANSITIONS,
    Event,
    Model,
    Rollout,
    RolloutCreate,
    RolloutState,
    RolloutStatusPatch,
    TerminalItem,
    TerminalPage,
    data_id_of,
)
from agl_lab.server.storable import check_rollout_id, check_storable, dump_storable

try:  # orjson reads the event payloads the SQLite backend stores ~5x faster (writes: dump_storable)
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    _loads = json.loads

DEFAULT_TERMINAL_LOG_LIMIT = 100_000
log = logging.getLogger("agl_lab.server.store")


def _pack(data: Any) -> bytes:
    """MemoryStore's stored form of event data: JSON bytes. Encoding is also the write-time check
    (NotStorable names the field), so an event is encoded once."""
    return dump_storable(data, "data")


def _unpack(stored: bytes) -> Any:
    return _loads(stored)


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


class ReusedAttempt(InvalidTransition):
    """A PATCH to running that would run a re-queued rollout under an attempt id it ran already
    (AGL clients always claim attempt "0"): 409, so attempts stay bounded by max_attempts."""

    def __init__(self, rollout: Rollout, attempt_id: str):
        ValueError.__init__(self, f"Rollout {rollout.rollout_id}: attempt {attempt_id} already ran (the rollout was "
                                  f"re-queued); claim it as attempt {next_attempt_id(rollout.status.last_attempt_id)} "
                                  f"(last_attempt_id) or through POST /api/rollouts/claim")
        self.rollout_id, self.current, self.target = rollout.rollout_id, rollout.status.state, RolloutState.RUNNING


class StaleAttempt(StoreError, ValueError):
    """A patch conditioned on an attempt the rollout no longer runs (409, like InvalidTransition)."""

    def __init__(self, rollout: Rollout, attempt_id: str):
        live = rollout.status.last_attempt_id or DEFAULT_ATTEMPT_ID
        super().__init__(f"Rollout {rollout.rollout_id}: attempt {attempt_id} is not running (the rollout is "
                         f"{rollout.status.state.value}, attempt {live}); its lease expired or it was released")
        self.rollout_id, self.attempt_id = rollout.rollout_id, attempt_id


def next_attempt_id(last_attempt_id: str | None) -> str:
    """The attempt id a claim gives: "0" for a never-claimed rollout, else last + 1 ("1", "2", ...).
    A non-numeric id (set by a client's PATCH) is followed by "1"."""
    return str(_attempts_used(last_attempt_id))


def _attempts_used(last_attempt_id: str | None) -> int:
    """Attempts a rollout has had, read from its `last_attempt_id` ("0" -> 1, "1" -> 2; None -> 0)."""
    if last_attempt_id is None:
        return 0
    return int(last_attempt_id) + 1 if last_attempt_id.isascii() and last_attempt_id.isdigit() else 1


def _runs_attempt(rollout: Rollout, attempt_id: str) -> bool:
    """True while `rollout` is running attempt `attempt_id`."""
    status = rollout.status
    return status.state == RolloutState.RUNNING and (status.last_attempt_id or DEFAULT_ATTEMPT_ID) == attempt_id


def _with_status(rollout: Rollout, now: float, **updates: Any) -> Rollout:
    """A copy of `rollout` with its status updated, version + 1 and updated_at = `now`."""
    status = rollout.status.model_copy(update={**updates, "version": rollout.status.version + 1, "updated_at": now})
    return rollout.model_copy(update={"status": status})


# ---------------------------------------------------------------------------------------------
# The interface and its semantics
# ---------------------------------------------------------------------------------------------


class Store(ABC):
    """The ledger. Public methods implement AGL v1 semantics over a backend's primitives."""

    # Does an event of the running attempt `_touch` its rollout? False for a backend whose
    # `_idle_running` reads the newest event row itself (PostgreSQL: no extra write per model call).
    TOUCH_ON_EVENT = True

    def __init__(self, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        if int(terminal_log_limit) < 1:
            raise ValueError(
                f"terminal_log_limit must be >= 1, got {terminal_log_limit}: "
                f"set it to the number of terminal ids a client may lag behind (default "
                f"{DEFAULT_TERMINAL_LOG_LIMIT})"
            )
        self.terminal_log_limit = int(terminal_log_limit)
        self._lock = threading.RLock()
        self._pools: dict[str, tuple[Model, ...]] = {}  # models_for's answers, dropped on any model write

    # --- rollouts ---------------------------------------------------------------------------

    def create_rollouts(self, creates: Sequence[RolloutCreate]) -> list[Rollout]:
        """Create rollouts in order; a client id that exists returns the existing rollout.

        All or nothing: the batch is one transaction, so a refused write (a full disk) or a
        killed server stores none of it. The rollouts are built before the lock is taken; the
        lock is held only for the id lookup and the inserts.

        Raises NotStorable (and stores none of them) when any request breaks the storable
        rule (`agl_lab.server.storable`) or names an invalid rollout id.
        """
        _check_creates(creates)
        now = time.time()
        built = [create.to_rollout(now) for create in creates]
        client_ids = [create.rollout_id for create in creates if create.rollout_id]
        with self._lock, self._transaction():
            known = self._load_many(client_ids) if client_ids else {}
            out: list[Rollout] = []
            new: list[Rollout] = []
            for create, rollout in zip(creates, built):
                if create.rollout_id and create.rollout_id in known:  # idempotent retry: never reset
                    out.append(known[create.rollout_id])  # a started rollout (or a repeat in the batch)
                    continue
                known[rollout.rollout_id] = rollout
                new.append(rollout)
                out.append(rollout)
            self._insert_many(new)
        return out

    def get_rollout(self, rollout_id: str) -> Rollout | None:
        with self._lock:
            return self._load(rollout_id)

    def list_rollouts(self, states: Iterable[RolloutState | str], limit: int = 500) -> list[Rollout]:
        """Rollouts whose state is in `states`, in creation order, at most `limit`."""
        wanted = [RolloutState(s) for s in states]
        if limit <= 0 or not wanted:
            return []
        with self._lock:
            return self._list(wanted, limit)

    def patch_status(self, rollout_id: str, patch: RolloutStatusPatch, *, attempt_id: str | None = None) -> Rollout:
        """Apply the explicitly set fields of `patch`; bump version/updated_at if any.

        `attempt_id` (agl_lab; AGL clients never send it) makes the patch conditional: it
        applies only while the rollout is running that attempt, so a runner whose attempt was
        re-queued (its lease expired) cannot end the attempt another runner now runs.

        Raises RolloutNotFound; StaleAttempt when `attempt_id` is not the running attempt;
        InvalidTransition when `state` is set (even to None) and the move is not in
        VALID_TRANSITIONS; ReusedAttempt (an InvalidTransition: 409) when it would run a
        re-queued rollout under an attempt id it ran already.
        """
        updates = patch.model_dump(exclude_unset=True)
        check_storable({k: v for k, v in updates.items() if k != "state"}, "status")
        with self._lock, self._transaction():
            rollout = self._load(rollout_id)
            if rollout is None:
                raise RolloutNotFound(rollout_id)
            if attempt_id is not None and not _runs_attempt(rollout, attempt_id):
                raise StaleAttempt(rollout, attempt_id)
            if not updates:
                return rollout
            current = rollout.status.state
            if "state" in updates and updates["state"] not in VALID_TRANSITIONS[current]:
                raise InvalidTransition(rollout_id, current, updates["state"])
            if updates.get("state") == RolloutState.RUNNING and rollout.status.last_attempt_id is not None:
                wanted = updates.get("last_attempt_id") or DEFAULT_ATTEMPT_ID  # re-queued: a new attempt only
                if _attempts_used(wanted) <= _attempts_used(rollout.status.last_attempt_id):
                    raise ReusedAttempt(rollout, wanted)
            now = time.time()
            rollout = _with_status(rollout, now, **updates)
            self._replace(rollout)
            # exactly once per rollout life: terminal states have no transitions out
            if "state" in updates and rollout.status.state in TERMINAL_STATES:
                self._terminal_append(rollout_id)
                self._terminal_trim()
            elif rollout.status.state == RolloutState.RUNNING:
                self._touch([rollout_id], now)
            return rollout

    def delete_rollout(self, rollout_id: str) -> None:
        """Remove a rollout and all its events (idempotent); the terminal log keeps its id."""
        with self._lock, self._transaction():
            self._remove(rollout_id)

    # --- events -----------------------------------------------------------------------------

    def append_event(
        self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any] | None = None
    ) -> Event:
        """Append one event (timestamped now) under (rollout, attempt); RolloutNotFound if unknown."""
        if data is not None and not isinstance(data, dict):
            raise TypeError(f"event data must be a dict, got {type(data).__name__}")
        check_storable([rollout_id, attempt_id, event_type], "event ids")
        self._check_event_data(data)
        with self._lock:
            event = Event.model_construct(
                event_type=event_type,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                timestamp=time.time(),
                data={} if data is None else data,
            )
            if not self._append_event(event):
                raise RolloutNotFound(rollout_id)
            rollout = self._load(rollout_id) if self.TOUCH_ON_EVENT else None  # an event of the running
            if rollout is not None and _runs_attempt(rollout, attempt_id):  # attempt renews its lease, a late
                self._touch([rollout_id], event.timestamp)  # one of an old attempt does not
            return event

    def events(
        self, rollout_id: str, *, event_type: str | None = None, attempt_id: str | None = None
    ) -> list[Event]:
        """Events of one attempt in insertion order (default: `last_attempt_id or "0"`)."""
        with self._lock:
            rollout = self._load(rollout_id)
            if rollout is None:
                raise RolloutNotFound(rollout_id)
            if attempt_id is None:
                attempt_id = rollout.status.last_attempt_id or DEFAULT_ATTEMPT_ID
            events = self._events(rollout_id, attempt_id)
        if event_type is not None:
            events = [e for e in events if e.event_type == event_type]
        return events

    def attempts(self, rollout_id: str) -> list[str]:
        """Attempt ids with >= 1 event, ordered by their first event; RolloutNotFound if unknown."""
        with self._lock:
            if not self._exists(rollout_id):
                raise RolloutNotFound(rollout_id)
            return self._attempts(rollout_id)

    # --- claims, attempts and leases of running rollouts ------------------------------------

    def claim_rollouts(self, limit: int, runner_id: str = "") -> list[Rollout]:
        """Hand the caller up to `limit` queued rollouts, oldest first, each to exactly one caller.

        One transaction: `_lock_queued` takes the rows so no concurrent claim can (another
        thread, or another process on a shared database), and each becomes `running` as a new
        attempt (`next_attempt_id`: "0" for a fresh rollout, "1", "2", ... after re-queues),
        with version + 1, updated_at = now and its lease starting now. `runner_id` names the
        caller in the server's log. Returns the claimed rollouts (fewer, or none, when fewer
        are queued).
        """
        if limit < 1:
            return []
        now = time.time()
        with self._lock, self._transaction():
            claimed = []
            for rollout in self._lock_queued(limit):
                rollout = _with_status(rollout, now, state=RolloutState.RUNNING, error_message=None,
                                       last_attempt_id=next_attempt_id(rollout.status.last_attempt_id))
                self._replace(rollout)
                claimed.append(rollout)
            self._touch([r.rollout_id for r in claimed], now)
        if claimed:
            log.debug("runner %r claimed %d rollout(s)", runner_id, len(claimed))
        return claimed

    def release_rollouts(self, attempts: Mapping[str, str], reason: str) -> list[str]:
        """Give running attempts back to the queue (a runner stopping cleanly); returns the ids released.

        `attempts` maps rollout id -> the attempt the caller runs; a rollout that is not running
        that attempt (finished, re-queued, deleted) is skipped. A released rollout is `queuing`
        again with `error_message` saying why; its next claim is a new attempt, so late events
        of the released one are kept but not read. A release never fails a rollout (the agent
        did nothing wrong) but its attempt counts toward `max_attempts` of `expire_leases`.
        """
        now = time.time()
        released = []
        with self._lock, self._transaction():
            rollouts = self._load_many(list(attempts))
            for rid, attempt_id in attempts.items():
                rollout = rollouts.get(rid)
                if rollout is None or not _runs_attempt(rollout, attempt_id):
                    continue
                message = f"attempt {attempt_id} released ({reason}); re-queued"
                self._replace(_with_status(rollout, now, state=RolloutState.QUEUING, error_message=message,
                                           last_attempt_id=attempt_id))  # the next claim: attempt + 1
                released.append(rid)
        return released

    def heartbeat(self, rollout_ids: Sequence[str], attempt_ids: Sequence[str] | None = None) -> list[str]:
        """Renew the lease of each running rollout in `rollout_ids`; returns the ids that are
        not running (unknown, queuing or terminal) so the runner can stop their agents.

        With `attempt_ids` (parallel to `rollout_ids`), a rollout counts as running only while
        it runs that attempt: the runner of a re-queued attempt learns to stop its agent.
        """
        if attempt_ids is not None and len(attempt_ids) != len(rollout_ids):
            raise ValueError(f"attempt_ids has {len(attempt_ids)} items for {len(rollout_ids)} rollout_ids: "
                             "give one attempt id per rollout id, or none")
        now = time.time()
        with self._lock:
            rollouts = self._load_many(list(rollout_ids))
            live, not_running = [], []
            for i, rid in enumerate(rollout_ids):
                rollout = rollouts.get(rid)
                attempt = None if attempt_ids is None else attempt_ids[i]
                if rollout is not None and rollout.status.state == RolloutState.RUNNING and (
                        attempt is None or _runs_attempt(rollout, attempt)):
                    live.append(rid)
                else:
                    not_running.append(rid)
            self._touch(live, now)
        return not_running

    def expire_leases(self, lease_seconds: float, max_attempts: int = 1, now: float | None = None) -> dict[str, str]:
        """Re-queue (or fail) every running rollout without a heartbeat, event of its running
        attempt, or status change for `lease_seconds` (its runner died or lost the network).

        A rollout whose attempts so far (`last_attempt_id` + 1) are fewer than `max_attempts`
        goes back to `queuing` and its next claim is a new attempt; otherwise it fails with
        the reason. One transaction: `_idle_running` locks the rows it returns, so a heartbeat
        or claim cannot interleave. Returns {rollout id: "requeued" | "failed"}.
        """
        now = time.time() if now is None else now
        outcome: dict[str, str] = {}
        with self._lock, self._transaction():
            idle = self._idle_running(now - lease_seconds)
            rollouts = self._load_many(idle)  # in the transaction: the rows are locked from here on
            if idle:  # asked again under the locks: a heartbeat that committed meanwhile keeps its rollout
                still_idle = set(self._idle_running(now - lease_seconds))
                rollouts = {rid: r for rid, r in rollouts.items() if rid in still_idle}
            for rid, rollout in rollouts.items():
                if rollout.status.state != RolloutState.RUNNING:  # pragma: no cover - the primitive's contract
                    continue
                attempt = rollout.status.last_attempt_id or DEFAULT_ATTEMPT_ID
                used = _attempts_used(attempt)  # a running rollout without an attempt id runs "0"
                why = (f"attempt {attempt}: lease expired (no heartbeat, event or status change for "
                       f"{lease_seconds:g}s, lease_seconds={lease_seconds:g}); its runner stopped or lost the network")
                if used < max_attempts:
                    message = f"{why}; re-queued as attempt {next_attempt_id(attempt)} of max_attempts={max_attempts}"
                    self._replace(_with_status(rollout, now, state=RolloutState.QUEUING, error_message=message,
                                               last_attempt_id=attempt))  # the next claim: attempt + 1
                    outcome[rid] = "requeued"
                else:
                    message = f"{why}; failed after {used} attempt(s) (max_attempts={max_attempts})"
                    self._replace(_with_status(rollout, now, state=RolloutState.FAILED, error_message=message))
                    self._terminal_append(rid)
                    self._terminal_trim()
                    outcome[rid] = "failed"
        return outcome

    # --- terminal-order log -----------------------------------------------------------------

    def terminal_page(self, after: int = 0, limit: int = 1000) -> TerminalPage:
        """One page of the completion-ordered log, starting at absolute index `after`.

        `after < 0 -> 0`, `limit < 1 -> 1`; a cursor older than the retained window restarts
        at the oldest retained entry. Deleted (or re-created, not yet terminal) rollouts are
        skipped but consumed, and so is an entry of an id that has a later entry (a rollout
        deleted and re-created appears once, at its latest terminal transition).
        """
        after, limit = max(0, int(after)), max(1, int(limit))
        with self._lock:
            total = self._terminal_total()
            start = max(after, total - self._terminal_len())
            ids = self._terminal_slice(start, start + limit) if start < total else []
            rollouts = self._load_many(ids)
        items = []
        for rid in ids:
            rollout = rollouts.get(rid)
            if rollout is None or rollout.status.state not in TERMINAL_STATES:
                continue
            items.append(
                TerminalItem(
                    rollout_id=rid,
                    state=rollout.status.state,
                    data_id=data_id_of(rollout.input),
                    is_train=rollout.is_train,
                )
            )
        return TerminalPage(items=items, next_after=start + len(ids), total_terminal=total)

    # --- model registry ---------------------------------------------------------------------

    def upsert_models(self, models: Sequence[Model]) -> list[Model]:
        for i, model in enumerate(models):
            check_storable(model.model_dump(), f"[{i}]")
        with self._lock:
            try:
                with self._transaction():
                    for model in models:
                        self._put_model(model)
            finally:
                self._pools = {}
        return list(models)

    def clear_models(self) -> None:
        with self._lock:
            try:
                with self._transaction():
                    self._clear_models()
            finally:
                self._pools = {}

    def models_for(self, model_name: str) -> list[Model]:
        """The endpoints registered for `model_name`, sorted by endpoint string.

        Every proxied call asks, so the answer is kept until the next model write (a plain
        dict read: the gateway's loop does not take the lock on a hit).
        """
        pool = self._pools.get(model_name)
        if pool is None:
            with self._lock:
                pool = tuple(sorted(self._models(model_name), key=lambda m: m.endpoint))
                self._pools[model_name] = pool
        return list(pool)

    def close(self) -> None:
        """Release resources (SQLite connection); the in-memory store has none."""

    # --- write-time checks (one rule for both backends: what is stored reads back) -----------

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        """NotStorable unless `data` encodes (the SQLite backend checks while encoding instead)."""
        if data:
            dump_storable(data, "data")

    # --- backend primitives (called with the lock held) -------------------------------------

    def _transaction(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    @abstractmethod
    def _load(self, rollout_id: str) -> Rollout | None: ...

    @abstractmethod
    def _load_many(self, rollout_ids: Sequence[str]) -> dict[str, Rollout]: ...

    @abstractmethod
    def _exists(self, rollout_id: str) -> bool: ...

    @abstractmethod
    def _insert(self, rollout: Rollout) -> None: ...

    def _insert_many(self, rollouts: Sequence[Rollout]) -> None:
        for rollout in rollouts:
            self._insert(rollout)

    @abstractmethod
    def _replace(self, rollout: Rollout) -> None: ...

    @abstractmethod
    def _remove(self, rollout_id: str) -> None: ...

    @abstractmethod
    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]: ...

    @abstractmethod
    def _lock_queued(self, limit: int) -> list[Rollout]:
        """The oldest `limit` queuing rollouts (creation order), locked for the open transaction.

        Called inside `self._transaction()` (under the store's lock); the caller then
        `_replace`s each with its running status in the same transaction. Locked means no
        concurrent transaction can return or change the same rows until this one ends:
        another thread (the store's lock does that), or another process sharing the
        database (PostgreSQL: `SELECT ... WHERE state='queuing' ORDER BY seq LIMIT $1 FOR
        UPDATE SKIP LOCKED`, so concurrent claimers get disjoint sets and never wait on each
        other). Memory and SQLite have one process per store (the SQLite file is flocked).
        """

    @abstractmethod
    def _touch(self, rollout_ids: Sequence[str], now: float) -> None:
        """Record activity at `now` (a heartbeat, an event of the running attempt, a claim or
        status change) for each id; unknown ids are ignored. Called under the store's lock,
        inside or outside a transaction."""

    @abstractmethod
    def _idle_running(self, before: float) -> list[str]:
        """Ids of running rollouts whose last activity (the latest `_touch`, else
        `status.updated_at`) is older than `before`, in creation order.

        Called inside `self._transaction()`; the rows returned are locked like
        `_lock_queued`'s (PostgreSQL: `FOR UPDATE SKIP LOCKED`), because the caller re-queues
        or fails each in the same transaction."""

    @abstractmethod
    def _append_event(self, event: Event) -> bool:
        """Append if the rollout exists (atomically); False if it does not."""

    @abstractmethod
    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]: ...

    @abstractmethod
    def _attempts(self, rollout_id: str) -> list[str]: ...

    @abstractmethod
    def _terminal_append(self, rollout_id: str) -> None: ...

    @abstractmethod
    def _terminal_trim(self) -> None: ...

    @abstractmethod
    def _terminal_total(self) -> int: ...

    @abstractmethod
    def _terminal_len(self) -> int: ...

    @abstractmethod
    def _terminal_slice(self, start: int, stop: int) -> list[str]:
        """Ids of entries [start, stop); "" for an entry superseded by a later one of its id."""

    @abstractmethod
    def _put_model(self, model: Model) -> None: ...

    @abstractmethod
    def _clear_models(self) -> None: ...

    @abstractmethod
    def _models(self, model_name: str) -> list[Model]: ...


class _Activity:
    """Lease activity kept in this process (MemoryStore; SqliteStore, whose file has one process).

    Not persisted: after a restart a running rollout's lease runs from its last status change
    (`status.updated_at`, which SQLite persists), so a restarted server re-queues the rollouts
    of runners that died with it one lease later, never at once.
    """

    def __init__(self) -> None:
        self._at: dict[str, float] = {}  # running rollout id -> last heartbeat / event / claim

    def touch(self, rollout_ids: Sequence[str], now: float) -> None:
        for rid in rollout_ids:
            self._at[rid] = now

    def idle(self, running: Iterable[Rollout], before: float) -> list[str]:
        """Ids of `running` idle since before `before`; forgets ids no longer running."""
        seen: set[str] = set()
        idle = []
        for rollout in running:
            rid = rollout.rollout_id
            seen.add(rid)
            if max(rollout.status.updated_at, self._at.get(rid, 0.0)) < before:
                idle.append(rid)
        self._at = {rid: at for rid, at in self._at.items() if rid in seen}  # bounded by what runs
        return idle


# ---------------------------------------------------------------------------------------------
# In-memory backend
# ---------------------------------------------------------------------------------------------


class MemoryStore(Store):
    """Plain dicts; the terminal log is a bounded deque plus an absolute count."""

    def __init__(self, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        super().__init__(terminal_log_limit)
        self._rollouts: dict[str, Rollout] = {}
        # events as (type, timestamp, JSON bytes): bytes are invisible to the garbage collector, so
        # 100k stored calls do not make each full collection (which stops the server's event loop)
        # walk millions of dicts; reads decode a fresh copy
        self._event_log: dict[str, dict[str, list[tuple[str, float, Any]]]] = {}
        self._model_map: dict[str, dict[str, Model]] = {}
        self._terminal: collections.deque[str] = collections.deque(maxlen=self.terminal_log_limit)
        self._terminal_count = 0
        self._terminal_latest: dict[str, int] = {}  # rollout id -> absolute index of its latest entry
        self._activity = _Activity()

    def __repr__(self) -> str:
        return f"MemoryStore(rollouts={len(self._rollouts)}, terminal={self._terminal_count})"

    def _load(self, rollout_id: str) -> Rollout | None:
        return self._rollouts.get(rollout_id)

    def _load_many(self, rollout_ids: Sequence[str]) -> dict[str, Rollout]:
        return {rid: self._rollouts[rid] for rid in rollout_ids if rid in self._rollouts}

    def _exists(self, rollout_id: str) -> bool:
        return rollout_id in self._rollouts

    def _insert(self, rollout: Rollout) -> None:
        self._rollouts[rollout.rollout_id] = rollout
        self._event_log[rollout.rollout_id] = {}

    def _replace(self, rollout: Rollout) -> None:
        self._rollouts[rollout.rollout_id] = rollout  # same key: creation order is kept

    def _remove(self, rollout_id: str) -> None:
        self._rollouts.pop(rollout_id, None)
        self._event_log.pop(rollout_id, None)

    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]:
        matching = (r for r in self._rollouts.values() if r.status.state in states)
        return list(itertools.islice(matching, limit))

    def _lock_queued(self, limit: int) -> list[Rollout]:
        return self._list([RolloutState.QUEUING], limit)  # the store's lock is the row lock

    def _touch(self, rollout_ids: Sequence[str], now: float) -> None:
        self._activity.touch(rollout_ids, now)

    def _idle_running(self, before: float) -> list[str]:
        return self._activity.idle(self._list([RolloutState.RUNNING], len(self._rollouts)), before)

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        pass  # `_append_event` encodes with dump_storable (`_pack`), which is the check

    def _append_event(self, event: Event) -> bool:
        attempts = self._event_log.get(event.rollout_id)
        if attempts is None or event.rollout_id not in self._rollouts:
            return False
        attempts.setdefault(event.attempt_id, []).append((event.event_type, event.timestamp, _pack(event.data)))
        return True

    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]:
        return [Event.model_construct(event_type=etype, rollout_id=rollout_id, attempt_id=attempt_id,
                                      timestamp=ts, data=_unpack(data))
                for etype, ts, data in self._event_log.get(rollout_id, {}).get(attempt_id, [])]

    def _attempts(self, rollout_id: str) -> list[str]:
        buckets = self._event_log.get(rollout_id, {})
        firsts = [(evs[0][1], i, aid) for i, (aid, evs) in enumerate(buckets.items()) if evs]
        return [aid for _, _, aid in sorted(firsts)]

    def _terminal_append(self, rollout_id: str) -> None:
        if len(self._terminal) == self._terminal.maxlen:  # the oldest entry is about to drop
            oldest, oldest_idx = self._terminal[0], self._terminal_count - len(self._terminal)
            if self._terminal_latest.get(oldest) == oldest_idx:
                del self._terminal_latest[oldest]
        self._terminal.append(rollout_id)  # the deque drops the oldest entry at its limit
        self._terminal_latest[rollout_id] = self._terminal_count
        self._terminal_count += 1

    def _terminal_trim(self) -> None:
        pass  # bounded by the deque's maxlen

    def _terminal_total(self) -> int:
        return self._terminal_count

    def _terminal_len(self) -> int:
        return len(self._terminal)

    def _terminal_slice(self, start: int, stop: int) -> list[str]:
        base = self._terminal_count - len(self._terminal)  # absolute index of _terminal[0]
        ids = itertools.islice(self._terminal, start - base, stop - base)
        latest = self._terminal_latest
        return [rid if latest.get(rid) == start + i else "" for i, rid in enumerate(ids)]

    def _put_model(self, model: Model) -> None:
        self._model_map.setdefault(model.model, {})[model.endpoint] = model

    def _clear_models(self) -> None:
        self._model_map.clear()

    def _models(self, model_name: str) -> list[Model]:
        return list(self._model_map.get(model_name, {}).values())


# ---------------------------------------------------------------------------------------------
# SQLite backend
# ---------------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order (a re-created id goes last)
    rollout_id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    body TEXT NOT NULL                       -- Rollout as JSON
);
CREATE INDEX IF NOT EXISTS rollouts_state ON rollouts (state, seq);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,                 -- insertion order (a new row gets max(seq) + 1)
    rollout_id TEXT NOT NULL,
    attempt_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    timestamp REAL NOT NULL,
    data BLOB NOT NULL                       -- JSON (TEXT in files written before 2026-12)
);
CREATE INDEX IF NOT EXISTS events_rollout ON events (rollout_id, attempt_id, seq);
CREATE TABLE IF NOT EXISTS models (
    model TEXT NOT NULL, endpoint TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (model, endpoint)
);
CREATE TABLE IF NOT EXISTS terminal_log (
    idx INTEGER PRIMARY KEY,                 -- absolute position in the completion order
    rollout_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS terminal_log_rollout ON terminal_log (rollout_id, idx);
"""


class SqliteStore(Store):
    """One SQLite file (WAL mode); one connection shared under the store's lock.

    Durability: `synchronous=NORMAL` in WAL mode. Every write, event appends included, is
    committed before the call returns, so an acknowledged write survives a crash of the process
    (a power loss may undo the last ones). A commit in WAL mode with NORMAL does not fsync, so an
    append costs one INSERT and a WAL write. WAL checkpoints run on a background thread's own
    connection (PASSIVE: they never block the server), not inside a model call's commit.

    One store per file: opening takes an exclusive flock on the database file's identity, so a
    symlink or hard link to it is the same file (`_FileLock`; released by `close()` or when the
    process ends, even by kill -9), and a second opener gets StoreLocked.
    Two servers on one file would each hold their own lock and cursor state and meet as
    `database is locked` errors after 5 s busy waits, so it is refused, not supported.
    """

    CHECKPOINT_SECONDS = 1.0
    ROLLOUT_CACHE = 10_000

    def __init__(self, path: str, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        super().__init__(terminal_log_limit)
        self.path = path
        self._lock_file: _FileLock | None = None
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._lock_file = _lock_exclusively(path)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes
            self._db.executescript(_SCHEMA)
        except BaseException:
            if self._lock_file is not None:
                self._lock_file.close()
            raise
        self._cache: dict[str, Rollout] = {}  # rollout_id -> Rollout as stored (see _load)
        self._activity = _Activity()  # in memory: this process is the file's only one
        self._depth = 0  # nesting of _transaction (re-entrant under the RLock)
        self._closed = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path != ":memory:":  # an in-memory database has no WAL to checkpoint
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpoint thread does it
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, args=(weakref.ref(self), self._closed, path),
                                                  name="agl-sqlite-checkpoint", daemon=True)
            self._checkpointer.start()
        with self._lock:
            self._terminal_trim()  # a smaller limit on reopen applies at once

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        if self._checkpointer is not None and threading.current_thread() is not self._checkpointer:
            self._checkpointer.join(5)
        with self._lock:
            self._db.close()
            if self._lock_file is not None:
                self._lock_file.close()  # closing the descriptor releases the flock
                self._lock_file = None

    @staticmethod
    def _checkpoint_loop(ref: weakref.ref, closed: threading.Event, path: str) -> None:
        """The WAL checkpoint thread; holds the store only weakly, so an unclosed store is still freed."""
        checkpointer = sqlite3.connect(path, check_same_thread=False)
        try:
            while not closed.wait(SqliteStore.CHECKPOINT_SECONDS):
                if ref() is None:  # the store was freed without close()
                    return
                with contextlib.suppress(sqlite3.Error):
                    checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            with contextlib.suppress(sqlite3.Error):
                checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
            checkpointer.close()

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None and not closed.is_set():
            with contextlib.suppress(Exception):
                self.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: committed, or rolled back and the exception raised (never
        left open). COMMIT is inside the error handling: on a full disk (SQLITE_FULL) it is
        the statement that fails, and what the cache holds from the transaction is then not
        on disk, so the cache is dropped too."""
        if self._depth:  # re-entrant use under the RLock: the outer call commits
            yield
            return
        if self._db.in_transaction:  # pragma: no cover - only after a failed ROLLBACK
            self._rollback()
        self._depth += 1
        try:
            self._db.execute("BEGIN")
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        finally:
            self._depth -= 1

    def _rollback(self) -> None:
        """Undo the open transaction (SQLite may have undone it already) and drop the cache,
        which may hold rows of it; the caller raises the error that caused it."""
        self._cache.clear()
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def _load(self, rollout_id: str) -> Rollout | None:
        # every proxied call reads its rollout: decoded rows are cached (this store is the file's
        # only writer while open), bounded by clearing at ROLLOUT_CACHE entries
        rollout = self._cache.get(rollout_id)
        if rollout is not None:
            return rollout
        row = self._db.execute("SELECT body FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        return None if row is None else self._cached(Rollout.model_validate_json(row[0]))

    def _cached(self, rollout: Rollout) -> Rollout:
        if len(self._cache) >= self.ROLLOUT_CACHE:
            self._cache.clear()
        self._cache[rollout.rollout_id] = rollout
        return rollout

    def _load_many(self, rollout_ids: Sequence[str]) -> dict[str, Rollout]:
        out: dict[str, Rollout] = {}
        for chunk in _chunks(list(dict.fromkeys(rollout_ids)), 500):
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT rollout_id, body FROM rollouts WHERE rollout_id IN ({marks})"
            for rid, body in self._db.execute(sql, chunk):
                out[rid] = Rollout.model_validate_json(body)
        return out

    def _exists(self, rollout_id: str) -> bool:
        if rollout_id in self._cache:
            return True
        sql = "SELECT 1 FROM rollouts WHERE rollout_id=?"
        return self._db.execute(sql, (rollout_id,)).fetchone() is not None

    def _insert(self, rollout: Rollout) -> None:
        self._db.execute(
            "INSERT INTO rollouts (rollout_id, state, body) VALUES (?, ?, ?)",
            (rollout.rollout_id, rollout.status.state.value, rollout.model_dump_json()),
        )
        self._cached(rollout)

    def _insert_many(self, rollouts: Sequence[Rollout]) -> None:
        self._db.executemany(
            "INSERT INTO rollouts (rollout_id, state, body) VALUES (?, ?, ?)",
            ((r.rollout_id, r.status.state.value, r.model_dump_json()) for r in rollouts),
        )
        for rollout in rollouts:
            self._cached(rollout)

    def _replace(self, rollout: Rollout) -> None:
        self._db.execute(
            "UPDATE rollouts SET state=?, body=? WHERE rollout_id=?",
            (rollout.status.state.value, rollout.model_dump_json(), rollout.rollout_id),
        )
        self._cached(rollout)

    def _remove(self, rollout_id: str) -> None:
        self._cache.pop(rollout_id, None)
        self._db.execute("DELETE FROM rollouts WHERE rollout_id=?", (rollout_id,))
        self._db.execute("DELETE FROM events WHERE rollout_id=?", (rollout_id,))

    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]:
        marks = ",".join("?" * len(states))
        sql = f"SELECT body FROM rollouts WHERE state IN ({marks}) ORDER BY seq LIMIT ?"
        rows = self._db.execute(sql, [s.value for s in states] + [limit])
        return [Rollout.model_validate_json(body) for (body,) in rows]

    def _lock_queued(self, limit: int) -> list[Rollout]:
        # the store's lock plus the file's flock: no other connection can write these rows
        return self._list([RolloutState.QUEUING], limit)

    def _touch(self, rollout_ids: Sequence[str], now: float) -> None:
        self._activity.touch(rollout_ids, now)

    def _idle_running(self, before: float) -> list[str]:
        return self._activity.idle(self._list([RolloutState.RUNNING], 2**62), before)

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        pass  # `_append_event` encodes with dump_storable, which is the check

    def _append_event(self, event: Event) -> bool:
        # the hot path of every model call: one autocommitted INSERT (the rollout check hits the
        # cache); dump_storable is also the write-time check that the data can be read back
        if not self._exists(event.rollout_id):
            return False
        self._db.execute(
            "INSERT INTO events (rollout_id, attempt_id, event_type, timestamp, data) VALUES (?, ?, ?, ?, ?)",
            (event.rollout_id, event.attempt_id, event.event_type, event.timestamp,
             dump_storable(event.data, "data")))  # a BLOB: no decode to str and re-encode by sqlite3
        return True

    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]:
        sql = (
            "SELECT event_type, timestamp, data FROM events "
            "WHERE rollout_id=? AND attempt_id=? ORDER BY seq"
        )
        return [
            Event.model_construct(
                event_type=etype, rollout_id=rollout_id, attempt_id=attempt_id,
                timestamp=ts, data=_loads(data),
            )
            for etype, ts, data in self._db.execute(sql, (rollout_id, attempt_id))
        ]

    def _attempts(self, rollout_id: str) -> list[str]:
        sql = (
            "SELECT attempt_id, MIN(timestamp) AS t, MIN(seq) AS s FROM events "
            "WHERE rollout_id=? GROUP BY attempt_id ORDER BY t, s"
        )
        return [aid for aid, _, _ in self._db.execute(sql, (rollout_id,))]

    def _terminal_append(self, rollout_id: str) -> None:
        total = self._terminal_total()
        self._db.execute("INSERT INTO terminal_log (idx, rollout_id) VALUES (?, ?)", (total, rollout_id))

    def _terminal_trim(self) -> None:
        oldest_kept = self._terminal_total() - self.terminal_log_limit
        if oldest_kept > 0:
            self._db.execute("DELETE FROM terminal_log WHERE idx < ?", (oldest_kept,))

    def _terminal_total(self) -> int:
        (top,) = self._db.execute("SELECT MAX(idx) FROM terminal_log").fetchone()
        return 0 if top is None else top + 1  # the newest entry is never trimmed

    def _terminal_len(self) -> int:
        (n,) = self._db.execute("SELECT COUNT(*) FROM terminal_log").fetchone()
        return n

    def _terminal_slice(self, start: int, stop: int) -> list[str]:
        sql = (  # "" for an entry superseded by a later entry of the same id
            "SELECT CASE WHEN idx = (SELECT MAX(idx) FROM terminal_log l WHERE l.rollout_id = t.rollout_id) "
            "THEN rollout_id ELSE '' END FROM terminal_log t WHERE idx >= ? AND idx < ? ORDER BY idx"
        )
        return [rid for (rid,) in self._db.execute(sql, (start, stop))]

    def _put_model(self, model: Model) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO models (model, endpoint, version) VALUES (?, ?, ?)",
            (model.model, model.endpoint, model.version),
        )

    def _clear_models(self) -> None:
        self._db.execute("DELETE FROM models")

    def _models(self, model_name: str) -> list[Model]:
        sql = "SELECT model, endpoint, version FROM models WHERE model=?"
        return [Model(model=m, endpoint=e, version=v) for m, e, v in self._db.execute(sql, (model_name,))]


_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino) of the SQLite files this process's stores hold
_HELD_LOCK = threading.Lock()


class _FileLock:
    """An exclusive flock on the database file itself, plus the holder's pid in `<realpath>.lock`.

    The lock is on the file's identity (its inode), not on a name: a symlink or a hard link to
    the file is the same file. A second store in this process is refused by `_HELD` before the
    file is opened again, because closing a second descriptor of the file would drop the
    POSIX locks SQLite holds on it in this process.
    """

    def __init__(self, fd: int, ident: tuple[int, int]):
        self.fd, self.ident = fd, ident

    def close(self) -> None:
        with _HELD_LOCK:
            _HELD.discard(self.ident)
            os.close(self.fd)  # releases the flock


def _lock_exclusively(path: str) -> _FileLock | None:
    """Flock the database file (created if missing) exclusively; StoreLocked if another store
    holds it, through whatever name (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    real = os.path.realpath(path)
    with _HELD_LOCK:
        with contextlib.suppress(FileNotFoundError):
            stat = os.stat(real)
            if (stat.st_dev, stat.st_ino) in _HELD:
                raise _locked(path, real, str(os.getpid()))
        fd = os.open(real, os.O_RDWR | os.O_CREAT, 0o644)
        stat = os.fstat(fd)
        ident = (stat.st_dev, stat.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # no SQLite connection of this process is on the file (`_HELD`)
            raise _locked(path, real, _read_pid(real + ".lock")) from None
        _HELD.add(ident)
    with contextlib.suppress(OSError), open(real + ".lock", "w") as pid_file:  # for the refusal message
        pid_file.write(str(os.getpid()))
    return _FileLock(fd, ident)


def _read_pid(pid_path: str) -> str:
    try:
        with open(pid_path) as pid_file:
            return pid_file.read().strip() or "unknown"
    except OSError:
        return "unknown"


def _locked(path: str, real: str, holder: str) -> StoreLocked:
    same = "" if os.path.abspath(path) == real else f" (the file {real!r})"
    return StoreLocked(
        f"SQLite store {path!r}{same} is already open in another store or server process (pid {holder}); "
        f"stop that server, or give this one its own file (store: sqlite:///other.db)"
    )


def _check_creates(creates: Sequence[RolloutCreate]) -> None:
    """NotStorable naming `[i].field` for the first request the store could not read back."""
    for i, create in enumerate(creates):
        if create.rollout_id is not None:
            check_rollout_id(create.rollout_id, f"[{i}].rollout_id")
        check_storable(create.input, f"[{i}].input")
        metadata = create.metadata
        if metadata is not None and not isinstance(metadata, dict):
            metadata = metadata.model_dump()
        check_storable(metadata, f"[{i}].metadata")
        if create.config is not None:
            check_storable(create.config.model_dump(), f"[{i}].config")


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
