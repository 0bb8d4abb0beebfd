"""Rollout-level advantage: verl's estimator on one row per rollout, broadcast to its rows.

A rollout becomes one training row (trajectory level, merged) or several (transition
level, or after a merge break). GRPO compares *rollouts* of a task, so the estimator sees
one representative row per rollout (its first) and the scalar advantage is then
broadcast to every row of the rollout through the row's own response mask: a rollout with
five rows weighs as much in its group's mean/std as a rollout with one.

Also here, the row ↔ rollout ↔ group bookkeeping the other stages share
(`rollout_index`, `rollout_ids`, `group_keys`, `row_scores`) and the zero-advantage groups
(every rollout of the task got the same reward: GRPO gives them A = 0 — exactly 0: the
estimator runs on float64 rewards and equal-reward groups are zeroed, `run_estimator`;
`agl_lab.parity.grpo_float32` keeps verl's float32 numbers, docs/research.md).

Pure: a batch (`agl_lab.batch_data.BatchData` or verl's `DataProto`) in, `(batch, metrics)`
out. The estimator is `estimators.compute_advantage` (verl's signature and numbers; GRPO and RLOO
without importing verl or Ray) unless one is injected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from agl_lab.algorithms.estimators import compute_advantage
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


#: estimators that subtract a group baseline: a group of equal rewards has advantage 0 in exact
#: arithmetic, and agl_lab makes it exactly 0 (verl's float32 statistics can leave an ulp-sized
#: mean error that (r − mean)/(std + 1e-6) turns into ±0.007; agl_lab.parity.grpo_float32 keeps them)
GROUP_BASELINE_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "grpo_passk", "opo", "gpg")
#: zero_advantage_groups' rules before advantages exist: agl_lab's (bitwise-equal rewards, the
#: groups exact_zero zeroes) or AGL v1's (`allclose` to the first, its `_same_reward_uid_indices`)
ZERO_RULES = ("exact", "agl")


def _group_rows(keys: Sequence[Any]) -> dict[Any, list[int]]:
    rows: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        rows.setdefault(k, []).append(i)
    return rows


def _no_signal(values: torch.Tensor) -> bool:
    """Rewards [m] (float64) of one group: GRPO gives it advantage exactly 0 (exact_zero) — two or
    more bitwise-equal rewards, or a lone reward of 0 (verl's mean 0, std 1 for a group of one)."""
    return bool((values == values[0]).all()) if len(values) > 1 else bool(values[0] == 0)


def _zero_advantage_flags(data: Any, keys: np.ndarray, rule: str = "exact") -> dict[Any, bool]:
    """Per group key: does the group carry no policy gradient?

    With `advantages` in the batch (after the estimator): every loss token of every row of the
    group has advantage exactly 0 (with exact_zero, the default, that is every group `_no_signal`
    names). Without them (a batch view before the update): the reward rule, `rule="exact"`
    (`_no_signal` on the float64 row rewards) or `"agl"` (AGL v1: all `allclose` to the first).
    """
    if rule not in ZERO_RULES:
        raise ValueError(f"rule={rule!r} is not one of {list(ZERO_RULES)}")
    rows = _group_rows(keys)
    if "advantages" in data.batch.keys():
        adv, mask = data.batch["advantages"], data.batch["response_mask"].bool()
        # Critical: decided from the advantages the update uses, not from reward variance.
        row_zero = ((adv == 0) | ~mask).all(-1)  # [N]
        return {k: bool(row_zero[idx].all()) for k, idx in rows.items()}
    scores = row_scores(data)
    if rule == "agl":
        return {k: bool(torch.allclose(scores[idx], scores[idx[0]].expand(len(idx)))) for k, idx in rows.items()}
    # one value per rollout (its first row: every row of a rollout carries its reward)
    rollouts, pos = rollout_index(rollout_ids(data))
    first = {}
    for i, p in enumerate(pos):
        first.setdefault(int(p), i)
    return {k: _no_signal(scores[sorted({first[int(pos[i])] for i in idx})]) for k, idx in rows.items()}


def zero_advantage_groups(data: Any, rule: str = "exact") -> list[Any]:
    """Zero-advantage groups (uid, else data_id): all advantages exactly zero on the loss tokens,
    or, before advantages are computed, the reward rule `rule` (see `_zero_advantage_flags`).

    Returns the group keys in first-occurrence order; `[]` when groups or rewards are absent.
    """
    keys = group_keys(data)
    if keys is None or (row_scores(data) is None and "advantages" not in data.batch.keys()):
        return []
    return [k for k, zero in _zero_advantage_flags(data, keys, rule).items() if zero]


def group_metrics(data: Any, suffix: str = "") -> dict[str, int | float]:
    """`training/n_groups{suffix}`, `training/n_zero_adv_groups{suffix}` (see `zero_advantage_groups`),
    `training/n_zero_signal_rollouts{suffix}` (rollouts in those groups: unlike the group count it
    compares across `rollout.n`) and `training/zero_signal_rollout_frac{suffix}` (their share of the
    batch's rollouts); `{}` if no groups. AGL v1 logs the first two (no suffix) for the trained batch;
    `prepare_update_batch` adds `_collected` for the batch before the alignment drops."""
    keys = group_keys(data)
    if keys is None or (row_scores(data) is None and "advantages" not in data.batch.keys()):
        return {}
    flags = _zero_advantage_flags(data, keys)
    ids = rollout_ids(data)
    all_rollouts = set(ids.tolist() if isinstance(ids, np.ndarray) else ids)
    silent = {ids[i] for i, k in enumerate(keys) if flags[k]}
    return {
        f"training/n_groups{suffix}": len(flags),
        f"training/n_zero_adv_groups{suffix}": sum(flags.values()),
        f"training/n_zero_signal_rollouts{suffix}": len(silent),
        f"training/zero_signal_rollout_frac{suffix}": len(silent) / len(all_rollouts) if all_rollouts else 0.0,
    }


# =============================================================================================
# The estimator
# =============================================================================================


def _equal_reward_rows(scores: torch.Tensor, keys: Sequence[Any] | None) -> torch.Tensor:
    """Rows [N] bool in groups of two or more whose float64 rewards are all bitwise equal."""
    out = torch.zeros(len(scores), dtype=torch.bool)
    if keys is None:
        return out
    for idx in _group_rows(keys).values():
        if len(idx) > 1 and bool((scores[idx] == scores[idx[0]]).all()):
            out[idx] = True
    return out


def run_estimator(estimator: Callable[..., Any], data: Any, *, exact_zero: bool = True, **kwargs: Any) -> Any:
    """`estimator(data, **kwargs)` (verl's `compute_advantage` signature) with agl_lab's numbers.

    exact_zero (default): the estimator sees `token_level_rewards` in float64, so its group
    statistics are float64; its `advantages`/`returns` come back in the rewards' dtype, and for a
    group-baseline estimator (GROUP_BASELINE_ESTIMATORS) every row of a group of ≥ 2 rows whose
    rewards are bitwise equal gets exactly 0 — whatever `norm_adv_by_std_in_grpo` and the group
    size. A group with different rewards keeps the estimator's value (to float32 rounding).
    exact_zero=False (agl_lab.parity.grpo_float32): the estimator on the batch as it is (verl's numbers).
    """
    if not exact_zero:
        return estimator(data, **kwargs)
    rewards = data.batch["token_level_rewards"]
    data.batch["token_level_rewards"] = rewards.double()
    try:
        out = estimator(data, **kwargs)
    finally:
        data.batch["token_level_rewards"] = rewards
    name = str(getattr(kwargs.get("adv_estimator"), "value", kwargs.get("adv_estimator"))).lower()
    zero = (
        _equal_reward_rows(rewards.double().sum(-1), group_keys(out))
        if name in GROUP_BASELINE_ESTIMATORS
        else torch.zeros(len(out), dtype=torch.bool)
    )
    for key in ("advantages", "returns"):
        if key in out.batch.keys():
            values = out.batch[key].to(rewards.dtype)
            values[zero] = 0.0
            out.batch[key] = values
    return out


def fill_reward_defaults(data: Any) -> None:
    """token_level_rewards = token_level_scores when nothing wrote them (no KL in reward)."""
    if "token_level_rewards" not in data.batch.keys():
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]


def compute_advantages(
    data: Any,
    *,
    rollout_level: bool = True,
    compute_advantage_fn: Callable[..., Any] | None = None,
    exact_zero: bool = True,
    **kwargs: Any,
) -> tuple[Any, dict[str, int]]:
    """`advantages`/`returns` [N, R]: rollout-level (default) or verl's per-row estimator.

    `kwargs` are verl's `compute_advantage` arguments (adv_estimator, gamma, lam, num_repeat,
    norm_adv_by_std_in_grpo, config); `exact_zero` see `run_estimator`. Returns `(data, metrics)`.
    """
    if rollout_level:
        return compute_rollout_level_advantage(
            data, compute_advantage_fn=compute_advantage_fn, exact_zero=exact_zero, **kwargs
        )
    name = check_estimator(kwargs["adv_estimator"], rollout_level=False)
    if name.lower() == "gae" and "values" not in data.batch.keys():
        raise ValueError(
            "algorithm.adv_estimator=gae needs critic values and agl_lab trains without a critic: "
            f"use an outcome estimator ({OUTCOME_HINT})"
        )
    return run_estimator(compute_advantage_fn or compute_advantage, data, exact_zero=exact_zero, **kwargs), {}


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
            raise RuntimeError(
                f"rollout-level advantage found multiple uid values for rollout_id={rid}: "
                "every row of a rollout belongs to one group (check uid / data_id_list)"
            )
        if not torch.allclose(sums[idx], sums[idx[0]].expand(len(idx))):
            raise RuntimeError(
                "rollout-level advantage requires all triplets for the same rollout_id to share the "
                f"same scalar token_level_rewards sum; got rollout_id={rid} (a rollout has one final "
                "reward: put it on the last token of every row of the rollout, as agl_lab.batch does)"
            )
    return reps


def _rollout_scalars(adv: torch.Tensor, mask: torch.Tensor, rollouts: list[Any]) -> torch.Tensor:
    """One advantage per rollout from its representative row [n_rollouts, R] → [n_rollouts]."""
    out = torch.empty(len(rollouts), dtype=adv.dtype)
    for r, rid in enumerate(rollouts):
        values = adv[r][mask[r].bool()]
        if values.numel() == 0:
            raise RuntimeError(
                f"rollout-level advantage cannot extract advantages for empty rollout_id={rid} "
                "(its first row has no loss token: drop such rows before the advantage)"
            )
        if not torch.allclose(values, values[0].expand_as(values)):
            raise RuntimeError(
                "rollout-level advantage requires scalar outcome-style advantages; got non-constant "
                f"token values for rollout_id={rid} (set algorithm.enable_rollout_level_advantage=false "
                "for token-level estimators)"
            )
        out[r] = values[0]
    return out


_KEYS_HINT = " (agl_lab.batch.build_batch writes it; add it to a hand-built batch)"


def _check_rollout_level_keys(data: Any) -> None:
    nt = data.non_tensor_batch
    if "rollout_id_list" not in nt:
        raise RuntimeError("rollout-level advantage requires rollout_id_list in non_tensor_batch" + _KEYS_HINT)
    if len(nt["rollout_id_list"]) != len(data):
        raise RuntimeError(
            f"rollout_id_list length ({len(nt['rollout_id_list'])}) must match batch length ({len(data)})"
        )
    if "uid" not in nt:
        if "data_id_list" not in nt:
            raise RuntimeError("rollout-level advantage requires uid or data_id_list in non_tensor_batch" + _KEYS_HINT)
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
    exact_zero: bool = True,
) -> tuple[Any, dict[str, int]]:
    """Advantages once per rollout, broadcast to all its rows (writes `advantages`, `returns`).

    The estimator (`estimators.compute_advantage`, verl's numbers, unless injected) sees one representative row
    per rollout (its first row), so for GRPO each rollout counts once in its group's mean
    and std. Then `advantages[i] = A[rollout(i)] × response_mask[i]` for every row i.
    `exact_zero` (default): float64 group statistics, equal-reward groups exactly 0 (`run_estimator`).

    Raises RuntimeError with AGL v1's messages for missing keys and inconsistent rollouts,
    ValueError for token-level estimators (GAE), NotImplementedError for REMAX.
    """
    check_estimator(adv_estimator)
    _check_rollout_level_keys(data)
    rollouts, pos = rollout_index(data.non_tensor_batch["rollout_id_list"])
    reps = _check_rollouts_consistent(data, rollouts, pos)
    estimator = compute_advantage_fn or compute_advantage
    sub = run_estimator(
        estimator,
        data.select_idxs(np.asarray(reps, dtype=np.int64)),
        exact_zero=exact_zero,
        adv_estimator=adv_estimator,
        gamma=gamma,
        lam=lam,
        num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
    )

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
