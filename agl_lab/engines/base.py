"""The Engine contract: everything that differs between the CPU engine and the verl engine.

Everything above an engine (store, gateway, rollout managers, batch, algorithms, views) is
the same code for every engine. A training step drives an engine like this:

    gateway.register(engine.endpoints(), version=engine.policy_version)
    engine.resume()                 # serve generations
    ... agents roll out through the gateway ...
    engine.abort() / engine.pause() # no generation may cross a weight update
    metrics = engine.update(batch)  # old logprobs, PPO epochs, optimiser step
    engine.sync_weights()           # serving weights = trained weights; policy_version += 1
"""

from __future__ import annotations

import abc
from typing import Any


class Engine(abc.ABC):
    """Owns policy weights and serving endpoints."""

    #: name the gateway registers the endpoints under (`default_proxy.model_name`)
    model_name: str

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights being served; bumped by every `sync_weights()`."""

    @abc.abstractmethod
    def endpoints(self) -> list[str]:
        """OpenAI base URLs (ending in `/v1`) to register with the gateway."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop starting new generations (in-flight ones finish)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Serve generations again."""

    @abc.abstractmethod
    def abort(self) -> int:
        """End in-flight generations with an error the agent sees; returns how many."""

    @abc.abstractmethod
    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> Any:
        """Log-probabilities of `data.batch["responses"]` under the current weights, [N, R]."""

    @abc.abstractmethod
    def update(self, data: Any) -> dict[str, float]:
        """One policy update on a prepared batch (advantages present); returns metrics."""

    @abc.abstractmethod
    def sync_weights(self) -> None:
        """Make the serving weights equal the trained weights and bump `policy_version`."""

    @abc.abstractmethod
    def save(self, path: str) -> None: ...

    @abc.abstractmethod
    def load(self, path: str) -> None: ...

    def close(self) -> None:
        """Release servers and threads. Idempotent."""
