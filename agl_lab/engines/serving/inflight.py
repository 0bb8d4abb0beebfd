"""The calls an engine is working on, by the gateway's request id: asked about and aborted one at a time.

    calls = InflightCalls(scheduler)
    with calls.track(request_id):          # around one chat/completions request (None: untracked)
        future = scheduler.submit(...)
        calls.attach(future)               # the scheduler's future of the tracked request
    calls.state(request_id)   -> {"request_id", "state": "queued" | "running" | "answered" | "unknown",
                                  "queued", "running"}
    calls.abort(request_id)   -> {"request_id", "aborted": bool, "state": <before>, "barred": bool}

Why (#51): the gateway bounds each upstream attempt. Under load a generation may outlast it while
the engine is still decoding it; closing the connection does not stop it here, so a retry used to
queue the same generation a second time behind the first, doubling the work the gateway waited for.
Now the gateway tags each POST (`X-Agl-Request-Id`) and, when an attempt times out, asks `state`:
"queued" (rendering, or waiting for a batch slot), "running" or "answered" (done, its answer on the
way back) → it waits longer; past its cap it calls `abort` before failing the call. "unknown": never
arrived (or not yet: still in transit), answered long ago, or not tagged.

A request aborted before the scheduler has its future is remembered until its future arrives
(`attach` cancels it then); a running one retires at the end of the scheduler's current step
(`BatchScheduler.cancel`, finish_reason "abort").

An id aborted while unknown here is *barred* ("barred": true): the gateway aborts an "unknown" id
before it sends the call again, because "unknown" may also mean the POST is still in transit (sent,
not yet read by this server: on a loaded host it can trail the gateway's question). Should that copy
arrive later it is cancelled like an early abort, so the resend is the only generation. The last
`REMEMBERED_IDS` answered ids and as many barred ones are kept (ids are fresh per attempt, so one is
never reused).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("agl_lab_request_id", default=None)
_PREPARING = None  # tracked, its prompt still being rendered: no scheduler future yet
REMEMBERED_IDS = 4096  # answered ids, and ids aborted before they arrived, kept (oldest forgotten first)


class InflightCalls:
    """Tagged requests of one engine server → their scheduler futures (thread-safe)."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._calls: dict[str, concurrent.futures.Future | None] = {}
        self._aborted_early: set[str] = set()
        self._barred: OrderedDict[str, None] = OrderedDict()
        self._answered: OrderedDict[str, None] = OrderedDict()

    @contextlib.contextmanager
    def track(self, request_id: str | None) -> Iterator[None]:
        """File the request handled inside this block under `request_id` (None: not tracked)."""
        if not request_id:
            yield
            return
        token = _current.set(request_id)
        with self._lock:
            self._calls[request_id] = _PREPARING
            if request_id in self._barred:  # aborted before it arrived: cancelled at `attach`
                del self._barred[request_id]
                self._aborted_early.add(request_id)
        try:
            yield
        finally:
            _current.reset(token)
            with self._lock:
                self._calls.pop(request_id, None)
                self._aborted_early.discard(request_id)
                _remember(self._answered, request_id)

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
            answered = request_id in self._answered
        if not known:
            state = "answered" if answered else "unknown"
        elif future is not None and future.done():
            state = "answered"
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
            barred = not known and request_id not in self._answered  # decided under the lock
            if barred:
                _remember(self._barred, request_id)
        aborted = known and (future is None or self.scheduler.cancel(future))
        return {"request_id": request_id, "aborted": bool(aborted), "state": before, "barred": barred}


def _remember(ids: OrderedDict[str, None], request_id: str) -> None:
    ids[request_id] = None
    while len(ids) > REMEMBERED_IDS:
        ids.popitem(last=False)
