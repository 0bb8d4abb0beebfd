"""Zero-advantage micro-batches not forwarded, exactly (`agl_lab.algorithm.skip_zero_advantage`).

A row whose advantages are 0 on every loss token adds exactly 0 to every gradient when the loss
has no other term for it (no entropy bonus, no KL loss) and is row-separable (`per_rollout_mean`,
verl's `vanilla`: `EXACT_LOSSES`). The local update's step (`local_ppo.ppo_step`):

    plan_forwards(mini-batch)      the two lines below, in one call
      zero_rows_last(mini-batch)   rows with a signal first, zero rows last (stable; skip on or off),
                                   each part by attended length when asked (`local_ppo._forward_plan`)
      forwarded_starts(signal)     the micro-batches with at least one signal row (skip on; else all)
    zero_fill_grads(params)        when none is forwarded: the optimiser step still runs

The normalisers are those of the whole mini-batch either way (`global_batch_info` counts every
row and token; the per-rollout divisor is in the advantages already), and AdamW moves weights with
a zero gradient (moment decay, weight decay), so gradients and weights are bit-identical with and
without the skip (tests/test_local_ppo.py). The diagnostics (`actor/entropy`, clip fractions,
`actor/ppo_kl`) are then means over the forwarded rows (`actor/diagnostic_rows`).
"""

from __future__ import annotations

import torch

from agl_lab.rules import ZERO_SKIP_LOSSES

_PREFIX = "actor_rollout_ref.actor."

# Losses that are a sum of per-row terms, each a multiple of the row's advantage (verl 0.9.1's
# compute_policy_loss_vanilla, agl_lab's per_rollout_mean; normalisers fixed per mini-batch).
EXACT_LOSSES = ZERO_SKIP_LOSSES


def blocker(loss_mode: str, entropy_coeff: float, use_kl_loss: bool) -> str | None:
    """Why the skip would not be exact for this loss, or None when it is."""
    if entropy_coeff != 0:
        return f"{_PREFIX}entropy_coeff={entropy_coeff} (the entropy bonus is non-zero for every row)"
    if use_kl_loss:
        return f"{_PREFIX}use_kl_loss=true (the KL loss is non-zero for every row)"
    if loss_mode not in EXACT_LOSSES:
        return f"{_PREFIX}policy_loss.loss_mode={loss_mode} (not one of {list(EXACT_LOSSES)})"
    return None


def trained_row_mask(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows with a non-zero advantage on at least one loss token ([N, R] inputs)."""
    return ((advantages != 0) & response_mask.bool()).any(-1)


def zero_rows_last(
    mb: dict[str, torch.Tensor], micro_rows: int, by_length: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The mini-batch with its signal rows first, zero-advantage rows last (stable), and the
    signal mask [n] in that order; `by_length`: each part ordered by attended tokens, shortest
    first (stable), so rows of like length share a micro-batch and pad less. Unchanged with one
    micro-batch per mini-batch."""
    signal = trained_row_mask(mb["advantages"], mb["response_mask"])
    if mb["input_ids"].shape[0] <= micro_rows:
        return mb, signal
    key = (~signal).long()
    if by_length:
        attended = mb["attention_mask"].sum(-1).long()
        key = key * (int(attended.max()) + 1) + attended
    order = torch.sort(key, stable=True).indices
    return {k: v[order] for k, v in mb.items()}, signal[order]


def forwarded_starts(signal: torch.Tensor, micro_rows: int) -> list[int]:
    """First rows of the micro-batches that hold at least one signal row."""
    return [s for s in range(0, signal.shape[0], micro_rows) if bool(signal[s : s + micro_rows].any())]


def plan_forwards(
    mb: dict[str, torch.Tensor], micro_rows: int, skip: bool, by_length: bool = False
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The mini-batch with its zero-advantage rows last (`zero_rows_last`, skip on or off; by
    attended length within each part when `by_length`) and the first rows of the micro-batches to
    forward: those holding a signal row when `skip`, else all."""
    mb, signal = zero_rows_last(mb, micro_rows, by_length)
    if not skip:
        return mb, list(range(0, signal.shape[0], micro_rows))
    return mb, forwarded_starts(signal, micro_rows)


def zero_fill_grads(params: list[torch.Tensor]) -> None:
    """A zero gradient for every trainable parameter without one: AdamW skips a None gradient, but
    the forwarded all-zero micro-batches would have given exactly 0 and moved the weights."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
