"""Per-rollout normalisation and the `per_rollout_mean` policy loss (registered in verl).

Every rollout carries the same total loss weight 1/D, however many rows and tokens it has:

1. `normalize_advantages_by_rollout` divides every token's advantage by (loss tokens of
   its rollout × D). D is the number of *rollouts* in the batch (tech report Eq. 16, our
   default) or the number of *rows* (AGL v1, kept for parity).
2. `compute_policy_loss_per_rollout_mean` is verl's dual-clip PPO loss with a token **sum**
   (the mean already lives in the advantages). `register_loss` puts it in verl's
   `POLICY_LOSS_REGISTRY` as `per_rollout_mean`, so verl's actor (`loss_mode`) and the local
   PPO loop find it by name; engines call it when built, Ray workers through `register_in_worker`.
3. `rollout_weights_table` shows, one row per rollout, how much of the loss it carries
   (`UpdateResult.weights`), for this loss and for verl's `loss_agg_mode`s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from agl_lab.algorithms.advantage import rollout_ids, rollout_index, row_scores
from agl_lab.rules import DIVISORS, LOSS_NAME, check_divisor  # noqa: F401 (re-export)

logger = logging.getLogger(__name__)


# =============================================================================================
# Per-rollout normalisation
# =============================================================================================


def _per_rollout_divisor(
    n_rows: int, n_rollouts: int, divisor: str, num_trained_rows: int | None, num_rollouts: int | None
) -> int:
    check_divisor(divisor)
    if divisor == "rows":
        d = n_rows if num_trained_rows is None else num_trained_rows
        if d <= 0:
            raise ValueError("num_trained_rows must be positive")
        return d
    d = n_rollouts if num_rollouts is None else num_rollouts
    if d <= 0:
        raise ValueError("num_rollouts must be positive")
    return d


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
    row_tokens = response_mask.to(advantages.dtype).sum(-1)  # [N]
    tokens = torch.zeros(len(rollouts), dtype=advantages.dtype, device=advantages.device)
    tokens.index_add_(0, index, row_tokens)  # T_r
    denom = torch.clamp(tokens[index] * d, min=1.0)  # [N]
    return advantages / denom.unsqueeze(-1)


def normalize_batch(data: Any, divisor: str = "rollouts") -> Any:
    """In place: raw advantages → `rollout_advantages`, `advantages` ← normalised [N, R]. Returns data."""
    if "rollout_id_list" not in data.non_tensor_batch:
        raise RuntimeError(
            "per_rollout_mean loss requires rollout_id_list in non_tensor_batch "
            "(batches from agl_lab.batch have it; set it for hand-built ones)"
        )
    data.batch["rollout_advantages"] = data.batch["advantages"]
    data.batch["advantages"] = normalize_advantages_by_rollout(
        data.batch["advantages"],
        data.batch["response_mask"],
        data.non_tensor_batch["rollout_id_list"],
        num_trained_rows=len(data),
        divisor=divisor,
    )
    return data


# =============================================================================================
# The dual-clip `per_rollout_mean` loss and its registration
# =============================================================================================


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
    from verl.utils.torch_functional import masked_mean, masked_sum  # lazy: verl imports Ray

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


def register_loss() -> None:
    """Register `per_rollout_mean` in verl's `POLICY_LOSS_REGISTRY`, where verl's actor and the
    local PPO loop look `loss_mode` up. Explicit, not an import side effect: engines call it when
    they are built, Ray workers through `register_in_worker`. Calling it again is harmless."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # lazy: verl imports Ray

    existing = POLICY_LOSS_REGISTRY.get(LOSS_NAME)
    if existing is compute_policy_loss_per_rollout_mean:
        return
    if existing is not None and getattr(existing, "__module__", None) != __name__:
        logger.warning(
            "replacing policy loss %r registered by %s with agl_lab's",
            LOSS_NAME,
            getattr(existing, "__module__", existing),
        )
    register_policy_loss(LOSS_NAME)(compute_policy_loss_per_rollout_mean)


def register_in_worker() -> None:
    """Ray `worker_process_setup_hook` (`agl_lab.algorithms.register_in_worker`): `register_loss`
    in every worker process."""
    register_loss()


# =============================================================================================
# Who carries the loss: one row per rollout (UpdateResult.weights)
# =============================================================================================


def _token_weights(
    tokens: np.ndarray, pos: np.ndarray, n_rollouts: int, loss_mode: str, loss_agg_mode: str, divisor_value: int
) -> np.ndarray:
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
    raise ValueError(
        f"loss_agg_mode={loss_agg_mode!r} is not supported here; use token-mean, token-sum, "
        "seq-mean-token-mean or seq-mean-token-sum"
    )


def _raw_advantage(adv: torch.Tensor | None, mask: torch.Tensor, idx: np.ndarray) -> float:
    if adv is None:
        return math.nan
    on = adv[idx][mask[idx].bool()]
    return float(on[0]) if on.numel() else math.nan


def rollout_weights_table(
    data: Any,
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

    rollouts, pos = rollout_index(rollout_ids(data))
    mask = data.batch["response_mask"].float()
    tokens = mask.sum(-1).cpu().numpy()
    d = 0
    if loss_mode == LOSS_NAME:
        d = _per_rollout_divisor(len(data), len(rollouts), divisor, num_trained_rows, None)
    row_w = _token_weights(tokens, pos, len(rollouts), loss_mode, loss_agg_mode, d)
    adv_key = "rollout_advantages" if "rollout_advantages" in data.batch.keys() else "advantages"
    adv = data.batch[adv_key].float() if adv_key in data.batch.keys() else None
    scores = row_scores(data)
    data_ids = data.non_tensor_batch.get("data_id_list")
    out = []
    for r, rid in enumerate(rollouts):
        idx = np.flatnonzero(pos == r)
        a, w = _raw_advantage(adv, mask, idx), float(row_w[idx].sum())
        out.append(
            {
                "rollout_id": rid,
                "data_id": None if data_ids is None else data_ids[idx[0]],
                "reward": math.nan if scores is None else float(scores[idx[0]]),
                "advantage": a,
                "n_rows": len(idx),
                "loss_tokens": int(tokens[idx].sum()),
                "loss_weight": w,
                "signed_weight": a * w,
            }
        )
    return pd.DataFrame(out)


def row_weights_table(
    data: Any,
    *,
    loss_mode: str = LOSS_NAME,
    divisor: str = "rollouts",
    num_trained_rows: int | None = None,
    loss_agg_mode: str = "token-mean",
):
    """One line per row of `data`: the numbers `rollout_weights_table` sums per rollout.

    Columns: batch_index (the row of `data`), rollout_id, first_call, advantage (the row's raw
    advantage, on its first loss token: under `turn_credit: return` the rows of one rollout
    differ), loss_tokens, loss_weight, signed_weight (advantage × loss_weight). A rollout's
    `loss_weight` in `rollout_weights_table` is the sum of its rows' here.
    """
    import pandas as pd

    rollouts, pos = rollout_index(rollout_ids(data))
    mask = data.batch["response_mask"].float()
    tokens = mask.sum(-1).cpu().numpy()
    d = _per_rollout_divisor(len(data), len(rollouts), divisor, num_trained_rows, None) if loss_mode == LOSS_NAME else 0
    row_w = _token_weights(tokens, pos, len(rollouts), loss_mode, loss_agg_mode, d)
    adv_key = "rollout_advantages" if "rollout_advantages" in data.batch.keys() else "advantages"
    adv = data.batch[adv_key].float() if adv_key in data.batch.keys() else None
    calls = data.non_tensor_batch.get("turn_index_list")
    advantage = [_raw_advantage(adv, mask, np.array([i])) for i in range(len(data))]
    return pd.DataFrame(
        {
            "batch_index": np.arange(len(data)),
            "rollout_id": [rollouts[p] for p in pos],
            "first_call": np.full(len(data), -1) if calls is None else np.asarray(calls).astype(int),
            "advantage": advantage,
            "loss_tokens": tokens.astype(int),
            "loss_weight": row_w.astype(float),
            "signed_weight": np.asarray(advantage) * row_w,
        }
    )
