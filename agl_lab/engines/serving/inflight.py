"""The calls an engine is working on, by the gateway's request id: asked about and aborted one at a time.

    calls = InflightCalls(scheduler)
    with calls.track(request_id):          # around one chat/completions request (None: untracked)
        future = scheduler.submit(...)
        calls.attach(future)               # the scheduler's future of the tracked request
    calls.state(request_id)   -> {"request_id", "state": "queued" | "running" | "unknown", "queued", "running"}
    calls.abort(request_id)   -> {"request_id", "aborted": bool, "state": <before>}

Why (#51): the gateway bounds each upstream attempt. Under load a generation may outlast it while
the engine is still decoding it; closing the connection does not stop it here, so a retry used to
queue the same generation a second time behind the first, doubling the work the gateway waited for.
Now the gateway tags each POST (`X-Agl-Request-Id`) and, when an attempt times out, asks `state`:
"queued" (rendering, or waiting for a batch slot) or "running" → it waits longer; past its cap it
calls `abort` before failing the call. "unknown": finished, never arrived, or not tagged.

A request aborted before the scheduler has its future is remembered until its future arrives
(`attach` cancels it then); a running one retires at the end of the scheduler's current step
(`BatchScheduler.cancel`, finish_reason "abort").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("agl_lab_request_id", default=None)
_PREPARING = None  # tracked, its prompt still being rendered: no scheduler future yet


class InflightCalls:
    """Tagged requests of one engine server → their scheduler futures (thread-safe)."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._calls: dict[str, concurrent.futures.Future | None] = {}
        self._aborted_early: set[str] = set()

    @contextlib.contextmanager
    def track(self, request_id: str | None) -> Iterator[None]:
        """File the request handled inside this block under `request_id` (None: not tracked)."""
        if not request_id:
            yield
            return
        token = _current.set(request_id)
        with self._lock:
            self._calls[request_id] = _PREPARING
        try:
            yield
        finally:
            _current.reset(token)
            with self._lock:
                self._calls.pop(request_id, None)
                self._aborted_early.discard(request_id)

    def attach(self, future: concurrent.futures.Future) -> None:
        """The scheduler's future of the request being tracked in this context (if any)."""
        request_id = _current.get()
        if request_id is None:
            return
        with self._lock:
            self._calls[request_id] = future
            early = request_id in self._aborted_early
        if early:
            self.scheduler.cancel(future)

    def state(self, request_id: str) -> dict[str, Any]:
        with self._lock:
            known = request_id in self._calls
            future = self._calls.get(request_id)
        if not known or (future is not None and future.done()):
            state = "unknown"
        else:
            state = "running" if future is not None and future.running() else "queued"
        queued, running = self.scheduler.num_pending()
        return {"request_id": request_id, "state": state, "queued": queued, "running": running}

    def abort(self, request_id: str) -> dict[str, Any]:
        before = self.state(request_id)["state"]
        with self._lock:
            known = request_id in self._calls
            future = self._calls.get(request_id)
            if known and future is None:
                self._aborted_early.add(request_id)
        aborted = known and (future is None or self.scheduler.cancel(future))
        return {"request_id": request_id, "aborted": bool(aborted), "state": before}
