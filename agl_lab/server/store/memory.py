"""The in-memory store: plain dicts in this process (`store: memory`, the default).

Lost when the process ends. The semantics are the base class's (`agl_lab.server.store.base.Store`);
this module only implements its storage primitives. Objects it returns are the stored ones (treat
them as read-only), except event data: events are kept as JSON bytes and each read decodes a fresh
copy.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

from agl_lab.protocol import Event, Model, Rollout, RolloutState
from agl_lab.server.storable import dump_storable
from agl_lab.server.store.base import DEFAULT_TERMINAL_LOG_LIMIT, OneProcessStore, load_stored


def _pack(data: Any) -> bytes:
    """MemoryStore's stored form of event data: JSON bytes. Encoding is also the write-time check
    (NotStorable names the field), so an event is encoded once."""
    return dump_storable(data, "data")


def _unpack(stored: bytes) -> Any:
    return load_stored(stored)


class MemoryStore(OneProcessStore):
    """Plain dicts; the terminal log is a bounded deque plus an absolute count."""

    BLOCKING = False  # no I/O: the gateway calls it on its event loop (no thread hop per model call)

    def __init__(self, terminal_log_limit: int = DEFAULT_TERMINAL_LOG_LIMIT):
        super().__init__(terminal_log_limit)
        self._rollouts: dict[str, Rollout] = {}
        # events as (type, timestamp, JSON bytes): bytes are invisible to the garbage collector, so
        # 100k stored calls do not make each full collection (which stops the server's event loop)
        # walk millions of dicts; reads decode a fresh copy
        self._event_log: dict[str, dict[str, list[tuple[str, float, Any]]]] = {}
        self._event_ids: dict[str, dict[tuple[str, str], str]] = {}  # rollout id -> {(attempt, event id): digest}
        self._model_map: dict[str, dict[str, Model]] = {}
        self._terminal: collections.deque[str] = collections.deque(maxlen=self.terminal_log_limit)
        self._terminal_count = 0
        self._terminal_latest: dict[str, int] = {}  # rollout id -> absolute index of its latest entry

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
        self._event_ids.pop(rollout_id, None)

    def _list(self, states: list[RolloutState], limit: int) -> list[Rollout]:
        matching = (r for r in self._rollouts.values() if r.status.state in states)
        return list(itertools.islice(matching, limit))

    def _lock_queued(self, limit: int) -> list[Rollout]:
        return self._list([RolloutState.QUEUING], limit)  # the session (a mutex) is the row lock

    def _check_event_data(self, data: dict[str, Any] | None) -> None:
        pass  # `_append_event` encodes with dump_storable (`_pack`), which is the check

    def _append_event(self, event: Event, event_id: str | None = None, digest: str = "") -> str | None:
        attempts = self._event_log.get(event.rollout_id)
        if attempts is None or event.rollout_id not in self._rollouts:
            return None
        packed = _pack(event.data)  # the check first: data it cannot store leaves no id behind
        if event_id is not None:  # under the store's lock: one of two concurrent posts of an id appends
            seen = self._event_ids.setdefault(event.rollout_id, {})
            if (event.attempt_id, event_id) in seen:
                return seen[event.attempt_id, event_id]
            seen[event.attempt_id, event_id] = digest
        attempts.setdefault(event.attempt_id, []).append((event.event_type, event.timestamp, packed))
        return digest

    def _events(self, rollout_id: str, attempt_id: str) -> list[Event]:
        return [
            Event.model_construct(
                event_type=etype, rollout_id=rollout_id, attempt_id=attempt_id, timestamp=ts, data=_unpack(data)
            )
            for etype, ts, data in self._event_log.get(rollout_id, {}).get(attempt_id, [])
        ]

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

    def _clear_models(self, model_name: str | None) -> None:
        if model_name is None:
            self._model_map.clear()
        else:
            self._model_map.pop(model_name, None)

    def _models(self, model_name: str) -> list[Model]:
        return list(self._model_map.get(model_name, {}).values())
