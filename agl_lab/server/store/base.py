"""The rollout store: the ledger of rollouts, their events, the model registry and the
terminal-order log.

One `Store` interface (this module), three backends chosen by URL
(`agl_lab.server.backends.open_store`), one module each in this package:

    "memory" | None          -> MemoryStore   (`memory.py`; default; lost when the process ends)
    "sqlite:///path/to.db"   -> SqliteStore   (`sqlite.py`; a restarted kernel re-attaches to it)
    "postgresql://..."       -> PostgresStore (`postgresql.py`; several server processes share it)

The semantics (AGL v1's data model, `agentlightning/schemas.py` and `server/store.py`) live
once, in the `Store` base class; a backend only implements storage primitives (`_load`,
`_insert`, `_append_event`, ...). So all backends answer every question identically, and the
tests run the same suite on each.

    rollouts   rollout_id -> Rollout                 (creation order kept)
    events     rollout_id -> attempt_id -> [Event]   (append-only; position is identity)
    models     model name -> endpoint -> Model       (upsert by (model, endpoint))
    terminal   [rollout_id]                          (appended on each terminal transition)

Design decisions:
- Thread-safe: every public method runs in a session (`with self._session()`, the backend's unit of
  work): the server's event loop and a notebook thread may use one store at once; each call is short.
  `OneProcessStore` (memory, SQLite) makes the session a re-entrant mutex; PostgreSQL's binds a pooled
  connection and excludes nothing: its transactions and row locks do (`postgresql.py`).
- The terminal log is bounded (`terminal_log_limit`): cursor indices stay absolute, entries
  older than the retained window are gone, and a cursor behind the window restarts at the
  oldest retained entry. `total_terminal` is the absolute count of terminal transitions.
- No HTTP here: errors are `RolloutNotFound` / `InvalidTransition` / `NotStorable`, mapped to
  404 / 409 / 422 by `agl_lab.server.app`; a second opener of a SQLite file gets `StoreLocked`.
- Write-time rule (`agl_lab.server.storable`): what is stored can be read back and sent, on
  every backend. The triplet view the app serves (`triplet_events`) is a pure function
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
  cache on memory and SQLite (PostgreSQL reads the table: another process may have registered
  endpoints): its `Model`s are shared too (the list is the caller's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
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
from agl_lab.server.store.errors import (  # noqa: F401 (re-export: the store's errors, as before)
    EventIdReused,
    InvalidTransition,
    RolloutNotFound,
    StoreError,
    StoreLocked,
    StoreUnavailable,
)

try:  # orjson reads the event payloads the backends store ~5x faster (writes: dump_storable)
    import orjson

    load_stored = orjson.loads
except ImportError:  # pragma: no cover - orjson is optional
    load_stored = json.loads

DEFAULT_TERMINAL_LOG_LIMIT = 100_000
CLAIMER_WINDOW_SECONDS = 30.0  # a runner that claimed (or polled) this recently shares the queue
log = logging.getLogger("agl_lab.server.store")


class ReusedAttempt(InvalidTransition):
    """A PATCH to running that would run a re-queued rollout under an attempt id it ran already
    (AGL clients always claim attempt "0"): 409, so attempts stay bounded by max_attempts."""

    def __init__(self, rollout: Rollout, attempt_id: str):
        ValueError.__init__(
            self,
            f"Rollout {rollout.rollout_id}: attempt {attempt_id} already ran (the rollout was "
            f"re-queued); claim it as attempt {next_attempt_id(rollout.status.last_attempt_id)} "
            f"(last_attempt_id) or through POST /api/rollouts/claim",
        )
        self.rollout_id, self.current, self.target = rollout.rollout_id, rollout.status.state, RolloutState.RUNNING


class StaleAttempt(StoreError, ValueError):
    """A patch conditioned on an attempt the rollout no longer runs (409, like InvalidTransition)."""

    def __init__(self, rollout: Rollout, attempt_id: str):
        live = rollout.status.last_attempt_id or DEFAULT_ATTEMPT_ID
        super().__init__(
            f"Rollout {rollout.rollout_id}: attempt {attempt_id} is not running (the rollout is "
            f"{rollout.status.state.value}, attempt {live}); its lease expired or it was released"
        )
        self.rollout_id, self.attempt_id = rollout.rollout_id, attempt_id


def event_digest(event_type: str, data: dict[str, Any] | None) -> str:
    """What a client-made event id stands for: a hash of the type and data (key order ignored)."""
    check_storable(data, "data", nul_ok=True)  # JSON that json.dumps encodes (and the stores accept)
    text = json.dumps([event_type, data or {}], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


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
    # May a call wait on I/O? Then the event loop calls it in a worker thread (gateway.store_call).
    BLOCKING = True

    def __init__(self, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        if int(terminal_log_limit) < 1:
            raise ValueError(
                f"terminal_log_limit must be >= 1, got {terminal_log_limit}: "
                f"set it to the number of terminal ids a client may lag behind (default "
                f"{DEFAULT_TERMINAL_LOG_LIMIT})"
            )
        self.terminal_log_limit = int(terminal_log_limit)
        self._pools: dict[str, tuple[Model, ...]] = {}  # models_for's answers, dropped on any model write
        self._claimers: dict[str, float] = {}  # runner id -> when it last claimed (`_recent_claimers`)

    # --- rollouts ---------------------------------------------------------------------------

    def create_rollouts(self, creates: Sequence[RolloutCreate]) -> list[Rollout]:
        """Create rollouts in order; a client id that exists returns the existing rollout.

        All or nothing: the batch is one transaction, so a refused write (a full disk) or a
        killed server stores none of it. The rollouts are built before the session opens; it is
        held only for the id lookup and the inserts.

        Raises NotStorable (and stores none of them) when any request breaks the storable
        rule (`agl_lab.server.storable`) or names an invalid rollout id.
        """
        _check_creates(creates)
        now = self._clock()
        built = [create.to_rollout(now) for create in creates]
        client_ids = [create.rollout_id for create in creates if create.rollout_id]
        with self._session(), self._transaction():
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
            if new:
                self._notify_queued()
        return out

    def get_rollout(self, rollout_id: str) -> Rollout | None:
        with self._session():
            return self._load(rollout_id)

    def list_rollouts(self, states: Iterable[RolloutState | str], limit: int = 500) -> list[Rollout]:
        """Rollouts whose state is in `states`, in creation order, at most `limit`."""
        wanted = [RolloutState(s) for s in states]
        if limit <= 0 or not wanted:
            return []
        with self._session():
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
        with self._session(), self._transaction():
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
            now = self._clock()
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
        with self._session(), self._transaction():
            self._remove(rollout_id)

    # --- events -----------------------------------------------------------------------------

    def append_event(
        self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any] | None = None, *, event_id=None
    ) -> Event:
        """Append one event (timestamped now) under (rollout, attempt); RolloutNotFound if unknown.

        `event_id` (client-made, str) makes it idempotent: an id already stored under (rollout, attempt)
        with the same type and data stores nothing, so a resend after a lost answer or a 503 is recorded
        once; with other content, EventIdReused (409). Ids live as long as the rollout."""
        if data is not None and not isinstance(data, dict):
            raise TypeError(f"event data must be a dict, got {type(data).__name__}")
        check_storable([rollout_id, attempt_id, event_type, event_id or ""], "event ids")
        self._check_event_data(data)
        digest = "" if event_id is None else event_digest(event_type, data)
        with self._session():
            event = Event.model_construct(
                event_type=event_type,
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                timestamp=self._clock(),
                data={} if data is None else data,
            )
            stored = self._append_event(event, event_id, digest)
            if stored is None:
                raise RolloutNotFound(rollout_id)
            if stored not in (digest, ""):  # "": an id stored before digests were kept (any content)
                raise EventIdReused(rollout_id, attempt_id, event_id)
            rollout = self._load(rollout_id) if self.TOUCH_ON_EVENT else None  # an event of the running
            if rollout is not None and _runs_attempt(rollout, attempt_id):  # attempt renews its lease, a late
                self._touch([rollout_id], event.timestamp)  # one of an old attempt does not
            return event

    def events(self, rollout_id: str, *, event_type: str | None = None, attempt_id: str | None = None) -> list[Event]:
        """Events of one attempt in insertion order (default: `last_attempt_id or "0"`)."""
        with self._session():
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
        with self._session():
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

        Fair share: while several runners claim (`_recent_claimers`, across servers), one claim takes
        at most ceil(queued / claimers), at least 1: no runner takes the whole queue from the others.
        """
        if limit < 1:
            return []
        now = self._clock()
        with self._session(), self._transaction():
            claimers = self._recent_claimers(runner_id, now)
            if claimers > 1 and limit > 1:
                limit = min(limit, max(1, -(-self._count_queued() // claimers)))
            claimed = []
            for rollout in self._lock_queued(limit):
                rollout = _with_status(
                    rollout,
                    now,
                    state=RolloutState.RUNNING,
                    error_message=None,
                    last_attempt_id=next_attempt_id(rollout.status.last_attempt_id),
                )
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
        now = self._clock()
        released = []
        with self._session(), self._transaction():
            rollouts = self._load_many(list(attempts))
            for rid, attempt_id in attempts.items():
                rollout = rollouts.get(rid)
                if rollout is None or not _runs_attempt(rollout, attempt_id):
                    continue
                message = f"attempt {attempt_id} released ({reason}); re-queued"
                self._replace(
                    _with_status(
                        rollout, now, state=RolloutState.QUEUING, error_message=message, last_attempt_id=attempt_id
                    )
                )  # the next claim: attempt + 1
                released.append(rid)
            if released:
                self._notify_queued()
        return released

    def heartbeat(self, rollout_ids: Sequence[str], attempt_ids: Sequence[str] | None = None) -> list[str]:
        """Renew the lease of each running rollout in `rollout_ids`; returns the ids that are
        not running (unknown, queuing or terminal) so the runner can stop their agents.

        With `attempt_ids` (parallel to `rollout_ids`), a rollout counts as running only while
        it runs that attempt: the runner of a re-queued attempt learns to stop its agent.
        """
        if attempt_ids is not None and len(attempt_ids) != len(rollout_ids):
            raise ValueError(
                f"attempt_ids has {len(attempt_ids)} items for {len(rollout_ids)} rollout_ids: "
                "give one attempt id per rollout id, or none"
            )
        now = self._clock()
        with self._session():
            rollouts = self._load_many(list(rollout_ids))
            live, not_running = [], []
            for i, rid in enumerate(rollout_ids):
                rollout = rollouts.get(rid)
                attempt = None if attempt_ids is None else attempt_ids[i]
                if (
                    rollout is not None
                    and rollout.status.state == RolloutState.RUNNING
                    and (attempt is None or _runs_attempt(rollout, attempt))
                ):
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
        now = self._clock() if now is None else now
        outcome: dict[str, str] = {}
        with self._session(), self._transaction():
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
                why = (
                    f"attempt {attempt}: lease expired (no heartbeat, event or status change for "
                    f"{lease_seconds:g}s, lease_seconds={lease_seconds:g}); its runner stopped or lost the network"
                )
                if used < max_attempts:
                    message = f"{why}; re-queued as attempt {next_attempt_id(attempt)} of max_attempts={max_attempts}"
                    self._replace(
                        _with_status(
                            rollout, now, state=RolloutState.QUEUING, error_message=message, last_attempt_id=attempt
                        )
                    )  # the next claim: attempt + 1
                    outcome[rid] = "requeued"
                else:
                    message = f"{why}; failed after {used} attempt(s) (max_attempts={max_attempts})"
                    self._replace(_with_status(rollout, now, state=RolloutState.FAILED, error_message=message))
                    self._terminal_append(rid)
                    self._terminal_trim()
                    outcome[rid] = "failed"
            if "requeued" in outcome.values():
                self._notify_queued()
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
        with self._session():
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
        with self._session():
            try:
                with self._transaction():
                    for model in models:
                        self._put_model(model)
            finally:
                self._pools = {}
        return list(models)

    def clear_models(self, model_name: str | None = None) -> None:
        """Forget the endpoints of `model_name` (None: of every model)."""
        with self._session():
            try:
                with self._transaction():
                    self._clear_models(model_name)
            finally:
                self._pools = {}

    def models_for(self, model_name: str) -> list[Model]:
        """The endpoints registered for `model_name`, sorted by endpoint string.

        Every proxied call asks, so the answer is kept until the next model write (a plain
        dict read: the gateway's loop opens no session on a hit).
        """
        pool = self._pools.get(model_name)
        if pool is None:
            with self._session():
                pool = tuple(sorted(self._models(model_name), key=lambda m: m.endpoint))
                self._pools[model_name] = pool
        return list(pool)

    def _recent_claimers(self, runner_id: str, now: float) -> int:
        """Runners that claimed within CLAIMER_WINDOW_SECONDS, this one counted (anonymous: one more);
        in-process here (one server per store), across servers on PostgreSQL (`pg_servers.py`)."""
        if runner_id:
            self._claimers[runner_id] = now
        if len(self._claimers) > 1:
            self._claimers = {r: at for r, at in self._claimers.items() if at > now - CLAIMER_WINDOW_SECONDS}
        return len(self._claimers) + (0 if runner_id else 1)

    def _count_queued(self) -> int:
        """The number of queuing rollouts (a claim's fair share); called in the claim's transaction."""
        return len(self._list([RolloutState.QUEUING], 2**62))

    def _notify_queued(self) -> None:  # noqa: B027 (optional: one process per store has QueueSignal)
        """Rollouts became claimable: wake other servers' claims (PostgreSQL: NOTIFY). In the write's transaction."""

    def _clock(self) -> float:
        """Now (epoch seconds) for status changes, events, leases: this host's (PostgreSQL: the database's)."""
        return time.time()

    def close(self) -> None:  # noqa: B027 (optional: the in-memory store holds nothing)
        """Release resources (SQLite connection); the in-memory store has none."""

    # --- write-time checks (one rule for every backend: what is stored reads back) ----------

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        """NotStorable unless `data` encodes (a backend that encodes on write checks while encoding instead)."""
        if data:
            dump_storable(data, "data")

    # --- backend primitives (called inside the session) -------------------------------------

    @abstractmethod
    def _session(self) -> contextlib.AbstractContextManager[Any]:
        """The unit of work a public method runs its primitives in (re-entrant). A store one process
        owns excludes here (a mutex); one that processes share excludes in `_transaction` (PostgreSQL)."""

    def _transaction(self) -> contextlib.AbstractContextManager[Any]:
        """One write transaction inside the session: all of its writes or none (default: none needed)."""
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

        Called inside `self._transaction()` (in the session); the caller then
        `_replace`s each with its running status in the same transaction. Locked means no
        concurrent transaction can return or change the same rows until this one ends:
        another thread (`OneProcessStore`'s session, a mutex, does that), or another process sharing the
        database (PostgreSQL: `SELECT ... WHERE state='queuing' ORDER BY seq LIMIT $1 FOR
        UPDATE SKIP LOCKED`, so concurrent claimers get disjoint sets and never wait on each
        other). Memory and SQLite have one process per store (the SQLite file is flocked).
        """

    @abstractmethod
    def _touch(self, rollout_ids: Sequence[str], now: float) -> None:
        """Record activity at `now` (a heartbeat, an event of the running attempt, a claim or
        status change) for each id; unknown ids are ignored. Called in the session, inside or
        outside a transaction."""

    @abstractmethod
    def _idle_running(self, before: float) -> list[str]:
        """Ids of running rollouts whose last activity (the latest `_touch`, else
        `status.updated_at`) is older than `before`, in creation order.

        Called inside `self._transaction()`, because the caller re-queues or fails each in the
        same transaction: `expire_leases` then locks them (`_load_many`) and asks again, so a
        backend shared by several processes may answer from a plain read (PostgreSQL does)."""

    @abstractmethod
    def _append_event(self, event: Event, event_id: str | None = None, digest: str = "") -> str | None:
        """Append if the rollout exists (atomically); None if it does not, else the digest stored
        with `event_id`. With `event_id`: append and remember (id, digest) unless (rollout, attempt,
        id) is remembered already (then append nothing and return the digest remembered),
        atomically with respect to a concurrent append of the same id. Without: return `digest` ("")."""

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
    def _clear_models(self, model_name: str | None) -> None: ...

    @abstractmethod
    def _models(self, model_name: str) -> list[Model]: ...


class OneProcessStore(Store):
    """A `Store` one process owns (MemoryStore; SqliteStore, whose file is flocked). Its session is a
    re-entrant mutex: no two threads (the server's event loop, a notebook thread) run primitives at
    once, which makes `_lock_queued`'s rows and every read-modify-write exclusive. Lease activity is
    kept in memory (no write per heartbeat or event): after a restart a running rollout's lease runs
    from its last status change (`status.updated_at`, which SQLite persists), so a restarted server
    re-queues the rollouts of runners that died with it one lease later, never at once."""

    def __init__(self, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        super().__init__(terminal_log_limit)
        self._mutex = threading.RLock()
        self._active_at: dict[str, float] = {}  # running rollout id -> last heartbeat / event / claim

    def _session(self) -> threading.RLock:
        return self._mutex

    def _touch(self, rollout_ids: Sequence[str], now: float) -> None:
        for rid in rollout_ids:
            self._active_at[rid] = now

    def _idle_running(self, before: float) -> list[str]:
        running, known = self._list([RolloutState.RUNNING], 2**62), self._active_at
        self._active_at = {r.rollout_id: known[r.rollout_id] for r in running if r.rollout_id in known}  # what runs
        return [r.rollout_id for r in running if max(r.status.updated_at, known.get(r.rollout_id, 0.0)) < before]


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
