"""Rollout-level advantage: verl's estimator on one row per rollout, broadcast to its rows.

A rollout becomes one training row (trajectory level, merged) or several (transition
level, or after a merge break). GRPO compares *rollouts* of a task, so the estimator sees
one representative row per rollout (its first) and the scalar advantage is then
broadcast to every row of the rollout through the row's own response mask: a rollout with
five rows weighs as much in its group's mean/std as a rollout with one.

Also here, the row ↔ rollout ↔ group bookkeeping the other stages share
(`rollout_index`, `rollout_ids`, `group_keys`, `row_scores`) and the zero-advantage groups
(every rollout of the task got the same reward: GRPO gives them A = 0).

Pure: DataProto in, `(DataProto, metrics)` out; verl's `compute_advantage` is imported
only when no estimator is injected (its module pulls in Ray's worker stack).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from agl_lab.rules import OUTCOME_HINT, TOKEN_LEVEL_ESTIMATORS, check_estimator  # noqa: F401 (re-export)


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


def rollout_ids(data: Any) -> np.ndarray:
    """`rollout_id_list` [N]; without it every row is its own rollout (a plain verl batch)."""
    ids = data.non_tensor_batch.get("rollout_id_list")
    return np.arange(len(data)) if ids is None else ids


def group_keys(data: Any) -> np.ndarray | None:
    """The group of each row [N]: `uid`, else `data_id_list`; None when the batch has neither."""
    nt = data.non_tensor_batch
    if "uid" in nt:
        return nt["uid"]
    return nt.get("data_id_list")


def row_scores(data: Any) -> torch.Tensor | None:
    """Scalar reward of each row [N] (float64), from scores (pre-KL) or rewards."""
    for key in ("token_level_scores", "token_level_rewards"):
        if key in data.batch.keys():
            return data.batch[key].double().sum(-1)
    return None


#: |A| at or below this on every loss token of a group means "zero advantage" (GRPO's
#: (r − mean)/(std + eps) of equal float32 rewards can be off zero by an ulp)
ZERO_ADV_ATOL = 1e-6


def _zero_advantage_flags(data: Any, keys: np.ndarray) -> dict[Any, bool]:
    """Per group key: does the group carry no policy gradient?

    With `advantages` in the batch (after the estimator): every loss token of every row of
    the group has |A| ≤ ZERO_ADV_ATOL. Without them (a batch view before the update): all
    row rewards are `allclose` to the first one, AGL v1's rule — which misjudges a group with
    one rollout (verl's GRPO gives it mean 0, std 1, so A = reward ≠ 0).
    """
    rows: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        rows.setdefault(k, []).append(i)
    if "advantages" in data.batch.keys():
        adv, mask = data.batch["advantages"], data.batch["response_mask"].bool()
        # Critical: decided from the advantages the update uses, not from reward variance.
        row_zero = ((adv.abs() <= ZERO_ADV_ATOL) | ~mask).all(-1)  # [N]
        return {k: bool(row_zero[idx].all()) for k, idx in rows.items()}
    scores = row_scores(data)
    return {k: bool(torch.allclose(scores[idx], scores[idx[0]].expand(len(idx)))) for k, idx in rows.items()}


def zero_advantage_groups(data: Any) -> list[Any]:
    """Zero-advantage groups (uid, else data_id): all advantages zero on the loss tokens, or,
    before advantages are computed, all rows share one reward.

    Returns the group keys in first-occurrence order; `[]` when groups or rewards are absent.
    """
    keys = group_keys(data)
    if keys is None or (row_scores(data) is None and "advantages" not in data.batch.keys()):
        return []
    return [k for k, zero in _zero_advantage_flags(data, keys).items() if zero]


def group_metrics(data: Any, suffix: str = "") -> dict[str, int]:
    """`training/n_groups{suffix}` and `training/n_zero_adv_groups{suffix}` (see
    `zero_advantage_groups`); `{}` if no groups. AGL v1 logs them (no suffix) for the trained
    batch; `prepare_update_batch` adds `_collected` for the batch before the alignment drops."""
    keys = group_keys(data)
    if keys is None or (row_scores(data) is None and "advantages" not in data.batch.keys()):
        return {}
    flags = _zero_advantage_flags(data, keys)
    return {f"training/n_groups{suffix}": len(flags), f"training/n_zero_adv_groups{suffix}": sum(flags.values())}


# =============================================================================================
# The estimator
# =============================================================================================


def _verl_compute_advantage() -> Callable[..., Any]:
    # Lazy: ray_trainer pulls in Ray and the worker stack (~9 s); only needed here.
    from verl.trainer.ppo.ray_trainer import compute_advantage

    return compute_advantage


def fill_reward_defaults(data: Any) -> None:
    """token_level_rewards = token_level_scores when nothing wrote them (no KL in reward)."""
    if "token_level_rewards" not in data.batch.keys():
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]


def compute_advantages(data: Any, *, rollout_level: bool = True,
                       compute_advantage_fn: Callable[..., Any] | None = None,
                       **kwargs: Any) -> tuple[Any, dict[str, int]]:
    """`advantages`/`returns` [N, R]: rollout-level (default) or verl's per-row estimator.

    `kwargs` are verl's `compute_advantage` arguments (adv_estimator, gamma, lam, num_repeat,
    norm_adv_by_std_in_grpo, config). Returns `(data, metrics)`.
    """
    if rollout_level:
        return compute_rollout_level_advantage(data, compute_advantage_fn=compute_advantage_fn, **kwargs)
    name = check_estimator(kwargs["adv_estimator"], rollout_level=False)
    if name.lower() == "gae" and "values" not in data.batch.keys():
        raise ValueError("algorithm.adv_estimator=gae needs critic values and agl_lab trains without a critic: "
                         f"use an outcome estimator ({OUTCOME_HINT})")
    return (compute_advantage_fn or _verl_compute_advantage())(data, **kwargs), {}


# =============================================================================================
# Rollout-level advantage
# =============================================================================================


def _check_rollouts_consistent(data: Any, rollouts: list[Any], pos: np.ndarray) -> list[int]:
    """Validate that each rollout has one uid and one reward; return representative rows."""
    uids = data.non_tensor_batch["uid"]
    sums = data.batch["token_level_rewards"].float().sum(-1)
    reps: list[int] = []
    for r, rid in enumerate(rollouts):
        idx = np.flatnonzero(pos == r)
        reps.append(int(idx[0]))
        if len({uids[i] for i in idx}) > 1:
            raise RuntimeError(f"rollout-level advantage found multiple uid values for rollout_id={rid}: "
                               "every row of a rollout belongs to one group (check uid / data_id_list)")
        if not torch.allclose(sums[idx], sums[idx[0]].expand(len(idx))):
            raise RuntimeError(
                "rollout-level advantage requires all triplets for the same rollout_id to share the "
                f"same scalar token_level_rewards sum; got rollout_id={rid} (a rollout has one final "
                "reward: put it on the last token of every row of the rollout, as agl_lab.batch does)")
    return reps


def _rollout_scalars(adv: torch.Tensor, mask: torch.Tensor, rollouts: list[Any]) -> torch.Tensor:
    """One advantage per rollout from its representative row [n_rollouts, R] → [n_rollouts]."""
    out = torch.empty(len(rollouts), dtype=adv.dtype)
    for r, rid in enumerate(rollouts):
        values = adv[r][mask[r].bool()]
        if values.numel() == 0:
            raise RuntimeError(f"rollout-level advantage cannot extract advantages for empty rollout_id={rid} "
                               "(its first row has no loss token: drop such rows before the advantage)")
        if not torch.allclose(values, values[0].expand_as(values)):
            raise RuntimeError(
                "rollout-level advantage requires scalar outcome-style advantages; got non-constant "
                f"token values for rollout_id={rid} (set algorithm.enable_rollout_level_advantage=false "
                "for token-level estimators)")
        out[r] = values[0]
    return out


_KEYS_HINT = " (agl_lab.batch.build_batch writes it; add it to a hand-built batch)"


def _check_rollout_level_keys(data: Any) -> None:
    nt = data.non_tensor_batch
    if "rollout_id_list" not in nt:
        raise RuntimeError("rollout-level advantage requires rollout_id_list in non_tensor_batch" + _KEYS_HINT)
    if len(nt["rollout_id_list"]) != len(data):
        raise RuntimeError(f"rollout_id_list length ({len(nt['rollout_id_list'])}) must match batch "
                           f"length ({len(data)})")
    if "uid" not in nt:
        if "data_id_list" not in nt:
            raise RuntimeError("rollout-level advantage requires uid or data_id_list in non_tensor_batch"
                               + _KEYS_HINT)
        nt["uid"] = nt["data_id_list"]
    for key in ("response_mask", "token_level_rewards"):
        if key not in data.batch.keys():
            raise RuntimeError(f"rollout-level advantage requires {key} in batch" + _KEYS_HINT)


def compute_rollout_level_advantage(
    data: Any,
    adv_estimator: Any,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    compute_advantage_fn: Callable[..., Any] | None = None,
) -> tuple[Any, dict[str, int]]:
    """Advantages once per rollout, broadcast to all its rows (writes `advantages`, `returns`).

    The estimator (verl's `compute_advantage` unless injected) sees one representative row
    per rollout (its first row), so for GRPO each rollout counts once in its group's mean
    and std. Then `advantages[i] = A[rollout(i)] × response_mask[i]` for every row i.

    Raises RuntimeError with AGL v1's messages for missing keys and inconsistent rollouts,
    ValueError for token-level estimators (GAE), NotImplementedError for REMAX.
    """
    check_estimator(adv_estimator)
    _check_rollout_level_keys(data)
    rollouts, pos = rollout_index(data.non_tensor_batch["rollout_id_list"])
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
