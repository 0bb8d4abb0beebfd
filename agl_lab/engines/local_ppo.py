"""The local engine's policy update: PPO epochs over mini-batches, verl's losses, one device.

The verl engine runs this step on FSDP workers; the local engine (a transformers model on
CPU or one GPU) runs it here, with the *same* loss functions: the policy loss is looked up
in verl's registry by `loss_mode` (`per_rollout_mean` from `agl_lab.algorithms`, `vanilla`,
or any other registered one), entropy and KL terms go through verl's `agg_loss` and
`kl_penalty`. What this module adds is only the loop verl's actor would run:

    ppo_update
      for epoch:                        ppo_epochs
        for mini-batch (rows):          ppo_step, the PPO step: one optimiser step each
          for micro-batch (rows):       forward → ratio → clipped loss → backward (gradients add up)
          clip grad norm → AdamW step

**Less work, the same gradient.** Micro-batches of zero-advantage rows are not forwarded
(`agl_lab.engines.zero_skip`, `skip_zero_advantage`: bit-identical gradients), and with
`use_prefix_grouper` the rows' shared prompt is forwarded and back-propagated once per cluster of
micro-batches that share it — the mini-batch, or each GRPO group (`agl_lab.engines.shared_prefix`:
equal to fp32 rounding).

**Gradient accumulation ≡ one big batch.** Like verl 0.9.1's engine path, every micro-batch
loss is normalised by the *mini-batch* totals (`config.global_batch_info`: token count,
row count, dp_size = 1), so the summed micro-batch gradients equal the gradient of one
forward over the whole mini-batch, exactly, for every `loss_agg_mode`. `per_rollout_mean`
is a plain token sum (its normalisation is already in the advantages): it is *not*
divided again. tests/test_local_ppo.py checks the equivalence on a real model.

The batch keys it reads are declared, with shapes and writers, in
`agl_lab.engines.base.BATCH_SCHEMA`: input_ids, attention_mask, position_ids, responses,
response_mask, old_log_probs, advantages, and when present rollout_log_probs (the mismatch
metrics), ref_log_prob (else `ref_model`) and rollout_is_weights; the sampling temperature comes
from `data.meta_info["temperature"]`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

from agl_lab.algorithms.loss import register_loss
from agl_lab.engines import precision, zero_skip
from agl_lab.engines.actor_config import ActorUpdateConfig, build_optimizer  # noqa: F401 (re-export)
from agl_lab.engines.shared_prefix import (
    ForwardCost,
    PrefixPlan,
    SharedPrefix,
    at_temperature,
    kept_response_width,
    micro_batches,
    plan_prefixes,
    planned_body_tokens,
    score_responses,
)

logger = logging.getLogger(__name__)

_PREFIX = "actor_rollout_ref.actor."


# =============================================================================================
# Log-probabilities of the response tokens
# =============================================================================================


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.clamp(attention_mask.long().cumsum(-1) - 1, min=0)


def _trim(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Cut the columns no row attends to (left padding of all prompts, right padding of all
    responses) → the [n, L'] tensors and the kept response width R' ≤ R. Rows are padded to
    max_prompt + max_response (768 columns in configs/cpu_smollm2.yaml; a calc rollout
    attends to ~300) and a pass costs what it reads. The loss is unchanged: cut columns are
    masked keys or masked response positions, and `position_ids` are cut along."""
    attended = attention_mask.bool().any(0).nonzero()
    if not attended.numel():
        return input_ids, attention_mask, position_ids, response_length
    prompt_width = input_ids.shape[1] - response_length
    kept = kept_response_width(attention_mask, response_length)
    cols = slice(min(int(attended[0]), prompt_width), prompt_width + kept)
    return input_ids[:, cols], attention_mask[:, cols], position_ids[:, cols], kept


def _response_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over the attended columns (`_trim`) → (logprobs [n, R], entropy [n, R] | None);
    entropy: none | grad | detached."""
    device = next(model.parameters()).device
    input_ids, attention_mask, position_ids, kept = _trim(input_ids, attention_mask, position_ids, response_length)
    with precision.autocast(model):  # agl_lab.model.compute_dtype=bfloat16: bfloat16 products
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            use_cache=False,
            logits_to_keep=kept + 1,
        )
    # Critical: position t predicts token t+1, so the R' logits before the last one score the
    # R' response tokens; the last position predicts past the end and is dropped.
    logits = at_temperature(out.logits[:, -(kept + 1) : -1, :].float(), temperature)
    return score_responses(logits, input_ids[:, -kept:], attention_mask[:, -kept:], response_length, entropy)


def sequence_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(response token | everything before it) at `temperature`: ([N, R], entropy [N, R] | None).

    `input_ids`/`attention_mask`/`position_ids` are [N, L] with the response in the last R
    columns; logits are divided by the temperature before log-softmax (the distribution the
    engine sampled from); only the last R' + 1 positions reach the vocabulary projection
    (`logits_to_keep`). Rows go `micro_batch_size` at a time; gradients flow when enabled.
    Results are float32 on the model's device."""
    if position_ids is None:
        position_ids = _position_ids(attention_mask)
    n = input_ids.shape[0]
    step = micro_batch_size or max(n, 1)
    parts = [
        _response_forward(
            model,
            input_ids[s : s + step],
            attention_mask[s : s + step],
            position_ids[s : s + step],
            response_length,
            temperature,
            "grad" if with_entropy else "none",
        )
        for s in range(0, n, step)
    ]
    return torch.cat([lp for lp, _ in parts]), (torch.cat([e for _, e in parts]) if with_entropy else None)


def batch_log_probs(
    model: torch.nn.Module, data: DataProto, temperature: float, micro_batch_size: int | None = None
) -> torch.Tensor:
    """log π(responses) of `data` [N, R] on CPU, in eval mode without gradients."""
    b = data.batch
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp, _ = sequence_log_probs(
                model,
                b["input_ids"],
                b["attention_mask"],
                b["position_ids"],
                b["responses"].shape[-1],
                temperature,
                micro_batch_size,
            )
    finally:
        model.train(was_training)
    return logp.cpu()


def rollout_mismatch_metrics(data: DataProto) -> dict[str, float]:
    """How far the trainer's old logprobs are from the engine's sampling logprobs, in verl's
    own terms: `training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr`
    (`calculate_debug_metrics`: |π_old − π_rollout| in *probability* space, the names of a verl
    run). The gap in log space is `agl_lab.update`'s (`engines.base.logprob_gap`, once per step).
    `{}` without `rollout_log_probs`.
    """
    b = data.batch
    if "rollout_log_probs" not in b.keys() or "old_log_probs" not in b.keys():
        return {}
    from verl.utils.debug.metrics import calculate_debug_metrics

    return {k: float(v) for k, v in calculate_debug_metrics(data).items()}


# =============================================================================================
# The update: PPO epochs over mini-batches
# =============================================================================================


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    cfg: ActorUpdateConfig,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """PPO epochs over mini-batches (one `ppo_step` each) of `data`; returns metrics.

    Needs `old_log_probs` and `advantages` in the batch and the sampling temperature in
    `data.meta_info["temperature"]` (`agl_lab.update.run_update` prepares them). The last
    mini-batch may be smaller than `ppo_mini_batch_size` (after whole-rollout drops).
    Metrics (averaged over optimiser steps): actor/{pg_loss, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower, entropy, grad_norm, [entropy_loss], [kl_loss, kl_coef]}, actor/lr,
    actor/n_updates, actor/nonfinite_grad_steps, and the rollout/trainer logprob mismatch
    (`rollout_mismatch_metrics`, measured before the first step). The zero-advantage skip
    (summed over the update): actor/skipped_zero_adv_micro_batches, actor/skipped_zero_adv_rows,
    actor/diagnostic_rows (the rows the entropy, clip-fraction and ppo_kl means are over), and
    actor/zero_adv_skip_active (1 when the skip is on and exact for this loss).
    """
    tensors, temperature = _update_tensors(model, data, cfg, ref_model)
    metrics: dict[str, float] = rollout_mismatch_metrics(data)
    register_loss()  # per_rollout_mean, where get_policy_loss_fn looks it up
    setup = StepSetup(cfg, temperature, cfg.to_verl_actor_config(), get_policy_loss_fn(cfg.loss_mode))
    n = len(data)
    steps: list[dict[str, float]] = []
    model.train()
    for epoch in range(cfg.ppo_epochs):
        order = _row_order(n, cfg, epoch)
        for s in range(0, n, cfg.ppo_mini_batch_size):
            idx = order[s : s + cfg.ppo_mini_batch_size]
            steps.append(ppo_step(model, optimizer, {k: v[idx] for k, v in tensors.items()}, setup))
    for key in dict.fromkeys(k for step in steps for k in step):
        values = [step[key] for step in steps if key in step]
        metrics[key] = float(sum(values)) if key in _SUMMED else float(np.mean(values))
    metrics["actor/zero_adv_skip_active"] = float(cfg.zero_skip_active)
    if cfg.use_kl_loss:
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    metrics["actor/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["actor/n_updates"] = len(steps)
    return metrics


def _row_order(n: int, cfg: ActorUpdateConfig, epoch: int) -> torch.Tensor:
    if not cfg.shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))


# Step metrics that are counts over the whole update (the rest are means over optimiser steps).
_SUMMED = (
    "actor/nonfinite_grad_steps",
    "actor/body_tokens",
    "actor/shared_prefix_fallbacks",
    "actor/shared_prefixes",
    "actor/skipped_zero_adv_micro_batches",
    "actor/skipped_zero_adv_rows",
    "actor/diagnostic_rows",
)

_NEEDED = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs", "advantages")


def _update_tensors(
    model: torch.nn.Module, data: DataProto, cfg: ActorUpdateConfig, ref_model: torch.nn.Module | None
) -> tuple[dict[str, torch.Tensor], float]:
    """The tensors of the loop, checked, with reference logprobs when the KL loss is on, and the
    sampling temperature the logprobs are computed at (`data.meta_info["temperature"]`)."""
    b = data.batch
    for key in _NEEDED:
        if key not in b.keys():
            hint = (
                " (Engine.prepare(data) writes them)"
                if key == "old_log_probs"
                else " (compute them with agl_lab.algorithms first)"
                if key == "advantages"
                else ""
            )
            raise KeyError(f"ppo_update needs {key!r} in data.batch{hint}")
    if "temperature" not in data.meta_info:
        raise KeyError(
            "ppo_update needs data.meta_info['temperature'], the sampling temperature "
            "(actor_rollout_ref.rollout.temperature; agl_lab.update.run_update sets it)"
        )
    temperature = float(data.meta_info["temperature"])
    if not temperature > 0:
        raise ValueError(
            f"data.meta_info['temperature']={temperature}: the sampling temperature must be > 0 "
            "for training (actor_rollout_ref.rollout.temperature)"
        )
    t = {k: b[k] for k in _NEEDED}
    if "rollout_is_weights" in b.keys():
        t["rollout_is_weights"] = b["rollout_is_weights"]
    if cfg.use_kl_loss:
        if "ref_log_prob" in b.keys():
            t["ref_log_prob"] = b["ref_log_prob"]
        elif ref_model is not None:
            t["ref_log_prob"] = batch_log_probs(ref_model, data, temperature, cfg.micro_batch_rows)
        else:
            raise ValueError(f"{_PREFIX}use_kl_loss=true needs ref_log_prob in the batch or a ref_model")
    return t, temperature


# =============================================================================================
# The PPO step: one optimiser step on one mini-batch
# =============================================================================================


@dataclass(frozen=True)
class StepSetup:
    """What every step of one update shares (`ppo_update` makes it once)."""

    cfg: ActorUpdateConfig
    temperature: float  # the sampling temperature: logits are divided by it before log-softmax
    verl_cfg: Any  # verl's actor config: the clip ratios, and `global_batch_info`, set per step
    policy_loss: Callable[..., tuple[torch.Tensor, dict[str, Any]]]  # verl's registry entry for cfg.loss_mode


def ppo_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, mb: dict[str, torch.Tensor], setup: StepSetup
) -> dict[str, float]:
    """One PPO step on the mini-batch `mb`: for each micro-batch forward → ratio → clipped loss →
    backward (the gradients accumulate), then clip the gradient norm and step; the step's metrics.

    | symbol    | shape  | meaning                                                                      |
    |-----------|--------|------------------------------------------------------------------------------|
    | B, b      |        | rows of the mini-batch `mb`, of one micro-batch (`cfg.micro_batch_rows`)     |
    | T         |        | response columns R: a row is prompt then response, L = prompt width + T      |
    | input_ids | [B, L] | the tokens (with attention_mask, position_ids [B, L])                        |
    | mask      | [B, T] | response_mask: 1 on the tokens the loss trains (0: padding, observations)    |
    | logp_old  | [B, T] | old_log_probs: log π_old of each response token (weights before the update)  |
    | adv       | [B, T] | advantages Â: the rollout's advantage on each of its loss tokens, divided    |
    |           |        | by its tokens × rollouts (`algorithms.loss.normalize_advantages_by_rollout`) |
    | logp, ent | [b, T] | log π_θ of each response token and π_θ's entropy there, with gradient        |
    | ρ         | [b, T] | exp(logp − logp_old), the probability ratio (inside the policy loss)         |
    | loss      | []     | policy loss − entropy_coeff · H + kl_loss_coef · KL, normalised by the       |
    |           |        | mini-batch totals: the micro-batches' gradients sum to the mini-batch's      |

    Micro-batches of zero-advantage rows are not forwarded when the skip is exact
    (`zero_skip.plan_forwards`); with `use_prefix_grouper` a cluster of micro-batches shares one
    prefix forward and backward (`shared_prefix.micro_batches`); the metrics: `step_metrics`.
    """
    cfg, rows = setup.cfg, mb["input_ids"].shape[0]
    # Critical: every micro-batch is normalised by the mini-batch totals → accumulation is exact,
    # and a skipped micro-batch leaves them unchanged (they count every row, forwarded or not).
    setup.verl_cfg.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=max(int(mb["response_mask"].sum()), 1),
        global_batch_size=rows,
        loss_scale_factor=cfg.loss_scale_factor,
    )
    mb, starts, plan, by_length = _forward_plan(mb, cfg)
    entropy = "grad" if cfg.entropy_coeff != 0 else "detached"
    tally, cost = _Tally(rows), ForwardCost()
    optimizer.zero_grad(set_to_none=True)
    for micro, prefix in micro_batches(model, mb, plan, cfg.micro_batch_rows, cost):
        logp, ent = _log_probs(model, micro, prefix, setup.temperature, entropy)  # forward: [b, T] each
        logp_old, adv, mask, is_weights = _loss_inputs(micro, logp.device)
        # ρ = exp(logp − logp_old) and the clipped surrogate max(−Â·ρ, −Â·clip(ρ, 1 − ε, 1 + ε)),
        # aggregated as the loss_mode says (`algorithms.loss.compute_policy_loss_per_rollout_mean`)
        pg_loss, pg_metrics = setup.policy_loss(
            old_log_prob=logp_old,
            log_prob=logp,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=setup.verl_cfg,
            rollout_is_weights=is_weights,
        )
        loss, terms = _entropy_and_kl(pg_loss, logp, ent, mask, micro, setup)
        loss.backward()  # the micro-batches' gradients add up; one optimiser step below
        tally.add(micro, mask, ent, pg_loss, pg_metrics, terms)
    grad_norm = _clip_grad_norm(optimizer, cfg, zero_fill=tally.forwarded_rows == 0)  # before clipping
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning("skipping an optimiser step: gradient norm is %s", grad_norm)
        optimizer.zero_grad(set_to_none=True)
    metrics = step_metrics(tally, cost, plan, grad_norm, cfg)
    metrics["actor/rows_by_length"] = float(by_length)
    return metrics


# =============================================================================================
# The step's parts
# =============================================================================================


def _forward_plan(
    mb: dict[str, torch.Tensor], cfg: ActorUpdateConfig
) -> tuple[dict[str, torch.Tensor], list[int], PrefixPlan, bool]:
    """The mini-batch's rows in forward order, the micro-batches to forward, their prefix plan, and
    whether the rows go by attended length.

    Zero-advantage rows go last either way (`zero_skip.plan_forwards`); of the two orders within
    each part — as the batch came, or by attended length (rows of like length share a micro-batch:
    less padding) — the one with fewer tokens through the body (`planned_body_tokens`) wins, the
    batch's order on a tie. The length order loses where it splits the groups that share a prompt
    (`plan_prefixes`). The choice counts every micro-batch, forwarded or skipped, so it is the same
    with the zero-advantage skip on or off (the gradients stay bit-identical)."""
    rows = cfg.micro_batch_rows

    def prefix_plan(ordered: dict[str, torch.Tensor], starts: list[int]) -> PrefixPlan:
        return plan_prefixes(ordered, starts, rows) if cfg.use_prefix_grouper else PrefixPlan.padded(starts)

    tokens = {}
    for by_length in (False, True):
        ordered, every = zero_skip.plan_forwards(mb, rows, skip=False, by_length=by_length)
        tokens[by_length] = planned_body_tokens(ordered, prefix_plan(ordered, every), rows)
    by_length = tokens[True] < tokens[False]
    mb, starts = zero_skip.plan_forwards(mb, rows, cfg.zero_skip_active, by_length)
    return mb, starts, prefix_plan(mb, starts), by_length


def _log_probs(
    model: torch.nn.Module,
    micro: dict[str, torch.Tensor],
    prefix: SharedPrefix | None,
    temperature: float,
    entropy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [b, T], ent [b, T]) of a micro-batch's responses: through its cluster's shared prefix,
    or one padded forward (`_response_forward`); entropy: grad | detached."""
    response_length = micro["responses"].shape[-1]
    if prefix is not None:
        return prefix.response_forward(
            micro["input_ids"], micro["attention_mask"], response_length, temperature, entropy
        )
    return _response_forward(
        model,
        micro["input_ids"],
        micro["attention_mask"],
        micro["position_ids"],
        response_length,
        temperature,
        entropy,
    )


def _loss_inputs(
    micro: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp_old, adv, mask as bool, rollout_is_weights or None) of a micro-batch, on `device`."""
    weights = micro["rollout_is_weights"].to(device) if "rollout_is_weights" in micro else None
    return (
        micro["old_log_probs"].to(device),
        micro["advantages"].to(device),
        micro["response_mask"].to(device).bool(),
        weights,
    )


def _entropy_and_kl(
    pg_loss: torch.Tensor,
    logp: torch.Tensor,
    ent: torch.Tensor,
    mask: torch.Tensor,
    micro: dict[str, torch.Tensor],
    setup: StepSetup,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch loss: `pg_loss` − entropy_coeff · H + kl_loss_coef · KL(π_θ ‖ π_ref), each
    term aggregated by verl's `agg_loss` over the mini-batch totals; and the terms' values."""
    cfg, info = setup.cfg, setup.verl_cfg.global_batch_info
    loss, terms = pg_loss, {}
    if cfg.entropy_coeff != 0:
        entropy_loss = agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
        loss = loss - cfg.entropy_coeff * entropy_loss
        terms["actor/entropy_loss"] = entropy_loss.item()
    if cfg.use_kl_loss:
        ref = micro["ref_log_prob"].to(logp.device)
        kld = kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=cfg.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
        loss = loss + cfg.kl_loss_coef * kl_loss
        terms["actor/kl_loss"] = kl_loss.item()
    return loss, terms


def _clip_grad_norm(optimizer: torch.optim.Optimizer, cfg: ActorUpdateConfig, zero_fill: bool) -> float:
    """Clip the accumulated gradient to `cfg.grad_clip` (none when None or ≤ 0) → its norm before
    clipping. `zero_fill` when no micro-batch was forwarded: AdamW skips a None gradient, but a zero
    one still moves the weights (moment decay, weight decay), as the skipped forwards would have."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if zero_fill:
        zero_skip.zero_fill_grads(params)
    max_norm = cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0 else math.inf
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm))


@dataclass
class _Tally:
    """What one step's forwarded micro-batches add up: their rows, loss tokens and `sums`, the sum
    of each metric (a `*tokens` key is token-weighted: `step_metrics` divides it by `tokens`)."""

    rows: int  # of the mini-batch, forwarded or not
    forwarded_micro: int = 0
    forwarded_rows: int = 0
    tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(
        self,
        micro: dict[str, torch.Tensor],
        mask: torch.Tensor,
        ent: torch.Tensor,
        pg_loss: torch.Tensor,
        pg_metrics: dict[str, Any],
        terms: dict[str, float],
    ) -> None:
        """A forwarded micro-batch: the policy loss's own metrics (pg_clipfrac, ppo_kl, …: means over
        its tokens) weighted by its tokens, `pg_loss`, its entropy summed over its loss tokens, `terms`."""
        self.forwarded_micro += 1
        self.forwarded_rows += micro["input_ids"].shape[0]
        self.tokens += int(micro["response_mask"].sum())
        tokens = float(mask.sum())
        stats = {f"{k}*tokens": float(v) * tokens for k, v in pg_metrics.items()}
        stats.update({"actor/pg_loss": pg_loss.item(), "entropy_sum": float((ent.detach() * mask).sum())})
        stats.update(terms)
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v


def step_metrics(
    tally: _Tally, cost: ForwardCost, plan: PrefixPlan, grad_norm: float, cfg: ActorUpdateConfig
) -> dict[str, float]:
    """One step's metrics: the loss terms summed over its micro-batches (each normalised by the
    mini-batch totals); clip fractions, ppo_kl and entropy as means over the forwarded rows' tokens
    (the diagnostics of skipped rows are not computed); the gradient norm; what was skipped and
    what the forwards cost. `ppo_update` averages them over steps, or sums them (`_SUMMED`)."""
    per = max(tally.tokens, 1)
    sums = tally.sums
    out = {k: v for k, v in sums.items() if k.startswith("actor/") and not k.endswith("*tokens")}
    out.update({k[: -len("*tokens")]: v / per for k, v in sums.items() if k.endswith("*tokens")})
    if tally.forwarded_rows:
        out["actor/entropy"] = sums["entropy_sum"] / per
    out.setdefault("actor/pg_loss", 0.0)  # every row skipped: the loss is exactly 0
    out["actor/grad_norm"] = grad_norm
    out["actor/nonfinite_grad_steps"] = float(not math.isfinite(grad_norm))
    micro_batches_in_all = len(range(0, tally.rows, cfg.micro_batch_rows))
    out["actor/skipped_zero_adv_micro_batches"] = float(micro_batches_in_all - tally.forwarded_micro)
    out["actor/skipped_zero_adv_rows"] = float(tally.rows - tally.forwarded_rows)
    out["actor/diagnostic_rows"] = float(tally.forwarded_rows)
    out["actor/body_tokens"] = float(cost.body_tokens)
    if cfg.use_prefix_grouper:
        # per forwarded row, the prompt tokens computed once for its cluster (0 on the padded path)
        out["actor/shared_prefix_tokens"] = cost.prefixed_tokens / max(tally.forwarded_rows, 1)
        out["actor/shared_prefixes"] = float(plan.shared)
        out["actor/shared_prefix_fallbacks"] = float(plan.fallbacks)
    return out
