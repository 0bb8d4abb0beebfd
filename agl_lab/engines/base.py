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
from dataclasses import dataclass
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
    def vocab_size(self) -> int | None:
        """Token ids the policy can score are in [0, vocab_size): the tokenizer's size here (an
        engine that knows its embedding's rows says so); None when there is no tokenizer. A
        rollout with other ids fails alone (`learnable.learning_problem`)."""
        return len(self.tokenizer) if self.tokenizer is not None else None

    def serving_counters(self) -> dict[str, float]:
        """Running totals of the engine's own server, for the per-phase `rollout/*` metrics
        (`Execution.serving` logs their change over a rollout phase): `prefill_tokens` (prompt
        tokens computed), `cached_tokens` (prompt tokens the prefix cache served), `decode_steps`
        (batched decode forwards). `{}` for an engine whose server counts nothing (verl's replicas)."""
        return {}

    @property
    @abc.abstractmethod
    def policy_version(self) -> int:
        """Version of the weights being served; bumped by every `sync_weights()`."""

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

    def compute_log_probs_and_entropy(self, data: Any, temperature: float = 1.0) -> tuple[Any, Any]:
        """(log π(responses) [N, R], entropy of π at each response position [N, R]) under the
        current weights at `temperature`, for the per-token view (`agl_lab.token_view`)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not compute per-token entropy on request; the local engine does "
            "(agl_lab.engine=local). Its metrics still carry actor/entropy per step."
        )

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
    def save(self, path: str) -> None:
        """Weights, optimiser and engine state under `path/` (the Trainer saves its own beside it)."""

    @abc.abstractmethod
    def load(self, path: str) -> None:
        """Restore `save(path)` and serve the loaded weights."""

    def close(self) -> None:  # noqa: B027 (optional: an engine that holds nothing has nothing to close)
        """Release servers and threads. Idempotent."""


def sampling_log_probs(data: Any) -> Any:
    """`rollout_log_probs` [N, R] as float32 old logprobs (bypass mode, both engines); they must
    be present and finite, padding included."""
    if "rollout_log_probs" not in data.batch.keys():
        raise RuntimeError(
            "algorithm.rollout_correction.bypass_mode=true needs rollout_log_probs in the batch: "
            "every captured call must carry sampling logprobs (agl_lab.server.include_log_probs=true)"
        )
    rollout = data.batch["rollout_log_probs"]
    if not rollout.isfinite().all():
        raise RuntimeError("bypass_mode needs finite rollout_log_probs everywhere (padding included)")
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
    return {
        "training/rollout_logprobs_diff_mean": diff.mean().item(),
        "training/rollout_logprobs_diff_max": diff.max().item(),
    }


# ---------------------------------------------------------------------------------------------
# The batch schema: every key of the DataProto a training step passes around, declared once.
# ---------------------------------------------------------------------------------------------

_MASK = ("int64", "bool", "float32")  # a 0/1 mask: build_batch writes int64; verl's rejection masks are float


@dataclass(frozen=True)
class BatchKey:
    """One key of the batch: its dtypes, its shape (N rows, P prompt and R response columns),
    who writes it, and whether the update stage needs it on entry."""

    dtypes: tuple[str, ...]
    shape: str
    writer: str
    required: bool = False


#: name → BatchKey. `run_update` checks a batch against it on entry (`check_batch`); the
#: consumers read these keys as declared and invent no defaults.
BATCH_SCHEMA: dict[str, BatchKey] = {
    # written by agl_lab.batch.build_batch (to_dataproto)
    "input_ids": BatchKey(("int64",), "N, P+R", "batch.build_batch"),
    "attention_mask": BatchKey(("int64",), "N, P+R", "batch.build_batch"),
    "position_ids": BatchKey(("int64",), "N, P+R", "batch.build_batch"),
    "prompts": BatchKey(("int64",), "N, P", "batch.build_batch"),
    "responses": BatchKey(("int64",), "N, R", "batch.build_batch"),
    "response_mask": BatchKey(_MASK, "N, R", "batch.build_batch (1 on model-sampled tokens)", required=True),
    "is_drop_mask": BatchKey(("bool",), "N", "batch.build_batch (prompt or response too long)"),
    "token_level_scores": BatchKey(
        ("float32", "bfloat16"), "N, R", "batch.build_batch (reward on the last token)", required=True
    ),
    "rollout_log_probs": BatchKey(("float32",), "N, R", "batch.build_batch (when every call has logprobs)"),
    "rollout_versions": BatchKey(
        ("int64",), "N, R", "batch.build_batch (policy version that sampled each token; -1 unknown)"
    ),
    "rollout_id_list": BatchKey(("object",), "N", "batch.build_batch", required=True),
    "data_id_list": BatchKey(("object",), "N", "batch.build_batch (the group)", required=True),
    "uid": BatchKey(("object",), "N", "batch.build_batch (= data_id_list, verl's group key)"),
    "turn_index_list": BatchKey(("object",), "N", "batch.build_batch (first call of the row)"),
    # written during the update
    "old_log_probs": BatchKey(("float32",), "N, R", "Engine.prepare"),
    "ref_log_prob": BatchKey(("float32",), "N, R", "Engine.prepare (verl: reference policy; local: KL in reward)"),
    "token_level_rewards": BatchKey(
        ("float32", "bfloat16"),
        "N, R",
        "Engine.prepare (KL in reward) or algorithms.advantage.fill_reward_defaults (= token_level_scores)",
    ),
    "advantages": BatchKey(("float32",), "N, R", "algorithms.advantage, then algorithms.loss.normalize_batch"),
    "returns": BatchKey(("float32",), "N, R", "algorithms.advantage"),
    "rollout_advantages": BatchKey(("float32",), "N, R", "algorithms.loss.normalize_batch (the raw advantages)"),
    "rollout_is_weights": BatchKey(("float32",), "N, R", "Engine.prepare (algorithm.rollout_correction)"),
    "values": BatchKey(("float32",), "N, R", "Engine.prepare (verl's critic, GAE)"),
}


def check_batch(data: Any, where: str = "run_update") -> None:
    """Raise ValueError naming every missing required key and every key of `BATCH_SCHEMA`
    whose dtype or shape (rows N, prompt P, response R, from `response_mask` and `prompts`)
    differs from its declaration."""
    tensors, extras = data.batch, data.non_tensor_batch
    present = {**{k: tensors[k] for k in tensors.keys()}, **dict(extras)}
    problems = [
        f"{k!r} is missing (written by {spec.writer})"
        for k, spec in BATCH_SCHEMA.items()
        if spec.required and k not in present
    ]
    if "response_mask" in present:
        n, r = (int(x) for x in present["response_mask"].shape)
        p = int(present["prompts"].shape[1]) if "prompts" in present else None
        sizes = {"N": n, "R": r, "P": p, "P+R": None if p is None else p + r}
        for key, spec in BATCH_SCHEMA.items():
            if key not in present:
                continue
            value = present[key]
            dtype = str(value.dtype).removeprefix("torch.")
            if dtype not in spec.dtypes:
                problems.append(f"{key!r} has dtype {dtype}, expected {' or '.join(spec.dtypes)}")
            want = [sizes[d.strip()] for d in spec.shape.split(",")]
            got = [int(x) for x in value.shape]
            if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
                problems.append(f"{key!r} has shape {got}, expected [{spec.shape}] = {want}")
    if problems:
        raise ValueError(
            f"{where}: the batch does not match agl_lab.engines.base.BATCH_SCHEMA: "
            + "; ".join(problems)
            + " (build batches with agl_lab.batch.build_batch)"
        )
