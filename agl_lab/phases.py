"""When the engine serves: the two phases of a step, as one state machine.

    rollout phase   engine.resume() → gateway.resume() (async)
                    → the caller collects rollouts →
                    sync:  engine.abort()                 stray generations end
                    async: gateway.pause(), then wait     until no proxied call is in flight
    update phase    engine.pause(timeout)                 no generation crosses a weight update
                    → the caller prepares and trains →
                    engine.resume()                       serve the new weights

Each phase is a context manager that ends itself whatever happens inside it. A collection that
raises still aborts (sync) or drains (async), then resumes the engine, so the next phase — or the
same notebook cell run again — finds the engine serving; the collection's error propagates, and a
second failure while ending the phase is logged beside it, never raised over it. An update phase
resumes in every case: after a skipped step (verl's abort at the end of a sync rollout phase leaves
its replicas paused until then), after an error, after training.

`engine` is an `agl_lab.engines.base.Engine`; `gateway` is anything with the gateway's pause
routes (`AglClient`: `pause`, `resume`, `proxy_state`). Nothing else is imported: the phases are
pure control flow, tested with recording fakes and through the Trainer on both engines.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.05


@contextlib.contextmanager
def rollout_phase(
    engine: Any, gateway: Any, *, drain: bool, reason: str, drain_timeout: float
) -> Iterator[dict[str, Any]]:
    """Serve while the caller collects rollouts; yields the phase's metrics dict.

    After a phase that ended normally the dict holds `training/n_aborted_generations` (sync) or
    the drain figures `training/async/proxy_{inflight_at_pause,drain_seconds}` (async)."""
    metrics: dict[str, Any] = {}
    engine.resume()
    if drain:
        gateway.resume()
    try:
        yield metrics
    except BaseException:
        _also_try(lambda: _end_rollout_phase(engine, gateway, drain, reason, drain_timeout), "ending the rollout phase")
        _also_try(engine.resume, "resuming the engine")
        raise
    metrics.update(_end_rollout_phase(engine, gateway, drain, reason, drain_timeout))


@contextlib.contextmanager
def update_phase(engine: Any, *, timeout: float, pause: bool = True) -> Iterator[None]:
    """Pause the engine (unless `pause` is false: a skipped step trains nothing) while the caller
    trains; resume it afterwards, whatever happened."""
    try:
        if pause:
            engine.pause(timeout)
        yield
    finally:
        engine.resume()


def drain_gateway(gateway: Any, *, reason: str, timeout: float) -> dict[str, float]:
    """Pause the gateway (new calls answer 503 with Retry-After) and wait, bounded by `timeout`
    seconds, until no proxied call is in flight."""
    t0 = time.time()
    state = gateway.pause(reason=reason, retry_after_seconds=5)
    inflight_at_pause = state.inflight
    while state.inflight > 0:
        if time.time() > t0 + timeout:
            raise TimeoutError(
                f"gateway still has {state.inflight} calls in flight after {timeout} s of draining; "
                "raise agl_lab.rollout.drain_timeout_seconds or check the engine"
            )
        time.sleep(DRAIN_POLL_SECONDS)
        state = gateway.proxy_state()
    return {
        "training/async/proxy_inflight_at_pause": inflight_at_pause,
        "training/async/proxy_drain_seconds": time.time() - t0,
    }


def _end_rollout_phase(engine: Any, gateway: Any, drain: bool, reason: str, drain_timeout: float) -> dict[str, Any]:
    if drain:
        return drain_gateway(gateway, reason=reason, timeout=drain_timeout)
    return {"training/n_aborted_generations": engine.abort()}


def _also_try(action: Callable[[], Any], what: str) -> None:
    """Run `action` on a path that is already failing: log its error instead of raising it."""
    try:
        action()
    except Exception:
        logger.exception("%s after a failed rollout collection also failed", what)
