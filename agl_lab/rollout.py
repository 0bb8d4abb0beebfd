"""Rollout phase over HTTP: the managers that enqueue rollouts and collect them.

What a collected rollout becomes (`Triplet`, `CompletedRollout`, events -> completed rollout,
lifecycle metrics) is pure and lives in `agl_lab.records`; this module is the I/O around it.

`SyncRolloutManager` enqueues `n` rollouts per task and waits for all of them;
`AsyncRolloutManager` keeps `async_train_batch_size` groups in flight and hands out
`train_batch_size` whole groups per step, carrying the rest over. Both wait on the server's
terminal cursor (one request per poll, not one per rollout), process each terminal rollout
exactly once (hook -> events -> CompletedRollout -> DELETE), and bound the wait with an
error that names the unfinished rollouts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agl_lab.client import RolloutWaitTimeout
from agl_lab.hooks import BufferedTraceWriter, RolloutHooks
from agl_lab.protocol import (
    Event,
    Rollout,
    RolloutConfig,
    RolloutCreate,
    RolloutState,
)
from agl_lab.records import (
    CompletedRollout,
    completed_rollout_from_dict,
    completed_rollout_to_dict,
    critical_path_metrics,
    events_to_completed_rollout,
    lifecycle_metrics,
)
from agl_lab.records import triplet_events as records_triplet_events
from agl_lab.rules import check_async_sizes

if TYPE_CHECKING:
    from agl_lab.client import AglClient

logger = logging.getLogger(__name__)
# One completion check waits on the server this long at most (a long poll answered early at each
# rollout state change); it also bounds how late the wait's own timeout is noticed.
TERMINAL_WAIT_SECONDS = 5.0
RUNNING_LOOK_SECONDS = 0.25  # the longest wait while a pending rollout has not been seen running


# =============================================================================================
# Shared core: enqueue, wait on the terminal cursor, collect each rollout once
# =============================================================================================


@dataclass
class _Entry:
    """A rollout the manager enqueued and has not collected yet."""

    rollout_id: str
    data_id: str
    step: int
    sample_idx: int
    copy_idx: int
    enqueue_time: float
    enqueue_policy_version: int | None = None
    running_at: float | None = None  # server `updated_at` when first seen running


def _as_rollout_config(config: RolloutConfig | Mapping[str, Any] | None) -> RolloutConfig:
    if config is None:
        return RolloutConfig()
    if isinstance(config, RolloutConfig):
        return config
    return RolloutConfig.model_validate(dict(config))


def _check_n(n: int) -> int:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (actor_rollout_ref.rollout.n, rollouts per task) must be an int >= 1, got {n!r}")
    return n


def _make_requests(
    tasks: Sequence[Mapping[str, Any]],
    *,
    n: int,
    is_train: bool,
    config: RolloutConfig,
    step: int,
    hooks: RolloutHooks | None = None,
    policy_version: int | None = None,
) -> list[tuple[_Entry, RolloutCreate]]:
    """`n` rollout requests per task, each with a fresh group key `data_id` per task.

    `input` = the task as sent (AGL v1: a task's own `data_id` field stays intact); the group
    key goes to `metadata.group_id`. `hooks.on_enqueue` runs before the id is assigned
    (so a hook cannot break idempotent creation); ids are `uuid4().hex`.
    """
    out = []
    for sample_idx, task in enumerate(tasks):
        if not isinstance(task, Mapping):
            raise TypeError(f"task {sample_idx} must be a dict (a dataset row), got {type(task).__name__}")
        data_id = str(uuid.uuid4())
        for copy_idx in range(n):
            request = RolloutCreate(
                input=dict(task),
                is_train=is_train,
                config=config,
                metadata={
                    "batch_idx": step,
                    "sample_idx_in_batch": sample_idx,
                    "copy_idx": copy_idx,
                    "group_id": data_id,
                },
            )
            if hooks is not None:
                request = hooks.on_enqueue(request)
                if not isinstance(request, RolloutCreate):
                    raise TypeError(
                        f"{type(hooks).__name__}.on_enqueue must return a RolloutCreate, got {type(request).__name__}"
                    )
            request = request.model_copy(update={"rollout_id": uuid.uuid4().hex})
            entry = _Entry(request.rollout_id, data_id, step, sample_idx, copy_idx, time.time(), policy_version)
            out.append((entry, request))
    return out


def _events_by_attempt(rollout: Rollout, raw_events: Sequence[Mapping[str, Any]]) -> dict[str, list[Event]]:
    grouped: dict[str, list[Event]] = {}
    for e in raw_events:
        event = Event.model_validate(e)
        grouped.setdefault(event.attempt_id, []).append(event)
    return grouped or {rollout.status.last_attempt_id or "unknown": []}


def count_repeated_prompts(
    completed: CompletedRollout, every_call: Sequence[Mapping[str, Any]], triplet_events: Sequence[Mapping[str, Any]]
) -> int:
    """Calls the triplet view dropped because they repeated an identical prompt (AGL v1 keeps the
    last call per prompt): the kept triplet of such a prompt gets `metadata["repeats_dropped"]`
    (a column of `ro.triplets`), the rollout `metadata["n_repeated_prompt_calls_dropped"]`
    (summed into `training/n_repeated_prompt_calls_dropped`; `dry_run` prints it)."""

    def counts(events: Sequence[Mapping[str, Any]]) -> Counter:
        return Counter(
            tuple((e.get("data") or {}).get("prompt_token_ids") or ())
            for e in events
            if e.get("event_type") == "model_request"
        )

    everything, kept = counts(every_call), counts(triplet_events)
    repeats = {k: n - kept[k] for k, n in everything.items() if n > kept[k]}
    for t in (t for t in completed.triplets if tuple(t.prompt_ids) in repeats):
        t.metadata["repeats_dropped"] = repeats[tuple(t.prompt_ids)]
    if repeats:
        completed.metadata["n_repeated_prompt_calls_dropped"] = sum(repeats.values())
    return sum(repeats.values())


class _Collector:
    """Shared core: follow the terminal cursor and turn each terminal rollout into a result.

    One poll = one `GET /api/rollouts/terminal` (plus, while some pending rollout has not
    been seen running, one `GET /api/rollouts?state_in=running` for the running timestamp).
    A poll is a long poll (`TERMINAL_WAIT_SECONDS`): an agl_lab server answers at the first
    rollout state change (claimed, patched, expired), so polls follow changes, not a clock;
    an AGL server answers at once and the loop keeps `poll_interval` between polls.
    """

    def __init__(
        self,
        client: AglClient,
        hooks: RolloutHooks | None,
        *,
        label: str,
        timeout: float | None,
        poll_interval: float,
        track_running: bool,
        keep_repeated_prompts: bool = False,
    ):
        self.client, self.hooks = client, hooks
        self.label = label  # the manager's name, in logs and errors
        self.timeout = timeout  # bound on one `wait` (None: unbounded)
        self.keep_repeated_prompts = keep_repeated_prompts  # else the server's triplet view (AGL: last per prompt)
        self.poll_interval, self.track_running = poll_interval, track_running
        self.cursor: int | None = None
        self.pending: dict[str, _Entry] = {}
        self.n_hook_errors = 0
        self.n_build_errors = 0  # rollouts whose events could not be built (kept in the store)

    def start(self) -> None:
        """Place the cursor before creating rollouts (kept while rollouts are pending)."""
        total = self.client.terminal_page(after=0, limit=1).total_terminal
        if not self.pending or self.cursor is None:
            self.cursor = total
        elif self.cursor > total:
            logger.warning(
                "terminal log has %d entries but the cursor is at %d (server restarted?); re-reading the log from 0",
                total,
                self.cursor,
            )
            self.cursor = 0

    def submit(self, pairs: Sequence[tuple[_Entry, RolloutCreate]]) -> None:
        if not pairs:
            return
        self.client.create_rollouts([request for _, request in pairs])
        self.pending.update({entry.rollout_id: entry for entry, _ in pairs})

    # -- polling ----------------------------------------------------------------------------

    def poll(self, wait_seconds: float = 0.0) -> list[CompletedRollout]:
        """One poll: collect every pending rollout the terminal log reports since the cursor.

        While a pending rollout has not been seen running, the wait is at most
        `RUNNING_LOOK_SECONDS`: a rollout claimed between two polls wakes no wait, and a long one
        would see it only once finished (its run time 0 in `ro.lifecycle`)."""
        if self.track_running and any(e.running_at is None for e in self.pending.values()):
            wait_seconds = min(wait_seconds, RUNNING_LOOK_SECONDS)
        items, self.cursor = self.client.poll_terminal(self.pending, self.cursor or 0, wait_seconds)
        if self.track_running and any(e.running_at is None for e in self.pending.values()):
            self._observe_running()
        collected = []
        for item in items:
            entry = self.pending.get(item.rollout_id)
            if entry is not None and (completed := self._collect(entry)) is not None:
                collected.append(completed)
        return collected

    def _observe_running(self) -> None:
        limit = max(500, 2 * len(self.pending))
        for rollout in self.client.list_rollouts([RolloutState.RUNNING], limit=limit):
            entry = self.pending.get(rollout.rollout_id)
            if entry is not None and entry.running_at is None:
                entry.running_at = rollout.status.updated_at

    def wait(
        self,
        done: Callable[[], bool],
        on_collected: Callable[[CompletedRollout], None],
        *,
        n_collected: Callable[[], int],
        n_total: int,
    ) -> dict[str, str]:
        """Poll, handing each collected rollout to `on_collected`, until `done()`; returns {} then.

        After `self.timeout` s the rollouts still pending are dropped: deleted from the store
        (their runners stop their agents, the gateway refuses their calls) and returned as
        {rollout id: state it had}, so the step trains what finished. `RolloutWaitTimeout`
        naming them (of `n_total` the step waits on) only when the step holds nothing
        (`n_collected() == 0`): there is nothing to train."""
        timeout, label = self.timeout, self.label
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = time.monotonic()
            wait_s = TERMINAL_WAIT_SECONDS if deadline is None else min(TERMINAL_WAIT_SECONDS, deadline - started)
            for completed in self.poll(max(0.0, wait_s)):
                on_collected(completed)
            if done():
                return {}
            if deadline is not None and time.monotonic() >= deadline:
                unfinished = set(self.pending)
                states = self.client.states_of(unfinished)
                if n_collected() == 0:
                    # fail them so no runner starts them for nobody; collected as FAILED by a later poll
                    self.client.fail_rollouts(
                        sorted(unfinished), f"{label}: the trainer's wait for this rollout timed out after {timeout:g}s"
                    )
                    raise RolloutWaitTimeout(timeout, states, n_total)
                for rid in sorted(unfinished):
                    self.client.delete_rollout(rid)
                    self.pending.pop(rid, None)
                return {rid: states.get(rid, "unknown") for rid in unfinished}
            logger.debug("%s: %d rollouts pending", label, len(self.pending))
            time.sleep(max(0.0, self.poll_interval - (time.monotonic() - started)))  # at most one poll per interval

    # -- collecting one rollout ------------------------------------------------------------

    def _collect(self, entry: _Entry) -> CompletedRollout | None:
        """Hook -> events -> CompletedRollout -> DELETE, exactly once per rollout."""
        rollout, _ = self.client.get_rollout(entry.rollout_id)
        if not rollout.is_terminal:  # the id was deleted and re-created by someone else
            return None
        del self.pending[entry.rollout_id]
        # Server-authoritative timestamps; a rollout never seen running gets the terminal
        # time as its running time (AGL v1 rule for polls that skip straight to terminal).
        finished_at = rollout.status.updated_at
        running_at = entry.running_at if entry.running_at is not None else finished_at
        raw_events = self.client.get_events(rollout.rollout_id)
        n_written, hook_error = self._run_hook(rollout, raw_events)
        if n_written:  # the hook's events belong to the rollout's record too
            raw_events = self.client.get_events(rollout.rollout_id)
        every_call = [
            e.model_dump(mode="json")
            for e in records_triplet_events(  # trimmed, no call dropped
                [Event.model_validate(e) for e in raw_events], keep_repeated_prompts=True
            )
        ]
        triplet_events = (
            every_call if self.keep_repeated_prompts else self.client.get_events(rollout.rollout_id, fmt="triplet")
        )
        timing = dict(
            data_id=entry.data_id,
            step=entry.step,
            sample_idx=entry.sample_idx,
            copy_idx=entry.copy_idx,
            enqueue_time=entry.enqueue_time,
            running_at=running_at,
            finished_at=finished_at,
            enqueue_policy_version=entry.enqueue_policy_version,
        )
        try:
            completed = events_to_completed_rollout(rollout, raw_events, triplet_events, **timing)
        except Exception as exc:  # never lose the step: keep the rollout in the store, count it failed
            self.n_build_errors += 1
            reason = f"building the completed rollout failed: {type(exc).__name__}: {exc}"
            logger.error("rollout %s: %s (kept in the store for inspection)", rollout.rollout_id, reason)
            completed = events_to_completed_rollout(rollout, [], [], **timing)
            completed.state, completed.error_message = RolloutState.FAILED.value, reason
            completed.metadata["build_error"] = reason
            return completed
        if hook_error is not None:
            completed.metadata["hook_error"] = hook_error
        attempt = rollout.status.last_attempt_id or "0"
        if attempt != "0":  # re-run after its runner died or stopped: only this attempt's events were read
            completed.metadata["attempt_id"] = attempt
        count_repeated_prompts(completed, every_call, triplet_events)
        self.client.delete_rollout(rollout.rollout_id)  # read in full: bound the store by what is in flight
        return completed

    def _run_hook(self, rollout: Rollout, raw_events: list[dict[str, Any]]) -> tuple[int, str | None]:
        """Run on_succeeded/on_failed; flush its buffered events only if it returned."""
        if self.hooks is None:
            return 0, None
        writer = BufferedTraceWriter()
        succeeded = rollout.status.state == RolloutState.SUCCEEDED
        name = "on_succeeded" if succeeded else "on_failed"
        try:
            if succeeded:
                self.hooks.on_succeeded(rollout, _events_by_attempt(rollout, raw_events), writer)
            else:
                self.hooks.on_failed(rollout, writer)
        except Exception as exc:  # user code: report, drop its events, keep training
            return 0, self._hook_failed(name, rollout.rollout_id, exc, "its buffered events were dropped")
        try:
            return writer.flush(self.client), None
        except Exception as exc:
            return 1, self._hook_failed(name, rollout.rollout_id, exc, "writing its events failed")

    def _hook_failed(self, name: str, rollout_id: str, exc: Exception, consequence: str) -> str:
        self.n_hook_errors += 1
        message = f"RolloutManager: {name} hook failed for rollout {rollout_id}"
        logger.error(message, exc_info=exc)
        warnings.warn(f"{message}: {type(exc).__name__}: {exc} ({consequence})", RuntimeWarning, stacklevel=3)
        return f"{name}: {type(exc).__name__}: {exc}"


def report_wait_timeout(
    label: str, dropped: Mapping[str, str], n_kept: int, timeout: float | None, is_train: bool = True
) -> dict[str, float]:
    """The metric and the warning of a wait that timed out but kept what finished:
    `training/n_wait_timeout_dropped_rollouts` (`val/…`), 0 when nothing was dropped."""
    prefix = "training" if is_train else "val"
    if dropped:
        states = ", ".join(f"{n} {state}" for state, n in sorted(Counter(dropped.values()).items()))
        message = (
            f"{label}: the rollout wait timed out after {timeout:g}s; training on the {n_kept} rollouts that "
            f"finished and dropping {len(dropped)} unfinished ({states}; deleted from the store); raise "
            f"agl_lab.rollout.wait_timeout_seconds (now {timeout:g}) if they were still making progress"
        )
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return {f"{prefix}/n_wait_timeout_dropped_rollouts": float(len(dropped))}


def _progress(label: str, collected: Sequence[CompletedRollout], total: int) -> None:
    n_failed = sum(c.state == RolloutState.FAILED.value for c in collected)
    logger.info(
        "%s: completed=%d/%d succeeded=%d failed=%d",
        label,
        len(collected),
        total,
        len(collected) - n_failed,
        n_failed,
    )


class SyncRolloutManager:
    """Enqueue `n` rollouts per task (1 for validation) and wait for every one of them.

    Args:
        client: an `AglClient` of the server.
        n: rollouts per task for training (`actor_rollout_ref.rollout.n`).
        step: trainer step recorded on every rollout (`CompletedRollout.step`).
        rollout_config: `RolloutConfig` (or its dict) copied into every rollout.
        hooks: optional `RolloutHooks`.
        timeout_seconds: bound on one `run`'s wait (None = unbounded); on expiry the
            unfinished rollouts are dropped (deleted: no runner runs them later) and `run`
            returns the ones that finished, with `n_wait_timeout_dropped_rollouts` in
            `metrics` and a warning; `RolloutWaitTimeout` names them when none finished.
        poll_interval: seconds between polls of the terminal cursor.
        track_running: also poll the running list to record when each rollout started.
    """

    label = "SyncRolloutManager"

    def __init__(
        self,
        client: AglClient,
        *,
        n: int,
        step: int,
        rollout_config: RolloutConfig | Mapping[str, Any] | None,
        hooks: RolloutHooks | None = None,
        timeout_seconds: float | None = None,
        poll_interval: float = 0.2,
        track_running: bool = True,
        keep_repeated_prompts: bool = False,
    ):
        self.n, self.step = _check_n(n), step
        self.rollout_config = _as_rollout_config(rollout_config)
        self._collector = _Collector(
            client,
            hooks,
            label=self.label,
            timeout=timeout_seconds,
            poll_interval=poll_interval,
            track_running=track_running,
            keep_repeated_prompts=keep_repeated_prompts,
        )

    @property
    def timeout_seconds(self) -> float | None:
        return self._collector.timeout

    @property
    def n_hook_errors(self) -> int:
        return self._collector.n_hook_errors

    def run(
        self, tasks: Sequence[Mapping[str, Any]], is_train: bool, metrics: dict[str, Any] | None = None
    ) -> list[CompletedRollout]:
        """Run one rollout phase; return completed rollouts in (sample_idx, copy) order.

        `metrics` (optional) receives `training/n_wait_timeout_dropped_rollouts` (`val/…`)."""
        collector = self._collector
        collector.pending.clear()  # a timed-out earlier run is abandoned, not waited for
        collector.start()
        pairs = _make_requests(
            tasks,
            n=self.n if is_train else 1,
            is_train=is_train,
            config=self.rollout_config,
            step=self.step,
            hooks=collector.hooks,
        )
        collector.submit(pairs)
        collected: list[CompletedRollout] = []

        def on_collected(completed: CompletedRollout) -> None:
            collected.append(completed)
            _progress(self.label, collected, len(pairs))

        dropped = collector.wait(
            lambda: not collector.pending, on_collected, n_collected=lambda: len(collected), n_total=len(pairs)
        )
        wait_metrics = report_wait_timeout(self.label, dropped, len(collected), self.timeout_seconds, is_train)
        if metrics is not None:
            metrics.update(wait_metrics)
        order = {entry.rollout_id: i for i, (entry, _) in enumerate(pairs)}
        return sorted(collected, key=lambda c: order[c.rollout_id])


# ---------------------------------------------------------------------------------------------
# Async: keep `async_train_batch_size` groups in flight, train on `train_batch_size` per step
# ---------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """One task's `n` rollouts; complete when every member is terminal (FAILED counts)."""

    data_id: str
    step: int
    sample_idx: int
    policy_version: int | None
    rollout_ids: list[str]
    finished: dict[str, CompletedRollout] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.rollout_ids)

    def members(self) -> list[CompletedRollout]:
        return [self.finished[rid] for rid in self.rollout_ids]


class AsyncRolloutManager:
    """Carry-over rollout collection: train on the first groups to finish, keep the rest.

    `async_train_batch_size` groups are in flight at all times; each `run` tops them up with
    new tasks (`n_new_tasks_needed()`), waits until `train_batch_size` groups are complete,
    returns the oldest `train_batch_size` complete groups and carries every other group over
    intact. A member that finished early is collected (hook run, rollout deleted) at once
    and kept in memory, so its hook runs exactly once however long its group is carried.

    Long-lived: create one per training run; `state_dict()`/`load_state_dict()` checkpoint
    the carry-over (group bookkeeping, finished members, pending ids, terminal cursor).
    """

    label = "AsyncRolloutManager"

    def __init__(
        self,
        client: AglClient,
        *,
        n: int,
        train_batch_size: int,
        async_train_batch_size: int | None,
        rollout_config: RolloutConfig | Mapping[str, Any] | None,
        hooks: RolloutHooks | None = None,
        timeout_seconds: float | None = None,
        poll_interval: float = 0.2,
        track_running: bool = True,
        keep_repeated_prompts: bool = False,
        max_staleness: int = 0,
    ):
        check_async_sizes(train_batch_size, async_train_batch_size, max_staleness)
        self.n = _check_n(n)
        self.train_batch_size, self.async_train_batch_size = train_batch_size, async_train_batch_size
        self.rollout_config = _as_rollout_config(rollout_config)
        self._collector = _Collector(
            client,
            hooks,
            label=self.label,
            timeout=timeout_seconds,
            poll_interval=poll_interval,
            track_running=track_running,
            keep_repeated_prompts=keep_repeated_prompts,
        )
        self._groups: dict[str, _Group] = {}  # insertion order = enqueue order (oldest first)
        self._n_stale_dropped = 0  # groups `drop_stale` forgot since the last `run` (overlap)

    @property
    def timeout_seconds(self) -> float | None:
        return self._collector.timeout

    @property
    def n_hook_errors(self) -> int:
        return self._collector.n_hook_errors

    def n_new_tasks_needed(self) -> int:
        """How many new tasks the next `run` takes: async_train_batch_size - groups in flight."""
        return self.async_train_batch_size - len(self._groups)

    def carry_over_groups(self) -> list[dict[str, Any]]:
        """The groups in flight, oldest first (for views)."""
        return [
            {
                "data_id": g.data_id,
                "step": g.step,
                "policy_version": g.policy_version,
                "n_finished": len(g.finished),
                "n": len(g.rollout_ids),
            }
            for g in self._groups.values()
        ]

    # -- one step ---------------------------------------------------------------------------

    def run(
        self,
        tasks: Sequence[Mapping[str, Any]],
        step: int,
        policy_version: int | None = None,
        *,
        max_staleness: int | None = None,
        stale_groups: str = "drop",
    ) -> tuple[list[CompletedRollout], dict[str, float]]:
        """Enqueue `tasks` as new groups, wait for `train_batch_size` complete groups.

        Under overlap (`max_staleness` N set, docs/engines.md "Overlap") a group enqueued more than N
        versions before `policy_version` is dropped first; with `stale_groups="wait"` the wait also
        holds until every group exactly N versions old is complete (it trains now, oldest first).

        Returns the completed rollouts of the oldest `train_batch_size` complete groups, in
        (step, sample_idx, copy) order, and the `training/async/*` metrics.
        """
        needed = self.n_new_tasks_needed()
        if len(tasks) > needed:
            raise ValueError(
                f"{self.label}.run got {len(tasks)} new tasks but only {needed} fit "
                f"(async_train_batch_size {self.async_train_batch_size} - {len(self._groups)} "
                f"groups in flight); pass n_new_tasks_needed() tasks"
            )
        if len(self._groups) + len(tasks) < self.train_batch_size:
            raise ValueError(
                f"{self.label}.run: {len(self._groups) + len(tasks)} groups in flight cannot fill "
                f"data.train_batch_size ({self.train_batch_size}); pass n_new_tasks_needed() = {needed} tasks"
            )
        carried = list(self._groups.values())
        self._enqueue(tasks, step, policy_version)
        self.drop_stale(policy_version, max_staleness)
        must = self._last_chance(policy_version, max_staleness) if stale_groups == "wait" else []
        dropped = self._collector.wait(
            lambda: self._n_complete() >= self.train_batch_size and all(g.complete for g in must),
            self._on_collected,
            n_collected=lambda: sum(len(g.finished) for g in self._groups.values()),
            n_total=sum(len(g.rollout_ids) for g in self._groups.values()),
        )
        self._drop_members(dropped)
        taken = [g for g in self._groups.values() if g.complete][: self.train_batch_size]
        for group in taken:
            del self._groups[group.data_id]
        completed = [c for g in taken for c in g.members()]
        metrics = self._metrics(carried, completed, step, policy_version)
        if max_staleness is not None:
            metrics["training/overlap/n_stale_groups_dropped"] = float(self._n_stale_dropped)
            self._n_stale_dropped = 0
        metrics.update(report_wait_timeout(self.label, dropped, len(completed), self.timeout_seconds))
        return completed, metrics

    def prefetch(self, tasks: Sequence[Mapping[str, Any]], step: int, policy_version: int | None) -> None:
        """Enqueue the next step's new groups now, so they generate while the update trains (overlap)."""
        if tasks:
            self._enqueue(tasks, step, policy_version)

    def drop_stale(self, version: int | None, max_staleness: int | None) -> int:
        """Forget the groups enqueued more than `max_staleness` versions before `version` (overlap;
        call it before `n_new_tasks_needed()` so the top-up replaces them); their rollouts still
        running are collected and ignored. Returns how many groups went (counted into the next `run`)."""
        if max_staleness is None or version is None:
            return 0
        stale = [
            d
            for d, g in self._groups.items()
            if g.policy_version is not None and version - g.policy_version > max_staleness
        ]
        for data_id in stale:
            del self._groups[data_id]
        self._n_stale_dropped += len(stale)
        return len(stale)

    def _last_chance(self, version: int | None, max_staleness: int | None) -> list[_Group]:
        """The groups exactly `max_staleness` versions old: trained now or never."""
        if max_staleness is None or version is None:
            return []
        return [
            g
            for g in self._groups.values()
            if g.policy_version is not None and version - g.policy_version >= max_staleness
        ]

    def _drop_members(self, dropped: Mapping[str, str]) -> None:
        """A timed-out wait dropped these rollouts: their groups train on the members that
        finished (a group left with none is gone)."""
        if not dropped:
            return
        for data_id, group in list(self._groups.items()):
            group.rollout_ids = [rid for rid in group.rollout_ids if rid not in dropped]
            if not group.rollout_ids:
                del self._groups[data_id]

    def _enqueue(self, tasks: Sequence[Mapping[str, Any]], step: int, policy_version: int | None) -> None:
        collector = self._collector
        collector.start()
        pairs = _make_requests(
            tasks,
            n=self.n,
            is_train=True,
            config=self.rollout_config,
            step=step,
            hooks=collector.hooks,
            policy_version=policy_version,
        )
        for entry, _ in pairs:
            group = self._groups.get(entry.data_id)
            if group is None:
                group = self._groups[entry.data_id] = _Group(entry.data_id, step, entry.sample_idx, policy_version, [])
            group.rollout_ids.append(entry.rollout_id)
        collector.submit(pairs)

    def _on_collected(self, completed: CompletedRollout) -> None:
        group = self._groups.get(completed.data_id)
        if group is None or completed.rollout_id not in group.rollout_ids:  # a stale group dropped (overlap)
            return
        group.finished[completed.rollout_id] = completed
        n_done = sum(len(g.finished) for g in self._groups.values())
        n_all = sum(len(g.rollout_ids) for g in self._groups.values())
        logger.info(
            "%s: completed_groups=%d/%d finished_rollouts=%d/%d",
            self.label,
            self._n_complete(),
            self.train_batch_size,
            n_done,
            n_all,
        )

    def _n_complete(self) -> int:
        return sum(g.complete for g in self._groups.values())

    def _metrics(
        self, carried: list[_Group], completed: list[CompletedRollout], step: int, policy_version: int | None
    ) -> dict[str, float]:
        remaining = list(self._groups.values())
        version_ages = [
            policy_version - g.policy_version
            for g in remaining
            if policy_version is not None and g.policy_version is not None
        ]
        return {
            "training/async/n_prev_carry_over_rollouts": float(sum(len(g.rollout_ids) for g in carried)),
            "training/async/n_completed_rollouts": float(len(completed)),
            "training/async/n_new_carry_over_rollouts": float(sum(len(g.rollout_ids) for g in remaining)),
            "training/async/new_carry_over_age_max_steps": float(max((step - g.step for g in remaining), default=0)),
            "training/async/carry_over_age_max_versions": float(max(version_ages, default=0)),
        }

    # -- checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready carry-over state: groups, finished members, pending ids, cursor."""
        pending = self._collector.pending
        return {
            "n": self.n,
            "cursor": self._collector.cursor,
            "groups": [
                {
                    "data_id": g.data_id,
                    "step": g.step,
                    "sample_idx": g.sample_idx,
                    "policy_version": g.policy_version,
                    "rollout_ids": list(g.rollout_ids),
                    "finished": [completed_rollout_to_dict(c) for c in g.finished.values()],
                    "pending": [dataclasses.asdict(pending[r]) for r in g.rollout_ids if r in pending],
                }
                for g in self._groups.values()
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the carry-over with a `state_dict()` (the server must still hold the pending ids)."""
        if state.get("n") != self.n:
            raise ValueError(
                f"carry-over checkpoint was taken with n={state.get('n')} rollouts per task but this "
                f"manager has n={self.n} (actor_rollout_ref.rollout.n); resume with the same n"
            )
        self._groups, pending = {}, {}
        for g in state["groups"]:
            finished = [completed_rollout_from_dict(c) for c in g["finished"]]
            self._groups[g["data_id"]] = _Group(
                g["data_id"],
                g["step"],
                g["sample_idx"],
                g["policy_version"],
                list(g["rollout_ids"]),
                {c.rollout_id: c for c in finished},
            )
            pending.update({e["rollout_id"]: _Entry(**e) for e in g["pending"]})
        self._collector.pending = pending
        self._collector.cursor = state.get("cursor")


# ---------------------------------------------------------------------------------------------
# After collection: the rollout stage's passes over what it collected
# ---------------------------------------------------------------------------------------------


def finish_collected(
    completed: Sequence[CompletedRollout], *, vocab_size: int | None, max_abs_reward: float, step: int, is_train: bool
) -> dict[str, Any]:
    """The rollout stage's passes over the rollouts it collected, in this order; returns their metrics.

    1. `fail_unlearnable_rollouts`: a rollout the policy cannot learn from fails alone, so the
       passes below count it failed;
    2. training only: `records.lifecycle_metrics` (queue wait, run and total times) and
       `records.critical_path_metrics` (the slowest rollout's decode steps);
    3. `report_failures`: the failed and re-run rollouts, counted and warned about.
    """
    metrics = fail_unlearnable_rollouts(completed, vocab_size, max_abs_reward, step, is_train)
    if is_train:
        metrics.update(lifecycle_metrics(completed))
        metrics.update(critical_path_metrics(completed))
    metrics.update(report_failures(completed, step, is_train))
    return metrics


def report_failures(completed, step: int, is_train: bool) -> dict[str, Any]:
    """`training/n_failed_rollouts` (`val/…`) and, when any failed, one warning with the count
    and the first error message; `training/n_rerun_rollouts` counts the rollouts that ran as a
    later attempt (their runner died or stopped: `metadata["attempt_id"]`)."""
    prefix = "training" if is_train else "val"
    rerun = sum(1 for r in completed if r.metadata.get("attempt_id") not in (None, "0"))
    if rerun:
        logger.info("step %d: %d rollout(s) ran again as a later attempt (a runner died or stopped)", step, rerun)
    return {**_report_failed(completed, step, is_train), f"{prefix}/n_rerun_rollouts": rerun}


def _report_failed(completed, step: int, is_train: bool) -> dict[str, Any]:
    failed = [r for r in completed if r.state == "failed"]
    if failed:
        first = (failed[0].error_message or "no error message").strip()
        logger.warning(
            "step %d: %d of %d %s rollouts failed; first error (rollout %s): %s\n"
            "(every error: RolloutResult.lifecycle[['rollout_id', 'state', 'error_message']])",
            step,
            len(failed),
            len(completed),
            "training" if is_train else "validation",
            failed[0].rollout_id,
            first[:2000],
        )
    return {f"{'training' if is_train else 'val'}/n_failed_rollouts": len(failed)}


def fail_unlearnable_rollouts(
    completed, vocab_size: int | None, max_abs_reward: float, step: int, is_train: bool
) -> dict[str, Any]:
    """Fail the rollouts the policy cannot learn from (`learnable.fail_unlearnable`: a token id
    outside the vocabulary, an empty prompt, a reward beyond `max_abs_reward`), so one agent's
    bad events fail its rollout alone; `training/n_unlearnable_rollouts` (`val/…`) counts them."""
    from agl_lab.learnable import fail_unlearnable

    failed = fail_unlearnable(completed, vocab_size, max_abs_reward)
    for rollout in failed[:5]:
        logger.warning("step %d: rollout %s failed: %s", step, rollout.rollout_id, rollout.metadata["learning_error"])
    return {f"{'training' if is_train else 'val'}/n_unlearnable_rollouts": len(failed)}
