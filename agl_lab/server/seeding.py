"""Seeded calls: reproducible sampling whatever the concurrency.

With `call_seed` set (the Trainer sets it to `agl_lab.seed`), the gateway gives every
proxied call that carries no `seed` of its own a seed derived from where the call sits in
the run — the rollout's step, task index and copy index (the rollout metadata the rollout
managers write) and the call's index within its rollout attempt:

    seed = sha256(call_seed, step, task index, copy index, attempt, call index) mod 2^31

The engines sample each request with its own generator (vLLM's `seed`, agl_lab's local
engine alike), so the same run replays the same tokens even though 32 agents hit the server
in a different order every time. This is what makes "save → load → continue" reproduce an
uninterrupted run. Rollouts without that metadata (created by other tools) fall back to
their rollout id, which is still deterministic per rollout but not across runs.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from agl_lab.server.gateway import ProxyCall


def derive_seed(call_seed: int, position: tuple[Any, ...]) -> int:
    blob = repr((int(call_seed),) + tuple(position)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "big") & 0x7FFFFFFF


class SeededCallsRewriter:
    """Gateway request rewriter: adds a position-derived `seed` to calls that have none."""

    def __init__(self, call_seed: int, max_attempts_tracked: int = 65536):
        self.call_seed = int(call_seed)
        self._calls: OrderedDict[tuple[str, str], int] = OrderedDict()  # (rollout, attempt) → calls so far
        self._max = max_attempts_tracked
        self._lock = threading.Lock()

    def _next_index(self, rollout_id: str, attempt_id: str) -> int:
        key = (rollout_id, attempt_id)
        with self._lock:
            index = self._calls.pop(key, 0)
            self._calls[key] = index + 1
            while len(self._calls) > self._max:
                self._calls.popitem(last=False)
        return index

    def __call__(self, call: ProxyCall) -> None:
        if call.request.get("seed") is not None:
            return
        meta = call.rollout.metadata.model_dump()
        where = (meta.get("batch_idx"), meta.get("sample_idx_in_batch"), meta.get("copy_idx"))
        if None in where:
            where = (call.rollout.rollout_id,)
        index = self._next_index(call.rollout.rollout_id, call.attempt_id)
        call.request["seed"] = derive_seed(self.call_seed, (*where, call.attempt_id, index))
        call.annotations["call_seed"] = call.request["seed"]
