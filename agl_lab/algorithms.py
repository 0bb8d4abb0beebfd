"""Rollout-level advantage, per-rollout loss normalisation, and what to train on.

An agent rollout becomes one training row (trajectory level, merged) or several
(transition level, or after a merge break). GRPO compares *rollouts* of a task, so the
learning side must make every rollout count once, however many rows it produced:

1. **Rollout-level advantage** — run the advantage estimator (verl's own
   `compute_advantage`) on one representative row per rollout, then broadcast the scalar
   advantage to every row of the rollout. A rollout with five rows weighs as much in its
   group's mean/std as a rollout with one.
2. **Per-rollout normalisation + `per_rollout_mean` loss** — divide every token's advantage
   by (loss tokens of its rollout × D) and sum the token losses. Each rollout then carries
   the same total weight 1/D. D is the number of *rollouts* in the batch (tech report
   Eq. 16, our default) or the number of *rows* (AGL v1, kept for parity).
3. **Selection for the update** — drop rows marked by the batch builder, then cut the
   batch to whole PPO mini-batches. Unlike AGL v1 we compute advantages *before* this cut,
   drop whole zero-advantage groups first (they carry no policy gradient), then whole
   rollouts at random with a seeded RNG, never part of a rollout, and never skip a step
   silently. Every drop is a metric *and* a record (a row of a DataFrame).

Every function here is pure: DataProto / tensors in, `(result, metrics)` out (the
tensor-valued `normalize_advantages_by_rollout` returns just the tensor, like upstream).
Importing this module registers `per_rollout_mean` in verl's policy-loss registry, so a Ray
worker only needs `import agl_lab.algorithms` (see `register_in_worker`).

Batch keys used (N rows, R response positions):

| key                         | shape      | meaning                                            |
|-----------------------------|------------|----------------------------------------------------|
| `response_mask`             | [N, R]     | 1 on model-sampled tokens (the loss tokens)        |
| `token_level_scores/rewards`| [N, R]     | the rollout's reward on the last response token    |
| `advantages`, `returns`     | [N, R]     | written here                                       |
| `is_drop_mask`              | [N] bool   | rows the batch builder marked (prompt too long)    |
| `rollout_id_list`           | [N] object | the rollout of each row                            |
| `uid` / `data_id_list`      | [N] object | the group (task in this step) of each row          |
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss
from verl.utils.torch_functional import masked_mean, masked_sum

logger = logging.getLogger(__name__)

LOSS_NAME = "per_rollout_mean"
DIVISORS = ("rollouts", "rows")
SELECTION_POLICIES = ("zero_adv_first", "random")
SMALL_BATCH_CHOICES = ("train", "skip")

# Estimators whose advantages vary along the tokens of a row: nothing scalar to broadcast.
_TOKEN_LEVEL_ESTIMATORS = ("gae", "optimal_token_baseline", "tir_optimal_token_baseline")
_OUTCOME_HINT = "grpo, rloo, grpo_passk, reinforce_plus_plus_baseline, opo or gpg"


# =============================================================================================
# Row ↔ rollout ↔ group bookkeeping
# =============================================================================================


def rollout_index(rollout_ids: Sequence[Any]) -> tuple[list[Any], np.ndarray]:
    """Rollouts in first-occurrence order and, per row, the position of its rollout.

    Returns `(rollouts [n_rollouts], pos [N] int64)` with `rollouts[pos[i]] == rollout_ids[i]`.
    """
    order: dict[Any, int] = {}
    pos = np.empty(len(rollout_ids), dtype=np.int64)
    for i, rid in enumerate(rollout_ids):
        pos[i] = order.setdefault(rid, len(order))
    return list(order), pos


def _group_keys(data: DataProto) -> np.ndarray | None:
    nt = data.non_tensor_batch
    if "uid" in nt:
        return nt["uid"]
    return nt.get("data_id_list")


def _row_scores(data: DataProto) -> torch.Tensor | None:
    """Scalar reward of each row [N] (float64), from scores (pre-KL) or rewards."""
    for key in ("token_level_scores", "token_level_rewards"):
        if key in data.batch.keys():
            return data.batch[key].double().sum(-1)
    return None


def _zero_variance_flags(keys: np.ndarray, scores: torch.Tensor) -> dict[Any, bool]:
    """Per group key: are all its row rewards `allclose` to the first one?"""
    rows: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        rows.setdefault(k, []).append(i)
    return {k: bool(torch.allclose(scores[idx], scores[idx[0]].expand(len(idx)))) for k, idx in rows.items()}


def zero_variance_groups(data: DataProto) -> list[Any]:
    """Groups (uid, else data_id) whose rows all share one reward: GRPO gives them A = 0.

    Returns the group keys in first-occurrence order; `[]` when groups or rewards are absent.
    """
    keys, scores = _group_keys(data), _row_scores(data)
    if keys is None or scores is None:
        return []
    return [k for k, zero in _zero_variance_flags(keys, scores).items() if zero]


def group_metrics(data: DataProto) -> dict[str, int]:
    """`training/n_groups` and `training/n_zero_adv_groups` (all rewards equal); `{}` if no groups."""
    keys, scores = _group_keys(data), _row_scores(data)
    if keys is None or scores is None:
        return {}
    flags = _zero_variance_flags(keys, scores)
    return {"training/n_groups": len(flags), "training/n_zero_adv_groups": sum(flags.values())}


# =============================================================================================
# 1. Rollout-level advantage (verl's estimator on one row per rollout, then broadcast)
# =============================================================================================


def check_estimator(adv_estimator: Any, *, rollout_level: bool = True) -> str:
    """Name of the estimator; raise for the ones this pipeline cannot run."""
    name = str(getattr(adv_estimator, "value", adv_estimator))
    if name == "remax":
        raise NotImplementedError(
            "REMAX baseline not yet supported in agl_lab (it needs one extra greedy generation per "
            f"task); set algorithm.adv_estimator to an outcome estimator such as {_OUTCOME_HINT}")
    if rollout_level and name in _TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} gives token-varying advantages, which rollout-level "
            "advantage cannot broadcast: set algorithm.enable_rollout_level_advantage=false, or use "
            f"an outcome estimator ({_OUTCOME_HINT})")
    return name


def _verl_compute_advantage() -> Callable[..., DataProto]:
    # Lazy: ray_trainer pulls in Ray and the worker stack (~9 s); only needed here.
    from verl.trainer.ppo.ray_trainer import compute_advantage

    return compute_advantage


def _check_rollouts_consistent(data: DataProto, rollouts: list[Any], pos: np.ndarray) -> list[int]:
    """Validate that each rollout has one uid and one reward; return representative rows."""
    uids = data.non_tensor_batch["uid"]
    sums = data.batch["token_level_rewards"].float().sum(-1)
    reps: list[int] = []
    for r, rid in enumerate(rollouts):
        idx = np.flatnonzero(pos == r)
        reps.append(int(idx[0]))
        if len({uids[i] for i in idx}) > 1:
            raise RuntimeError(f"rollout-level advantage found multiple uid values for rollout_id={rid}")
        if not torch.allclose(sums[idx], sums[idx[0]].expand(len(idx))):
            raise RuntimeError(
                "rollout-level advantage requires all triplets for the same rollout_id to share the "
                f"same scalar token_level_rewards sum; got rollout_id={rid}")
    return reps


def _rollout_scalars(adv: torch.Tensor, mask: torch.Tensor, rollouts: list[Any]) -> torch.Tensor:
    """One advantage per rollout from its representative row [n_rollouts, R] → [n_rollouts]."""
    out = torch.empty(len(rollouts), dtype=adv.dtype)
    for r, rid in enumerate(rollouts):
        values = adv[r][mask[r].bool()]
        if values.numel() == 0:
            raise RuntimeError(f"rollout-level advantage cannot extract advantages for empty rollout_id={rid}")
        if not torch.allclose(values, values[0].expand_as(values)):
            raise RuntimeError(
                "rollout-level advantage requires scalar outcome-style advantages; got non-constant "
                f"token values for rollout_id={rid} (set algorithm.enable_rollout_level_advantage=false "
                "for token-level estimators)")
        out[r] = values[0]
    return out


def compute_rollout_level_advantage(
    data: DataProto,
    adv_estimator: Any,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    compute_advantage_fn: Callable[..., DataProto] | None = None,
) -> tuple[DataProto, dict[str, int]]:
    """Advantages once per rollout, broadcast to all its rows (writes `advantages`, `returns`).

    The estimator (verl's `compute_advantage` unless injected) sees one representative row
    per rollout (its first row), so for GRPO each rollout counts once in its group's mean
    and std. Then `advantages[i] = A[rollout(i)] × response_mask[i]` for every row i.

    Raises RuntimeError with AGL v1's messages for missing keys and inconsistent rollouts,
    ValueError for token-level estimators (GAE), NotImplementedError for REMAX.
    """
    check_estimator(adv_estimator)
    nt = data.non_tensor_batch
    if "rollout_id_list" not in nt:
        raise RuntimeError("rollout-level advantage requires rollout_id_list in non_tensor_batch")
    rollout_ids = nt["rollout_id_list"]
    if len(rollout_ids) != len(data):
        raise RuntimeError(f"rollout_id_list length ({len(rollout_ids)}) must match batch length ({len(data)})")
    if "uid" not in nt:
        if "data_id_list" not in nt:
            raise RuntimeError("rollout-level advantage requires uid or data_id_list in non_tensor_batch")
        nt["uid"] = nt["data_id_list"]
    for key in ("response_mask", "token_level_rewards"):
        if key not in data.batch.keys():
            raise RuntimeError(f"rollout-level advantage requires {key} in batch")

    rollouts, pos = rollout_index(rollout_ids)
    reps = _check_rollouts_consistent(data, rollouts, pos)
    estimator = compute_advantage_fn or _verl_compute_advantage()
    sub = estimator(
        data.select_idxs(np.asarray(reps, dtype=np.int64)), adv_estimator=adv_estimator, gamma=gamma,
        lam=lam, num_repeat=num_repeat, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)

    mask = data.batch["response_mask"]
    rep_mask = mask[torch.as_tensor(reps)]
    index = torch.as_tensor(pos)
    for key in ("advantages", "returns"):
        if key in sub.batch.keys():
            scalars = _rollout_scalars(sub.batch[key], rep_mask, rollouts)
            # Critical: broadcast through the row's own mask, so observation tokens stay at 0.
            data.batch[key] = scalars[index].unsqueeze(-1) * mask.to(scalars.dtype)

    rows_per_rollout = np.bincount(pos, minlength=len(rollouts))
    prefix = "training/rollout_level_advantage/"
    metrics = {
        prefix + "n_rows": len(data),
        prefix + "n_rollouts": len(rollouts),
        prefix + "n_multi_row_rollouts": int((rows_per_rollout > 1).sum()),
        prefix + "max_rows_per_rollout": int(rows_per_rollout.max()) if len(rollouts) else 0,
    }
    return data, metrics


# =============================================================================================
# 2. Per-rollout normalisation and the `per_rollout_mean` policy loss
# =============================================================================================


def _per_rollout_divisor(
    n_rows: int, n_rollouts: int, divisor: str, num_trained_rows: int | None, num_rollouts: int | None
) -> int:
    if divisor == "rows":
        d = n_rows if num_trained_rows is None else num_trained_rows
        if d <= 0:
            raise ValueError("num_trained_rows must be positive")
        return d
    if divisor == "rollouts":
        d = n_rollouts if num_rollouts is None else num_rollouts
        if d <= 0:
            raise ValueError("num_rollouts must be positive")
        return d
    raise ValueError(
        f"divisor={divisor!r} is not one of {list(DIVISORS)} (config key agl_lab.algorithm.normalize_by): "
        "'rollouts' follows the tech report (Eq. 16), 'rows' reproduces AGL v1")


def normalize_advantages_by_rollout(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_ids: Sequence[Any],
    num_trained_rows: int | None = None,
    *,
    divisor: str = "rollouts",
    num_rollouts: int | None = None,
) -> torch.Tensor:
    """Scale advantages so that every rollout carries the same total loss weight.

    | symbol | meaning                                                         |
    |--------|-----------------------------------------------------------------|
    | A      | advantages [N, R] (rollout-constant on the loss tokens)         |
    | m      | response_mask [N, R]                                            |
    | T_r    | Σ m over all rows of rollout r (its loss tokens in this batch)  |
    | D      | distinct rollouts (divisor="rollouts", default; Eq. 16) or      |
    |        | num_trained_rows (divisor="rows", AGL v1; default N)            |

    Returns Â [N, R] with Â[i] = A[i] / max(T_r × D, 1) for i in rollout r (in A's dtype).
    Summed over its tokens, rollout r then has mass A_r / D: a rollout's weight does not grow
    with its token count or its number of rows. `num_rollouts` overrides D for "rollouts".
    """
    n = advantages.shape[0]
    if len(rollout_ids) != n:
        raise ValueError(f"rollout_ids length ({len(rollout_ids)}) must match advantages rows ({n})")
    rollouts, pos = rollout_index(rollout_ids)
    d = _per_rollout_divisor(n, len(rollouts), divisor, num_trained_rows, num_rollouts)
    index = torch.as_tensor(pos, device=advantages.device)
    row_tokens = response_mask.to(advantages.dtype).sum(-1)                       # [N]
    tokens = torch.zeros(len(rollouts), dtype=advantages.dtype, device=advantages.device)
    tokens.index_add_(0, index, row_tokens)                                       # T_r
    denom = torch.clamp(tokens[index] * d, min=1.0)                               # [N]
    return advantages / denom.unsqueeze(-1)


def _dp_size(config: Any) -> int:
    info = getattr(config, "global_batch_info", None) or {}
    return int(info.get("dp_size") or 1)


def _clip_ranges(config: Any) -> tuple[float, float, float]:
    clip = config.clip_ratio
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    c = getattr(config, "clip_ratio_c", None)
    c = 3.0 if c is None else c
    assert c > 1.0, f"clip_ratio_c must be greater than 1.0, got {c}"
    return (clip if low is None else low), (clip if high is None else high), c


def compute_policy_loss_per_rollout_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Dual-clip PPO loss, token **sum** × dp_size (the mean lives in the advantages).

    Same arguments and return as verl 0.9.1's `compute_policy_loss_vanilla` (all [N, R]);
    `loss_agg_mode` is ignored. With d = clamp(log π − log π_old, ±20), ρ = e^d:
    L = max(−Âρ, −Â·clip(ρ, 1−ε_low, 1+ε_high)), and for Â < 0 also min(·, −Â·c).
    pg_loss = Σ_tokens L × dp_size, where dp_size undoes data-parallel gradient averaging.
    Call it with advantages from `normalize_advantages_by_rollout`.
    """
    assert config is not None, "per_rollout_mean loss requires the actor config"
    clip_low, clip_high, clip_c = _clip_ranges(config)
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).float(), response_mask)

    loss3 = -advantages * clip_c  # dual clip: bound the loss of negative-advantage tokens
    dual = torch.min(loss3, clipped)
    pg_clipfrac_lower = masked_mean(torch.gt(clipped, loss3) * (advantages < 0).float(), response_mask)
    per_token = torch.where(advantages < 0, dual, clipped)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights

    # Critical: a plain sum — dividing again (token-mean) would undo the per-rollout weights.
    pg_loss = masked_sum(per_token, response_mask) * _dp_size(config)
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, metrics


def _register_loss() -> None:
    existing = POLICY_LOSS_REGISTRY.get(LOSS_NAME)
    if existing is compute_policy_loss_per_rollout_mean:
        return  # already ours (module imported twice through different paths)
    if existing is not None and getattr(existing, "__module__", None) != __name__:
        logger.warning("replacing policy loss %r registered by %s with agl_lab's",
                       LOSS_NAME, getattr(existing, "__module__", existing))
    register_policy_loss(LOSS_NAME)(compute_policy_loss_per_rollout_mean)


_register_loss()


def register_in_worker() -> None:
    """Ray `worker_process_setup_hook`: importing this module already registered the loss."""


# =============================================================================================
# 3. What to train on: marked rows, mini-batch alignment, small batches
# =============================================================================================


def _drop_record(data: DataProto, rollout_id: Any, row: int, rows: int, reason: str) -> dict[str, Any]:
    data_ids = data.non_tensor_batch.get("data_id_list")
    return {"rollout_id": rollout_id, "data_id": None if data_ids is None else data_ids[row],
            "rows": int(rows), "reason": reason}


def _rollout_ids(data: DataProto) -> np.ndarray:
    ids = data.non_tensor_batch.get("rollout_id_list")
    # Without rollout ids every row is its own rollout (a plain verl batch).
    return np.arange(len(data)) if ids is None else ids


def drop_marked_rows(data: DataProto) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, int]]:
    """Rows the batch builder marked (`is_drop_mask`): dropped row by row, as AGL v1 does.

    Returns `(kept_index [K] int64, records, metrics)`; one record per affected rollout.
    """
    n = len(data)
    marked = (data.batch["is_drop_mask"].bool().cpu().numpy() if "is_drop_mask" in data.batch.keys()
              else np.zeros(n, dtype=bool))
    records: list[dict[str, Any]] = []
    rollouts, pos = rollout_index(_rollout_ids(data))
    for r in np.unique(pos[marked]):
        rows = np.flatnonzero(marked & (pos == r))
        records.append(_drop_record(data, rollouts[r], int(rows[0]), len(rows), "marked"))
    metrics = {"training/n_sample_collected": n, "training/n_sample_dropped/marked": int(marked.sum())}
    return np.flatnonzero(~marked), records, metrics


def _target_rows(n: int, mini_batch_rows: int, max_updates: int | None, small_batch: str) -> int:
    """Rows to keep: whole mini-batches, at most `max_updates` of them; small batch → n or 0."""
    if n < mini_batch_rows:
        return n if small_batch == "train" else 0
    target = (n // mini_batch_rows) * mini_batch_rows
    if max_updates is not None:
        target = min(target, mini_batch_rows * max_updates)
    return target


def _plan_drops(rows: np.ndarray, zero_adv: np.ndarray, group: list[Any], need: int,
                rng: np.random.Generator, policy: str) -> list[tuple[int, str]]:
    """Choose whole rollouts to drop so that about `need` rows go; returns (rollout, reason).

    rows [n_rollouts] rows per rollout; zero_adv [n_rollouts] bool; group [n_rollouts] key.
    Phase A drops whole zero-variance groups that fit in `need` (random order); phase B whole
    rollouts that fit — zero-advantage ones first — in random order. Rollouts may have several
    rows, so the fitting drops can stop short of `need`; phase C then drops the smallest
    remaining rollout: the batch ends *below* the target and the update's last mini-batch is
    partial. That keeps the cap on updates and never cuts a rollout. Only when one rollout is
    left (dropping it would empty the batch) do we keep it: `need` extra rows are trained.
    """
    dropped = np.zeros(len(rows), dtype=bool)
    plan: list[tuple[int, str]] = []
    if policy != "zero_adv_first":
        zero_adv = np.zeros(len(rows), dtype=bool)  # "random": zero advantage earns no priority

    def drop(r: int, reason: str) -> None:
        nonlocal need
        dropped[r] = True
        need -= int(rows[r])
        plan.append((r, reason))

    if policy == "zero_adv_first":
        groups = list(dict.fromkeys(group[r] for r in np.flatnonzero(zero_adv)))
        for g in rng.permutation(len(groups)):
            members = [r for r in range(len(rows)) if group[r] == groups[g]]
            if rows[members].sum() <= need:
                for r in members:
                    drop(r, "zero_adv_group")
        tiers = [np.flatnonzero(zero_adv & ~dropped), np.flatnonzero(~zero_adv & ~dropped)]
    else:
        tiers = [np.flatnonzero(~dropped)]
    for tier in tiers:
        for r in rng.permutation(tier):
            if rows[r] <= need:
                drop(int(r), "zero_adv_rollout" if zero_adv[r] else "random")
    left = np.flatnonzero(~dropped)
    if need > 0 and len(left) > 1:
        # smallest rollout, zero-advantage first, random among ties
        key = np.lexsort((rng.random(len(left)), rows[left], ~zero_adv[left]))
        r = int(left[key[0]])
        drop(r, "zero_adv_rollout" if zero_adv[r] else "random")
    return plan


def _check_selection_args(mini_batch_rows: int, max_ppo_update_times: int | None, policy: str,
                          small_batch: str) -> None:
    if mini_batch_rows <= 0:
        raise ValueError(f"mini_batch_rows must be positive (actor.ppo_mini_batch_size × rollout.n), "
                         f"got {mini_batch_rows}")
    if max_ppo_update_times is not None and max_ppo_update_times <= 0:
        raise ValueError("agentlightning.max_ppo_update_times must be null or a positive integer, "
                         f"got {max_ppo_update_times}")
    if policy not in SELECTION_POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {list(SELECTION_POLICIES)}")
    if small_batch not in SMALL_BATCH_CHOICES:
        raise ValueError(f"small_batch={small_batch!r} is not one of {list(SMALL_BATCH_CHOICES)} "
                         "(config key agl_lab.algorithm.small_batch)")


def select_for_update(
    data: DataProto,
    *,
    mini_batch_rows: int,
    max_ppo_update_times: int | None = None,
    seed: int = 0,
    policy: str = "zero_adv_first",
    small_batch: str = "train",
) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, Any]]:
    """Rows to train on: marked rows out, then whole rollouts out until whole mini-batches remain.

    Target rows = ⌊n / mini_batch_rows⌋ × mini_batch_rows, capped at mini_batch_rows ×
    `max_ppo_update_times`. Drops are whole zero-variance groups first, then whole rollouts
    (zero-advantage ones first) drawn with `np.random.default_rng(seed)` — same seed, same
    drops (see `_plan_drops` for how a multi-row rollout can end the batch below target).
    A batch smaller than one mini-batch is trained as one smaller mini-batch
    (`small_batch="train"`) or the step is skipped (`"skip"`: metric training/skipped_steps=1).

    Compute advantages *before* calling this (after `drop_marked_rows`): dropping a rollout
    must not change the advantages of the rollouts kept.

    Returns `(kept_index [K] int64 ascending, records, metrics)`; records are dicts
    `{rollout_id, data_id, rows, reason}` with reason in marked | zero_adv_group |
    zero_adv_rollout | random | small_batch_skip.
    """
    _check_selection_args(mini_batch_rows, max_ppo_update_times, policy, small_batch)
    alive, records, metrics = drop_marked_rows(data)
    n = len(alive)
    target = _target_rows(n, mini_batch_rows, max_ppo_update_times, small_batch)
    t = _alive_rollouts(data, alive)
    if target == 0:
        plan = [(r, "small_batch_skip") for r in range(len(t["ids"]))]
        if n == 0:
            logger.warning("skipping this training step: no trainable rows left after the marked drop")
        else:
            logger.warning("skipping this training step: %d trainable rows is fewer than one mini-batch "
                           "(%d rows) and agl_lab.algorithm.small_batch='skip'", n, mini_batch_rows)
    else:
        if n < mini_batch_rows:
            logger.info("training %d rows as one mini-batch smaller than ppo_mini_batch_size × n = %d rows",
                        n, mini_batch_rows)
        plan = _plan_drops(t["rows"], t["zero_adv"], t["group"], n - target, np.random.default_rng(seed), policy)

    rows, gone = t["rows"], np.zeros(len(t["ids"]), dtype=bool)
    for r, reason in plan:
        gone[r] = True
        records.append(_drop_record(data, t["ids"][r], t["first_row"][r], rows[r], reason))
    kept = alive[~gone[t["pos"]]]
    metrics.update({
        "training/n_sample_dropped/same_reward": sum(int(rows[r]) for r, why in plan if why.startswith("zero_adv")),
        "training/n_sample_dropped/random": sum(int(rows[r]) for r, why in plan if why == "random"),
        "training/n_sample_dropped/small_batch": n if target == 0 else 0,
        "training/n_dropped_groups/zero_adv": len({t["group"][r] for r, why in plan if why == "zero_adv_group"}),
        "training/n_sample_target": target,
        "training/n_sample_trained": len(kept),
        "training/n_mini_batches": math.ceil(len(kept) / mini_batch_rows),
        "training/skipped_steps": int(target == 0),
    })
    return kept, records, metrics


def _alive_rollouts(data: DataProto, alive: np.ndarray) -> dict[str, Any]:
    """Per rollout among the `alive` rows: ids, rows, first row, group key, zero-advantage flag."""
    ids, pos = rollout_index(np.asarray(_rollout_ids(data))[alive])
    first_row = [int(alive[np.flatnonzero(pos == r)[0]]) for r in range(len(ids))]
    keys = _group_keys(data)
    group = [None if keys is None else keys[i] for i in first_row]
    zero_groups = set(zero_variance_groups(data.select_idxs(alive))) if len(alive) else set()
    return {"ids": ids, "pos": pos, "rows": np.bincount(pos, minlength=len(ids)), "first_row": first_row,
            "group": group, "zero_adv": np.array([g in zero_groups for g in group], dtype=bool)}


# =============================================================================================
# 4. The whole chain in upstream's order, with the improvements
# =============================================================================================


def _data_metrics(data: DataProto) -> dict[str, Any]:
    """verl's `compute_data_metrics` (critic/*, response_length/*) when the batch has its keys."""
    needed = ("token_level_scores", "token_level_rewards", "advantages", "returns", "prompts",
              "responses", "attention_mask", "response_mask")
    if not all(k in data.batch.keys() for k in needed):
        return {}
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    return {k: float(v) for k, v in compute_data_metrics(data, use_critic=False).items()}


def _fill_defaults(data: DataProto) -> None:
    """token_level_rewards = scores (no KL in reward); response_mask from the attention mask."""
    if "token_level_rewards" not in data.batch.keys():
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    if "response_mask" not in data.batch.keys():
        r = data.batch["responses"].shape[-1]
        data.batch["response_mask"] = data.batch["attention_mask"][:, -r:]


def _advantages(data: DataProto, rollout_level: bool, fn: Callable[..., DataProto] | None,
                kwargs: dict[str, Any]) -> tuple[DataProto, dict[str, int]]:
    if rollout_level:
        return compute_rollout_level_advantage(data, compute_advantage_fn=fn, **kwargs)
    if check_estimator(kwargs["adv_estimator"], rollout_level=False) == "gae" and "values" not in data.batch.keys():
        raise ValueError("algorithm.adv_estimator=gae needs critic values and agl_lab trains without a critic: "
                         f"use an outcome estimator ({_OUTCOME_HINT})")
    return (fn or _verl_compute_advantage())(data, **kwargs), {}


def prepare_update_batch(
    data: DataProto,
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
    compute_advantage_fn: Callable[..., DataProto] | None = None,
) -> tuple[DataProto | None, list[dict[str, Any]], dict[str, Any]]:
    """marked drop → advantages → group metrics → alignment drops → per-rollout normalisation.

    Returns `(batch or None when the step is skipped, drop records, metrics)`. The batch's
    `advantages` are normalised for `per_rollout_mean` (raw ones stay in `rollout_advantages`,
    for `rollout_weights_table`); `critic/*` metrics are computed on the raw advantages.
    """
    _check_selection_args(mini_batch_rows, max_ppo_update_times, selection_policy, small_batch)
    check_estimator(adv_estimator, rollout_level=rollout_level_advantage)
    _fill_defaults(data)
    kept, records, metrics = drop_marked_rows(data)
    n_collected, n_marked = metrics["training/n_sample_collected"], metrics["training/n_sample_dropped/marked"]
    data = data.select_idxs(kept)
    if len(data) == 0:
        logger.warning("skipping this training step: every row was marked for dropping")
        return None, records, {**metrics, "training/n_sample_trained": 0, "training/skipped_steps": 1}

    adv_kwargs = dict(adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                      norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=algo_config)
    data, adv_metrics = _advantages(data, rollout_level_advantage, compute_advantage_fn, adv_kwargs)
    metrics.update(adv_metrics)
    metrics.update(group_metrics(data))

    kept, sel_records, sel_metrics = select_for_update(
        data, mini_batch_rows=mini_batch_rows, max_ppo_update_times=max_ppo_update_times, seed=seed,
        policy=selection_policy, small_batch=small_batch)
    records += sel_records
    metrics.update(sel_metrics)
    metrics.update({"training/n_sample_collected": n_collected, "training/n_sample_dropped/marked": n_marked})
    if sel_metrics["training/skipped_steps"]:
        return None, records, metrics
    data = data.select_idxs(kept)
    metrics["critic/n_transition_after_dropping"] = len(data)
    metrics.update(_data_metrics(data))

    if loss_mode == LOSS_NAME:
        if "rollout_id_list" not in data.non_tensor_batch:
            raise RuntimeError("per_rollout_mean loss requires rollout_id_list")
        data.batch["rollout_advantages"] = data.batch["advantages"]
        data.batch["advantages"] = normalize_advantages_by_rollout(
            data.batch["advantages"], data.batch["response_mask"], data.non_tensor_batch["rollout_id_list"],
            num_trained_rows=len(data), divisor=divisor)
    return data, records, metrics


# =============================================================================================
# 5. Who carries the loss: one row per rollout, for notebooks
# =============================================================================================


def _token_weights(tokens: np.ndarray, pos: np.ndarray, n_rollouts: int, loss_mode: str,
                   loss_agg_mode: str, divisor_value: int) -> np.ndarray:
    """Loss weight per row [N]: Σ over its loss tokens of the coefficient multiplying A."""
    if loss_mode == LOSS_NAME:
        t_r = np.bincount(pos, weights=tokens, minlength=n_rollouts)
        return tokens / np.maximum(t_r[pos] * divisor_value, 1.0)
    nonempty = max(int((tokens > 0).sum()), 1)
    if loss_agg_mode == "token-mean":
        return tokens / max(tokens.sum(), 1.0)
    if loss_agg_mode == "token-sum":
        return tokens.astype(float)
    if loss_agg_mode == "seq-mean-token-mean":
        return (tokens > 0) / nonempty
    if loss_agg_mode == "seq-mean-token-sum":
        return tokens / nonempty
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported here; use token-mean, token-sum, "
                     "seq-mean-token-mean or seq-mean-token-sum")


def rollout_weights_table(
    data: DataProto,
    *,
    loss_mode: str = LOSS_NAME,
    divisor: str = "rollouts",
    num_trained_rows: int | None = None,
    loss_agg_mode: str = "token-mean",
):
    """One row per rollout: how much of the policy loss it carries. Returns a DataFrame.

    Columns: rollout_id, data_id, reward, advantage (raw A_r: from `rollout_advantages` if
    present, else `advantages`), n_rows, loss_tokens (T_r), loss_weight, signed_weight.

    `loss_weight` = Σ over the rollout's loss tokens of the coefficient the loss puts on
    A_r at ratio 1, i.e. Σ_t |Â_t| / |A_r| — defined even when A_r = 0. For `per_rollout_mean`
    it is T_r / max(T_r × D, 1) = 1/D for every non-empty rollout (D from `divisor`, as in
    `normalize_advantages_by_rollout`). For other losses (verl's `loss_agg_mode`, the batch
    taken as one mini-batch) it is T_r / ΣT for token-mean, rows_r / N for
    seq-mean-token-mean, … — long rollouts weigh more under token-mean. `signed_weight` =
    A_r × loss_weight, the rollout's contribution to −∂loss/∂log π at ratio 1.
    """
    import pandas as pd

    rollouts, pos = rollout_index(_rollout_ids(data))
    mask = data.batch["response_mask"].float()
    tokens = mask.sum(-1).cpu().numpy()
    d = 0
    if loss_mode == LOSS_NAME:
        d = _per_rollout_divisor(len(data), len(rollouts), divisor, num_trained_rows, None)
    row_w = _token_weights(tokens, pos, len(rollouts), loss_mode, loss_agg_mode, d)
    adv_key = "rollout_advantages" if "rollout_advantages" in data.batch.keys() else "advantages"
    adv = data.batch[adv_key].float() if adv_key in data.batch.keys() else None
    scores = _row_scores(data)
    data_ids = data.non_tensor_batch.get("data_id_list")
    out = []
    for r, rid in enumerate(rollouts):
        idx = np.flatnonzero(pos == r)
        a = math.nan
        if adv is not None:
            on = adv[idx][mask[idx].bool()]
            a = float(on[0]) if on.numel() else math.nan
        w = float(row_w[idx].sum())
        out.append({"rollout_id": rid, "data_id": None if data_ids is None else data_ids[idx[0]],
                    "reward": math.nan if scores is None else float(scores[idx[0]]), "advantage": a,
                    "n_rows": len(idx), "loss_tokens": int(tokens[idx].sum()), "loss_weight": w,
                    "signed_weight": a * w})
    return pd.DataFrame(out)
