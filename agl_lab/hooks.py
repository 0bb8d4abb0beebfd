"""Rollout hooks: user code that runs on the trainer side of the rollout phase.

A hooks file (`agentlightning.hooks: path/to/hooks.py`) holds exactly one subclass of
`RolloutHooks`. The rollout managers call it:

| hook                                        | when                                                |
|---------------------------------------------|-----------------------------------------------------|
| `on_startup(store=None)`                    | once, when the trainer loads the hooks              |
| `on_enqueue(request) -> request`            | per rollout copy, before its id is assigned         |
| `on_succeeded(rollout, events, writer)`     | exactly once, when the rollout is seen SUCCEEDED    |
| `on_failed(rollout, writer)`                | exactly once, when the rollout is seen FAILED       |

`events` maps attempt id -> list of `Event` (the last attempt's events). `writer` is a
`TraceWriter`: events written through it are buffered and posted after the hook returns,
before the manager reads the rollout's triplets — so a hook can supply the reward (an
evaluator, or a fallback reward for failures). If the hook raises, its buffered events are
dropped and training goes on.

Unlike AGL v1, the managers guarantee "exactly once" even when an async group is carried
over several steps.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agl_lab.protocol import Event, Rollout, RolloutCreate

HOOKS_MODULE_NAME = "_agl_hooks"


@runtime_checkable
class TraceWriter(Protocol):
    """Where hooks write events (`AglClient` is one; the managers pass a buffering writer)."""

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> Any: ...


class RolloutHooks:
    """Base class of user hooks; every method is a no-op by default."""

    def on_startup(self, store: TraceWriter | None = None) -> None:
        """Called once after the trainer loaded the hooks."""

    def on_enqueue(self, request: RolloutCreate) -> RolloutCreate:
        """Transform a rollout request before it is sent (its `rollout_id` is not set yet)."""
        return request

    def on_succeeded(self, rollout: Rollout, events: dict[str, list[Event]], store: TraceWriter) -> None:
        """Called once per SUCCEEDED rollout, before its triplets are read."""

    def on_failed(self, rollout: Rollout, store: TraceWriter) -> None:
        """Called once per FAILED rollout, before its triplets are read."""


def load_hooks(path: str | Path) -> RolloutHooks:
    """Import the hooks file at `path` and return an instance of its one `RolloutHooks` subclass.

    The file is imported as module `_agl_hooks`; subclasses imported into it count too.

    Raises:
        FileNotFoundError: "Hooks module not found: {absolute path}".
        ValueError: no subclass ("No RolloutHooks subclass found in {path}") or several
            ("Multiple RolloutHooks subclasses found in {path}: [names]").
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"Hooks module not found: {resolved}")
    spec = importlib.util.spec_from_file_location(HOOKS_MODULE_NAME, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import hooks module {resolved} (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[HOOKS_MODULE_NAME] = module  # lets dataclasses/pickle inside the file resolve it
    spec.loader.exec_module(module)
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, RolloutHooks) and obj is not RolloutHooks
    ]
    if not found:
        raise ValueError(f"No RolloutHooks subclass found in {resolved}")
    if len(found) > 1:
        names = [cls.__name__ for cls in found]
        raise ValueError(f"Multiple RolloutHooks subclasses found in {resolved}: {names}")
    return found[0]()


class BufferedTraceWriter:
    """The `TraceWriter` a hook receives: it queues events; the manager posts them afterwards.

    Buffering makes a hook all-or-nothing: if it raises half-way, none of its events land.
    """

    def __init__(self) -> None:
        self.queued: list[tuple[str, str, str, dict[str, Any]]] = []

    def add_event(self, rollout_id: str, attempt_id: str, event_type: str, data: dict[str, Any]) -> None:
        self.queued.append((rollout_id, attempt_id, event_type, dict(data or {})))

    def flush(self, target: TraceWriter) -> int:
        """Write the queued events to `target` in order; return how many were written."""
        written = 0
        for args in self.queued:
            target.add_event(*args)
            written += 1
        self.queued.clear()
        return written
