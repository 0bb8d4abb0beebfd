"""The Engine contract: everything that differs between the CPU engine and the verl engine.

Everything above an engine (store, gateway, rollout managers, batch, algorithms, views) is
the same code for every engine. A training step drives an engine like this:

    gateway.register(engine.endpoints(), version=engine.policy_version)
    engine.resume()                       # serve generations
    ... agents roll out through the gateway ...
    engine.abort()                        # end residual generations (sync mode)
    engine.pause(timeout)                 # no generation may cross a weight update
    batch, m = engine.prepare(batch)      # old logprobs (+ ref, values, KL, IS weights on verl)
    ... advantages, selection, normalisation: agl_lab.algorithms ...
    metrics = engine.update(batch)        # PPO epochs, optimiser steps
    engine.sync_weights()                 # serving weights = trained weights; policy_version += 1

Every method the Trainer and `agl_lab.update` call is declared here, so they never ask an
engine what it has (`hasattr`): a method with a default body is optional to override.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any


class Engine(abc.ABC):
    """Owns policy weights and serving endpoints."""

    #: name the gateway registers the endpoints under (`default_proxy.model_name`)
    model_name: str
    #: the served model's HF tokenizer (batch padding, token-level views); None if it has none
    tokenizer: Any = None
    #: `algorithm.rollout_correction.bypass_mode`: old logprobs = the sampling logprobs
    bypass_mode: bool = False

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights being served; bumped by every `sync_weights()`."""

    @property
    def mini_batch_rows(self) -> int | None:
        """Rows per PPO mini-batch when the engine fixes it (verl pads to it); None: any size."""
        return None

    @abc.abstractmethod
    def endpoints(self) -> list[str]:
        """OpenAI base URLs (ending in `/v1`) to register with the gateway."""

    @abc.abstractmethod
    def pause(self, timeout: float | None = None) -> None:
        """Stop starting new generations; wait (at most `timeout` s, None: unbounded) for in-flight ones."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Serve generations again."""

    @abc.abstractmethod
    def abort(self) -> int:
        """End in-flight generations with an error the agent sees; returns how many."""

    @abc.abstractmethod
    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> Any:
        """Log-probabilities of `data.batch["responses"]` under the current weights, [N, R]."""

    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        """What the advantage needs that only the engine computes; returns `(data, metrics)`.

        Default: `old_log_probs` [N, R] — the sampling logprobs `rollout_log_probs` when
        `bypass_mode`, else `compute_log_probs` at `data.meta_info["temperature"]` (default 1).
        """
        if self.bypass_mode:
            data.batch["old_log_probs"] = sampling_log_probs(data)
        else:
            temperature = float(data.meta_info.get("temperature", 1.0))
            data.batch["old_log_probs"] = self.compute_log_probs(data, temperature=temperature)
        return data, {}

    @abc.abstractmethod
    def update(self, data: Any) -> dict[str, float]:
        """One policy update on a prepared batch (advantages present); returns metrics."""

    @abc.abstractmethod
    def sync_weights(self) -> None:
        """Make the serving weights equal the trained weights and bump `policy_version`."""

    @abc.abstractmethod
    def save(self, path: str, agl_state: Mapping[str, Any] | None = None) -> None:
        """Weights, optimiser and engine state under `path/`, plus the caller's `agl_state`."""

    @abc.abstractmethod
    def load(self, path: str) -> dict[str, Any] | None:
        """Restore `save(path)` and serve the loaded weights; returns the saved `agl_state`."""

    def close(self) -> None:
        """Release servers and threads. Idempotent."""


def sampling_log_probs(data: Any) -> Any:
    """`rollout_log_probs` [N, R] as float32 old logprobs (bypass mode); they must be finite."""
    if "rollout_log_probs" not in data.batch.keys():
        raise RuntimeError("bypass_mode requires rollout_log_probs in batch")
    rollout = data.batch["rollout_log_probs"]
    if not rollout.isfinite().all():
        raise RuntimeError("bypass_mode requires finite rollout_log_probs everywhere")
    return rollout.clone().float()


def logprob_gap(data: Any) -> dict[str, float]:
    """|log π_old − log π_rollout| over the loss tokens: `training/rollout_logprobs_diff_{mean,max}`
    (the console's `lp_diff_max`; 0 means the update starts on-policy). `{}` without both
    `old_log_probs` and `rollout_log_probs`, or without loss tokens."""
    b = data.batch
    if "rollout_log_probs" not in b.keys() or "old_log_probs" not in b.keys():
        return {}
    diff = (b["old_log_probs"].float() - b["rollout_log_probs"].float()).abs()[b["response_mask"].bool()]
    if not diff.numel():
        return {}
    return {"training/rollout_logprobs_diff_mean": diff.mean().item(),
            "training/rollout_logprobs_diff_max": diff.max().item()}
