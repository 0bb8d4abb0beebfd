"""The learning algorithms, pure: rollout-level advantage, selection, per-rollout loss.

An agent rollout becomes one training row (trajectory level, merged) or several
(transition level, or after a merge break). GRPO compares *rollouts* of a task, so the
learning side must make every rollout count once, however many rows it produced:

1. **Rollout-level advantage** (`advantage.py`) — run the advantage estimator (verl's own
   `compute_advantage`) on one representative row per rollout, then broadcast the scalar
   advantage to every row of the rollout. A rollout with five rows weighs as much in its
   group's mean/std as a rollout with one.
2. **Selection for the update** (`selection.py`) — drop rows marked by the batch builder,
   then cut the batch to whole PPO mini-batches. Unlike AGL v1 we compute advantages
   *before* this cut, drop whole zero-advantage groups first (they carry no policy
   gradient), then whole rollouts at random with a seeded RNG, never part of a rollout, and
   never skip a step silently. Every drop is a metric *and* a record (a row of a DataFrame).
3. **Per-rollout normalisation + `per_rollout_mean` loss** (`loss.py`) — divide every
   token's advantage by (loss tokens of its rollout × D) and sum the token losses. Each
   rollout then carries the same total weight 1/D. D is the number of *rollouts* in the
   batch (tech report Eq. 16, our default) or the number of *rows* (AGL v1, kept for
   parity). `rollout_weights_table` shows who carries the loss.

`prepare_update_batch` below chains them in that order. Every function is pure: DataProto /
tensors in, `(result, metrics)` out (the tensor-valued `normalize_advantages_by_rollout`
returns just the tensor, like upstream). Importing this package registers `per_rollout_mean`
in verl's policy-loss registry, so a Ray worker only needs the setup hook
`agl_lab.algorithms.register_in_worker`.

Batch keys used (N rows, R response positions):

| key                         | shape      | meaning                                            |
|-----------------------------|------------|----------------------------------------------------|
| `response_mask`             | [N, R]     | 1 on model-sampled tokens (the loss tokens)        |
| `token_level_scores/rewards`| [N, R]     | the rollout's reward on the last response token    |
| `advantages`, `returns`     | [N, R]     | written here                                       |
| `rollout_advantages`        | [N, R]     | the raw advantages, kept when `advantages` are normalised |
| `is_drop_mask`              | [N] bool   | rows the batch builder marked (prompt too long)    |
| `rollout_id_list`           | [N] object | the rollout of each row                            |
| `uid` / `data_id_list`      | [N] object | the group (task in this step) of each row          |
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agl_lab.algorithms.advantage import (
    OUTCOME_HINT,
    TOKEN_LEVEL_ESTIMATORS,
    check_estimator,
    compute_advantages,
    compute_rollout_level_advantage,
    fill_reward_defaults,
    group_keys,
    group_metrics,
    rollout_ids,
    rollout_index,
    row_scores,
    zero_advantage_groups,
)
from agl_lab.algorithms.loss import (
    DIVISORS,
    LOSS_NAME,
    check_divisor,
    compute_policy_loss_per_rollout_mean,
    normalize_advantages_by_rollout,
    normalize_batch,
    register_in_worker,
    rollout_weights_table,
)
from agl_lab.algorithms.selection import (
    SELECTION_POLICIES,
    agl_alignment,
    SMALL_BATCH_CHOICES,
    check_selection_args,
    drop_marked_rows,
    marked_rows,
    select_for_update,
    skip_reason,
    skipped_step,
    target_rows,
)

__all__ = [
    "DIVISORS", "DROP_ORDERS", "LOSS_NAME", "agl_alignment", "OUTCOME_HINT", "SELECTION_POLICIES", "SMALL_BATCH_CHOICES",
    "TOKEN_LEVEL_ESTIMATORS", "check_divisor", "check_estimator", "check_selection_args",
    "compute_advantages", "compute_policy_loss_per_rollout_mean", "compute_rollout_level_advantage",
    "drop_marked_rows", "fill_reward_defaults", "group_keys", "group_metrics", "marked_rows",
    "normalize_advantages_by_rollout", "normalize_batch", "prepare_update_batch", "register_in_worker",
    "rollout_ids", "rollout_index", "rollout_weights_table", "row_scores", "select_for_update", "skip_reason",
    "skipped_step", "target_rows", "zero_advantage_groups",
]

logger = logging.getLogger(__name__)

#: agl_lab.parity.drop_order: after_advantage (agl_lab) | agl (AGL v1: before advantages, by row)
DROP_ORDERS = ("after_advantage", "agl")


def _data_metrics(data: Any) -> dict[str, Any]:
    """verl's `compute_data_metrics` (critic/*, response_length/*) when the batch has its keys."""
    needed = ("token_level_scores", "token_level_rewards", "advantages", "returns", "prompts",
              "responses", "attention_mask", "response_mask")
    if not all(k in data.batch.keys() for k in needed):
        return {}
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    return {k: float(v) for k, v in compute_data_metrics(data, use_critic=False).items()}


def prepare_update_batch(
    data: Any,
    *,
    mini_batch_rows: int,
    adv_estimator: Any = "grpo",
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    rollout_level_advantage: bool = True,
    algo_config: Any = None,
    max_ppo_update_times: int | None = None,
    seed: int = 0,
    selection_policy: str = "zero_adv_first",
    small_batch: str = "train",
    loss_mode: str = LOSS_NAME,
    divisor: str = "rollouts",
    compute_advantage_fn: Callable[..., Any] | None = None,
    drop_order: str = "after_advantage",
    bf16_rewards: bool = False,
) -> tuple[Any | None, list[dict[str, Any]], dict[str, Any]]:
    """marked drop → advantages → group metrics → alignment drops → per-rollout normalisation.

    Returns `(batch or None when the step is skipped, drop records, metrics)`. The batch's
    `advantages` are normalised for `per_rollout_mean` (raw ones stay in `rollout_advantages`,
    for `rollout_weights_table`); `critic/*` metrics are computed on the raw advantages.

    Parity switches (agl_lab.parity): `drop_order="agl"` runs AGL v1's row-level alignment
    (`agl_alignment`) before the advantages; `bf16_rewards` stores `token_level_scores` in
    bfloat16 as AGL v1 does (rewards, GRPO statistics and advantages inherit its precision).
    """
    if drop_order not in DROP_ORDERS:
        raise ValueError(f"agl_lab.parity.drop_order={drop_order!r} is not one of {list(DROP_ORDERS)}")
    if bf16_rewards:
        import torch

        for key in ("token_level_scores", "token_level_rewards"):
            if key in data.batch.keys():
                data.batch[key] = data.batch[key].to(torch.bfloat16)
    check_selection_args(mini_batch_rows, max_ppo_update_times, selection_policy, small_batch)
    check_estimator(adv_estimator, rollout_level=rollout_level_advantage)
    fill_reward_defaults(data)
    # 0. rows the batch builder marked go first, row by row (AGL v1)
    kept, records, metrics = drop_marked_rows(data)
    collected = {k: metrics[k] for k in ("training/n_sample_collected", "training/n_sample_dropped/marked")}
    data = data.select_idxs(kept)
    if len(data) == 0:
        logger.warning("skipping this training step: every row was marked for dropping")
        return None, records, {**metrics, "training/n_sample_trained": 0, "training/skipped_steps": 1}

    if drop_order == "agl":  # AGL v1: align rows first, advantages on what is left
        return _agl_order(data, records, metrics, mini_batch_rows, max_ppo_update_times, seed, loss_mode, divisor,
                          dict(rollout_level=rollout_level_advantage, compute_advantage_fn=compute_advantage_fn,
                               adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                               norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=algo_config))

    # 1. advantages on the whole batch, before any alignment drop
    data, adv_metrics = compute_advantages(
        data, rollout_level=rollout_level_advantage, compute_advantage_fn=compute_advantage_fn,
        adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=algo_config)
    metrics.update(adv_metrics)
    metrics.update(group_metrics(data, "_collected"))  # before the alignment drops (agl_lab's own)

    # 2. whole mini-batches: zero-advantage groups first, then whole rollouts, seeded
    kept, sel_records, sel_metrics = select_for_update(
        data, mini_batch_rows=mini_batch_rows, max_ppo_update_times=max_ppo_update_times, seed=seed,
        policy=selection_policy, small_batch=small_batch)
    records += sel_records
    metrics.update({**sel_metrics, **collected})
    if sel_metrics["training/skipped_steps"]:
        return None, records, metrics
    data = data.select_idxs(kept)
    metrics["critic/n_transition_after_dropping"] = len(data)
    metrics.update(group_metrics(data))  # AGL v1 counts the groups of the trained batch
    metrics.update(_data_metrics(data))

    # 3. every rollout carries the same loss weight
    if loss_mode == LOSS_NAME:
        normalize_batch(data, divisor)
    return data, records, metrics


def _agl_order(data: Any, records: list, metrics: dict, mini_batch_rows: int, max_updates: int | None, seed: int,
               loss_mode: str, divisor: str, adv_kwargs: dict) -> tuple[Any | None, list, dict]:
    """AGL v1's order: row-level alignment (`agl_alignment`) → advantages → group metrics → loss weights."""
    kept, sel_records, sel_metrics = agl_alignment(data, mini_batch_rows=mini_batch_rows,
                                                   max_ppo_update_times=max_updates, seed=seed)
    records = records + sel_records  # marked rows are gone already: these are alignment drops only
    metrics = {**metrics, **sel_metrics}
    if sel_metrics["training/skipped_steps"]:
        logger.warning("skipping this training step: no trainable batch after drop+floor (AGL v1 drop order)")
        return None, records, metrics
    data = data.select_idxs(kept)
    data, adv_metrics = compute_advantages(data, **adv_kwargs)
    metrics.update(adv_metrics)
    metrics["critic/n_transition_after_dropping"] = len(data)
    metrics.update(group_metrics(data))
    metrics.update(_data_metrics(data))
    if loss_mode == LOSS_NAME:
        normalize_batch(data, divisor)
    return data, records, metrics
