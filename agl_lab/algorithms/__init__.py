"""The learning algorithms, pure: rollout-level advantage, selection, per-rollout loss.

An agent rollout becomes one training row (trajectory level, merged) or several
(transition level, or after a merge break). GRPO compares *rollouts* of a task, so the
learning side must make every rollout count once, however many rows it produced:

1. **Rollout-level advantage** (`advantage.py`) — run the advantage estimator (verl's
   `compute_advantage` numbers; GRPO and RLOO computed in `estimators.py` without importing verl
   or Ray) on one representative row per rollout, then broadcast the scalar
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

`prepare_update_batch` (`pipeline.py`) chains them in that order. Every function is pure: a batch
(verl's `DataProto` or agl_lab's verl-free `BatchData`) / tensors in, `(result, metrics)` out (the tensor-valued `normalize_advantages_by_rollout`
returns just the tensor, like upstream). `register_loss()` puts `per_rollout_mean` in verl's
policy-loss registry (the engines call it when they are built; a Ray worker through the setup
hook `agl_lab.algorithms.register_in_worker`). The accepted values and checks of the learning
keys live in the pure-Python `agl_lab.rules` (re-exported here), so `agl_lab.config` needs none
of this package.

The batch keys they read and write (`response_mask`, `token_level_scores/rewards`,
`advantages`, `returns`, `rollout_advantages`, `is_drop_mask`, `rollout_id_list`, `uid` /
`data_id_list`) are declared once, with shapes and writers, in `agl_lab.engines.base.BATCH_SCHEMA`.
"""

from __future__ import annotations

from agl_lab.algorithms.advantage import (
    GROUP_BASELINE_ESTIMATORS,
    OUTCOME_HINT,
    TOKEN_LEVEL_ESTIMATORS,
    ZERO_RULES,
    check_estimator,
    compute_advantages,
    compute_rollout_level_advantage,
    fill_reward_defaults,
    group_keys,
    group_metrics,
    rollout_ids,
    rollout_index,
    row_scores,
    run_estimator,
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
    register_loss,
    rollout_weights_table,
)
from agl_lab.algorithms.pipeline import DROP_ORDERS, prepare_update_batch
from agl_lab.algorithms.selection import (
    SELECTION_POLICIES,
    SMALL_BATCH_CHOICES,
    agl_alignment,
    check_selection_args,
    drop_marked_rows,
    marked_rows,
    select_for_update,
    skip_reason,
    skipped_step,
    target_rows,
)

__all__ = [
    "DIVISORS",
    "DROP_ORDERS",
    "GROUP_BASELINE_ESTIMATORS",
    "ZERO_RULES",
    "run_estimator",
    "LOSS_NAME",
    "agl_alignment",
    "OUTCOME_HINT",
    "SELECTION_POLICIES",
    "SMALL_BATCH_CHOICES",
    "TOKEN_LEVEL_ESTIMATORS",
    "check_divisor",
    "check_estimator",
    "check_selection_args",
    "compute_advantages",
    "compute_policy_loss_per_rollout_mean",
    "compute_rollout_level_advantage",
    "drop_marked_rows",
    "fill_reward_defaults",
    "group_keys",
    "group_metrics",
    "marked_rows",
    "normalize_advantages_by_rollout",
    "normalize_batch",
    "prepare_update_batch",
    "register_in_worker",
    "register_loss",
    "rollout_ids",
    "rollout_index",
    "rollout_weights_table",
    "row_scores",
    "select_for_update",
    "skip_reason",
    "skipped_step",
    "target_rows",
    "zero_advantage_groups",
]
