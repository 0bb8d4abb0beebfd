"""The update-batch pipeline: a built batch → the batch the policy update trains on (pure).

    marked rows dropped (row by row, AGL v1)          selection.drop_marked_rows
    → advantages on the whole batch                    advantage.compute_advantages
    → whole mini-batches (zero-advantage groups first) selection.select_for_update
    → group and data metrics of the trained rows       advantage.group_metrics, estimators.compute_data_metrics
    → per-rollout loss weights                         loss.normalize_batch

With `drop_order="agl"` the alignment cut runs before the advantages, by row
(`selection.agl_alignment`), as AGL v1 does; the tail (metrics, loss weights) is the same.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from agl_lab.algorithms.advantage import check_estimator, compute_advantages, fill_reward_defaults, group_metrics
from agl_lab.algorithms.estimators import compute_data_metrics
from agl_lab.algorithms.loss import LOSS_NAME, normalize_batch
from agl_lab.algorithms.selection import agl_alignment, check_selection_args, drop_marked_rows, select_for_update
from agl_lab.rules import DROP_ORDERS, check_drop_order  # noqa: F401 (re-export)

logger = logging.getLogger(__name__)


def _data_metrics(data: Any) -> dict[str, Any]:
    """verl's `compute_data_metrics` numbers (critic/*, response_length/*), computed without verl
    (`estimators.compute_data_metrics`), when the batch has its keys."""
    needed = (
        "token_level_scores",
        "token_level_rewards",
        "advantages",
        "returns",
        "prompts",
        "responses",
        "attention_mask",
        "response_mask",
    )
    if not all(k in data.batch.keys() for k in needed):
        return {}
    return {k: float(v) for k, v in compute_data_metrics(data).items()}


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
    grpo_float32: bool = False,
) -> tuple[Any | None, list[dict[str, Any]], dict[str, Any]]:
    """marked drop → advantages → group metrics → alignment drops → per-rollout normalisation.

    Returns `(batch or None when the step is skipped, drop records, metrics)`. The batch's
    `advantages` are normalised for `per_rollout_mean` (raw ones stay in `rollout_advantages`,
    for `rollout_weights_table`); `critic/*` metrics are computed on the raw advantages.

    Parity switches (agl_lab.parity): `drop_order="agl"` runs AGL v1's row-level alignment
    (`agl_alignment`) before the advantages; `bf16_rewards` stores `token_level_scores` in
    bfloat16 as AGL v1 does (rewards, GRPO statistics and advantages inherit its precision);
    `grpo_float32` runs verl's estimator on the batch as it is (float32 group statistics: a group of
    equal rewards can get ±0.007 instead of 0) — by default statistics are float64 and equal-reward
    groups get exactly 0 (`advantage.run_estimator`).
    """
    check_drop_order(drop_order)
    check_selection_args(mini_batch_rows, max_ppo_update_times, selection_policy, small_batch)
    check_estimator(adv_estimator, rollout_level=rollout_level_advantage)
    if bf16_rewards:
        _rewards_in_bf16(data)
    fill_reward_defaults(data)
    advantages = functools.partial(
        compute_advantages,
        rollout_level=rollout_level_advantage,
        compute_advantage_fn=compute_advantage_fn,
        adv_estimator=adv_estimator,
        gamma=gamma,
        lam=lam,
        num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=algo_config,
        exact_zero=not grpo_float32,
    )
    # 0. rows the batch builder marked go first, row by row (AGL v1)
    kept, records, metrics = drop_marked_rows(data)
    counted = dict(metrics)  # n_sample_collected, n_sample_dropped/marked: of the batch as built
    data = data.select_idxs(kept)
    if len(data) == 0:
        logger.warning("skipping this training step: every row was marked for dropping")
        return None, records, {**metrics, "training/n_sample_trained": 0, "training/skipped_steps": 1}
    # 1-2. advantages and the alignment drops, in the order drop_order says
    align = dict(mini_batch_rows=mini_batch_rows, max_ppo_update_times=max_ppo_update_times, seed=seed)
    if drop_order == "agl":
        data, step_records, step_metrics = _alignment_then_advantages(data, advantages, **align)
    else:
        data, step_records, step_metrics = _advantages_then_selection(
            data, advantages, policy=selection_policy, small_batch=small_batch, **align
        )
    step_metrics.update(counted)  # both recount the marked drop on the rows they were given: keep the batch's
    records += step_records
    metrics.update(step_metrics)
    if data is None:
        return None, records, metrics
    # 3. the trained rows: their metrics, then every rollout carries the same loss weight
    metrics.update(_trained_metrics(data))
    if loss_mode == LOSS_NAME:
        normalize_batch(data, divisor)
    return data, records, metrics


def _rewards_in_bf16(data: Any) -> None:
    """`token_level_scores` and `token_level_rewards` stored in bfloat16, as AGL v1 stores them."""
    import torch

    for key in ("token_level_scores", "token_level_rewards"):
        if key in data.batch.keys():
            data.batch[key] = data.batch[key].to(torch.bfloat16)


def _alignment_then_advantages(
    data: Any, advantages: Callable[[Any], tuple[Any, dict[str, Any]]], **alignment: Any
) -> tuple[Any | None, list[dict[str, Any]], dict[str, Any]]:
    """AGL v1's order: align rows first (`agl_alignment`), advantages on what is left.

    Returns `(the aligned batch with advantages, or None when the step is skipped, records, metrics)`;
    the batch's marked rows are gone already, so the records are alignment drops only."""
    kept, records, metrics = agl_alignment(data, **alignment)
    if metrics["training/skipped_steps"]:
        logger.warning("skipping this training step: no trainable batch after drop+floor (AGL v1 drop order)")
        return None, records, metrics
    data, adv_metrics = advantages(data.select_idxs(kept))
    return data, records, {**metrics, **adv_metrics}


def _advantages_then_selection(
    data: Any, advantages: Callable[[Any], tuple[Any, dict[str, Any]]], **selection: Any
) -> tuple[Any | None, list[dict[str, Any]], dict[str, Any]]:
    """agl_lab's order: advantages on the whole batch, then whole mini-batches (`select_for_update`:
    zero-advantage groups first, then whole rollouts, seeded).

    Returns `(the selected rows, or None when the step is skipped, records, metrics)`."""
    data, adv_metrics = advantages(data)
    metrics = {**adv_metrics, **group_metrics(data, "_collected")}  # before the alignment drops (agl_lab's own)
    kept, records, sel_metrics = select_for_update(data, **selection)
    metrics.update(sel_metrics)
    if sel_metrics["training/skipped_steps"]:
        return None, records, metrics
    return data.select_idxs(kept), records, metrics


def _trained_metrics(data: Any) -> dict[str, Any]:
    """The trained rows' metrics: their count, their groups (AGL v1 counts the groups of the
    trained batch) and verl's data metrics."""
    return {"critic/n_transition_after_dropping": len(data), **group_metrics(data), **_data_metrics(data)}
