"""The advantage estimators and the batch's data metrics, computed without importing verl.

`import verl` imports Ray (verl/__init__ → verl/protocol.py), and verl's `compute_advantage`
lives in `verl.trainer.ppo.ray_trainer` (Ray's worker stack on top). Replay and the pure core
need neither, so the estimators agl_lab runs most (`NATIVE_ESTIMATORS`: GRPO and RLOO, the
outcome estimators with a group baseline) and verl's `compute_data_metrics` (`critic/*`,
`response_length/*`, `prompt_length/*`) are computed here, operation for operation as
verl 0.9.1 does, so the numbers are bitwise the same (`tests/test_estimators.py` checks it
against verl's own functions, in float32 and float64). Any other estimator is verl's, looked
up in `verl.trainer.ppo.core_algos` (which imports Ray) — never through `ray_trainer`.

    compute_advantage(data, adv_estimator, gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config)
        verl's `compute_advantage` signature: writes data.batch["advantages"], ["returns"] [N, R]
    compute_data_metrics(data)    verl's `compute_data_metrics(data, use_critic=False)`: name → float
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

GRPO_EPSILON = 1e-6  # verl's default `epsilon` of its GRPO and RLOO estimators


def _group_positions(index: Sequence[Any]) -> list[list[int]]:
    """Rows of each group, groups in first-occurrence order."""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    *,
    epsilon: float = GRPO_EPSILON,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's outcome advantage [N, R]: (r − mean_g) / (std_g + ε) (or r − mean_g), on the mask.

    `token_level_rewards` [N, R] (its dtype is the statistics' dtype), `response_mask` [N, R],
    `index` [N] the group of each row. A group of one row has mean 0 and std 1 (float32
    scalars, as verl's). std is the unbiased (n − 1) one. Returns `(advantages, returns)`, the same tensor.
    """
    scores = token_level_rewards.sum(dim=-1)  # [N]
    out = scores.clone()
    with torch.no_grad():
        for rows in _group_positions(index):
            if len(rows) == 1:  # a 0-dim score against float32 scalars: verl's type promotion
                idx, members = rows[0], scores[rows[0]]
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                idx = torch.as_tensor(rows)
                members = scores[idx]
                mean, std = torch.mean(members), torch.std(members)
            values = (members - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else members - mean
            out[idx] = values.to(out.dtype)
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


def rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's outcome advantage [N, R]: r·n/(n−1) − mean_g·n/(n−1) (a group of one keeps r)."""
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    with torch.no_grad():
        for rows in _group_positions(index):
            n = len(rows)
            if n == 1:
                continue
            idx = torch.as_tensor(rows)
            members = scores[idx]
            mean = torch.mean(members)
            out[idx] = (members * n / (n - 1) - mean * n / (n - 1)).to(out.dtype)
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


def _grpo(data: Any, norm_adv_by_std_in_grpo: bool, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # verl's compute_advantage calls GRPO with its default epsilon and without the config
    return grpo_advantage(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )


def _rloo(data: Any, norm_adv_by_std_in_grpo: bool, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if "uid" not in data.non_tensor_batch:
        raise ValueError("algorithm.adv_estimator=rloo needs the group of each row (uid in non_tensor_batch)")
    return rloo_advantage(data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"])


#: estimators computed here, without verl; the rest are verl's (`verl.trainer.ppo.core_algos`, imports Ray)
NATIVE_ESTIMATORS: dict[str, Callable[[Any, bool, Any], tuple[torch.Tensor, torch.Tensor]]] = {
    "grpo": _grpo,
    "rloo": _rloo,
}


def estimator_name(adv_estimator: Any) -> str:
    """`"grpo"` for `"grpo"`, `"GRPO"` or verl's `AdvantageEstimator.GRPO`."""
    return str(getattr(adv_estimator, "value", adv_estimator)).lower()


def compute_advantage(
    data: Any,
    adv_estimator: Any,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> Any:
    """verl's `compute_advantage` (same arguments, same numbers): writes `advantages`, `returns` [N, R].

    GRPO and RLOO run here (no verl import); any other estimator is verl's, called with the
    arguments verl's `compute_advantage` gives it. `data`: a `BatchData` or a verl `DataProto`
    with `token_level_rewards`, `response_mask` [N, R] and `uid` [N]. Returns `data`.
    """
    name = estimator_name(adv_estimator)
    if "response_mask" not in data.batch.keys():
        raise ValueError("compute_advantage needs response_mask in the batch (agl_lab.batch.build_batch writes it)")
    native = NATIVE_ESTIMATORS.get(name)
    if native is not None:
        advantages, returns = native(data, norm_adv_by_std_in_grpo, config)
    else:
        advantages, returns = _verl_estimator(data, name, gamma=gamma, lam=lam, config=config)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def _verl_estimator(data: Any, name: str, *, gamma: float, lam: float, config: Any) -> tuple[Any, Any]:
    """An estimator agl_lab does not compute itself, from verl's registry (imports verl, hence Ray)."""
    from verl.trainer.ppo import core_algos

    if name == "gae":
        return core_algos.compute_gae_advantage_return(
            token_level_rewards=data.batch["token_level_rewards"],
            values=data.batch["values"],
            response_mask=data.batch["response_mask"],
            gamma=gamma,
            lam=lam,
        )
    kwargs: dict[str, Any] = {
        "token_level_rewards": data.batch["token_level_rewards"],
        "response_mask": data.batch["response_mask"],
        "config": config,
    }
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if "reward_baselines" in data.batch.keys():
        kwargs["reward_baselines"] = data.batch["reward_baselines"]
    return core_algos.get_adv_estimator_fn(name)(**kwargs)


# =============================================================================================
# The batch's data metrics (verl's compute_data_metrics, use_critic=False)
# =============================================================================================


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/max": float("nan"), f"{prefix}/min": float("nan")}
    return {
        f"{prefix}/mean": torch.mean(values).item(),
        f"{prefix}/max": torch.max(values).item(),
        f"{prefix}/min": torch.min(values).item(),
    }


def _clip_ratio(lengths: torch.Tensor, limit: int) -> float:
    return torch.mean(torch.eq(lengths, limit).float()).item()


def compute_data_metrics(data: Any) -> dict[str, float]:
    """`critic/{score,rewards,advantages,returns}/{mean,max,min}`, `response_length/*`,
    `response_length_non_aborted/*`, `response/aborted_ratio`, `prompt_length/*` (and `num_turns/*`,
    `tool_call_counts/*` when the batch has them), as verl's `compute_data_metrics(use_critic=False)`.

    Reads `token_level_scores`, `token_level_rewards`, `advantages`, `returns` [N, R], `prompts`
    [N, P], `responses` [N, R], `attention_mask` [N, P+R], `response_mask` [N, R]. A row with no
    response token is "aborted": its score and reward are left out of the critic/score|rewards stats.
    """
    b = data.batch
    max_prompt, max_response = b["prompts"].shape[-1], b["responses"].shape[-1]
    if "prompt_length" in b.keys() and "response_length" in b.keys():
        prompt_length, response_length = b["prompt_length"], b["response_length"]
    else:
        prompt_length = b["attention_mask"][:, :-max_response].sum(-1).float()
        response_length = b["attention_mask"][:, -max_response:].sum(-1).float()
    mask = b["response_mask"].bool()
    alive = ~(response_length == 0).bool()
    metrics: dict[str, float] = {
        **_stats("critic/score", b["token_level_scores"].sum(-1)[alive]),
        **_stats("critic/rewards", b["token_level_rewards"].sum(-1)[alive]),
        **_stats("critic/advantages", torch.masked_select(b["advantages"], mask)),
        **_stats("critic/returns", torch.masked_select(b["returns"], mask)),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": _clip_ratio(response_length, max_response),
        **_stats("response_length_non_aborted", response_length[alive]),
        "response_length_non_aborted/clip_ratio": _clip_ratio(response_length[alive], max_response)
        if bool(alive.any())
        else float("nan"),
        "response/aborted_ratio": torch.mean((~alive).float()).item(),
        **_stats("prompt_length", prompt_length),
        "prompt_length/clip_ratio": _clip_ratio(prompt_length, max_prompt),
    }
    for key, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in data.non_tensor_batch:
            values = np.asarray(data.non_tensor_batch[key])
            metrics.update(
                {f"{prefix}/min": values.min(), f"{prefix}/max": values.max(), f"{prefix}/mean": values.mean()}
            )
    return metrics
