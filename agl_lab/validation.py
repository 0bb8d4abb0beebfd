"""Validation stage: completed validation rollouts → AGL v1's `val/*` metrics (pure).

Validation rollouts are never batched, so their numbers come straight from the rollouts:

| metric                                      | value                                          |
|---------------------------------------------|------------------------------------------------|
| `val/reward`                                | mean final reward (missing → `reward_fillna_value`) |
| `val/n_rollouts`, `_w_trace`, `_w_reward`   | rollouts, those with calls, those with a reward |
| `val/mean_response_length_per_turn`         | mean over traced rollouts of response tokens / calls |
| `val/mean_total_response_length_per_rollout`| mean response tokens per traced rollout        |
| `val/turn_count`                            | mean calls per traced rollout                  |

A *compact trajectory* is `{rollout_id, reward, prompt, response}` of a rollout's last call,
decoded; the metrics logger uploads them to W&B (all of validation, 24 per training step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agl_lab.batch import rollout_reward
from agl_lab.diagnose import decode_ids
from agl_lab.records import CompletedRollout, sort_rollouts


@dataclass
class ValidationResult:
    """What `build_validation` returns: the `val/*` metrics and all compact trajectories."""

    metrics: dict[str, float]
    trajectories: list[dict[str, Any]]


def compact_trajectories(
    rollouts: Sequence[CompletedRollout], reward_fillna_value: float, tokenizer: Any = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """{rollout_id, reward, prompt, response} of each rollout's last call (sorted, with trace)."""
    records = []
    for r in sort_rollouts(rollouts):
        if not r.triplets:
            continue
        if limit is not None and len(records) >= limit:
            break
        last = r.triplets[-1]
        records.append(
            {
                "rollout_id": r.rollout_id,
                "reward": rollout_reward(r, reward_fillna_value),
                "prompt": decode_ids(last.prompt_ids, tokenizer),
                "response": decode_ids(last.response_ids, tokenizer),
            }
        )
    return records


def build_validation(
    completed: Sequence[CompletedRollout], reward_fillna_value: float = 0.0, tokenizer: Any = None
) -> ValidationResult:
    """`val/*` metrics of AGL v1 (`get_test_metrics`) and every compact trajectory."""
    rollouts = sort_rollouts(completed)
    traced = [r for r in rollouts if r.triplets]
    if not traced:
        raise RuntimeError(
            f"zero validation rollouts with model calls ({len(rollouts)} rollouts): the agents did not "
            "call the model through the gateway (use the base_url their rollout gives them), or every "
            "validation rollout failed before its first call (see RolloutResult.rollouts[i].state)."
        )
    totals = [sum(len(t.response_ids) for t in r.triplets) for r in traced]
    metrics = {
        "val/reward": float(np.mean([rollout_reward(r, reward_fillna_value) for r in rollouts])),
        "val/n_rollouts": len(rollouts),
        "val/n_rollouts_w_trace": len(traced),
        "val/n_rollouts_w_reward": sum(r.final_reward is not None for r in rollouts),
        "val/mean_response_length_per_turn": float(np.mean([t / len(r.triplets) for t, r in zip(totals, traced)])),
        "val/mean_total_response_length_per_rollout": float(np.mean(totals)),
        "val/turn_count": float(np.mean([len(r.triplets) for r in traced])),
    }
    return ValidationResult(metrics, compact_trajectories(rollouts, reward_fillna_value, tokenizer))


def validation_metrics(completed: Sequence[CompletedRollout], reward_fillna_value: float = 0.0) -> dict[str, float]:
    """The `val/*` metrics only (see `build_validation`)."""
    return build_validation(completed, reward_fillna_value).metrics
