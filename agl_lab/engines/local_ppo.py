"""The local engine's policy update: PPO epochs over mini-batches, verl's losses, one device.

The verl engine runs this step on FSDP workers; the local engine (a transformers model on
CPU or one GPU) runs it here, with the *same* loss functions: the policy loss is looked up
in verl's registry by `loss_mode` (`per_rollout_mean` from `agl_lab.algorithms`, `vanilla`,
or any other registered one), entropy and KL terms go through verl's `agg_loss` and
`kl_penalty`. What this module adds is only the loop verl's actor would run:

    for epoch:                          ppo_epochs
      for mini-batch (rows):            one optimiser step each
        for micro-batch (rows):         forward + backward, gradients accumulate
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
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

from agl_lab.algorithms.loss import register_loss
from agl_lab.engines import zero_skip
from agl_lab.engines.actor_config import ActorUpdateConfig, build_optimizer  # noqa: F401 (re-export)
from agl_lab.engines.shared_prefix import (
    MIN_SHARED,
    SharedPrefix,
    kept_response_width,
    padded_body_tokens,
    plan_prefixes,
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
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
        logits_to_keep=kept + 1,
    )
    # Critical: position t predicts token t+1, so the R' logits before the last one score the
    # R' response tokens; the last position predicts past the end and is dropped.
    logits = out.logits[:, -(kept + 1) : -1, :].float() / temperature
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
# The update loop
# =============================================================================================

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


def _micro_loss(
    model: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    cfg: ActorUpdateConfig,
    temperature: float,
    verl_cfg: Any,
    loss_fn: Any,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, normalised by the mini-batch totals in `verl_cfg.global_batch_info`;
    with `prefix`, the rows' shared prefix comes from its cache (`agl_lab.engines.shared_prefix`)."""
    response_length = mb["responses"].shape[-1]
    entropy = "grad" if cfg.entropy_coeff != 0 else "detached"
    if prefix is not None:
        logp, ent = prefix.response_forward(
            mb["input_ids"], mb["attention_mask"], response_length, temperature, entropy
        )
    else:
        logp, ent = _response_forward(
            model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], response_length, temperature, entropy
        )
    device = logp.device
    mask = mb["response_mask"].to(device).bool()
    pg_loss, pg_metrics = loss_fn(
        old_log_prob=mb["old_log_probs"].to(device),
        log_prob=logp,
        advantages=mb["advantages"].to(device),
        response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode,
        config=verl_cfg,
        rollout_is_weights=mb["rollout_is_weights"].to(device) if "rollout_is_weights" in mb else None,
    )
    info = verl_cfg.global_batch_info
    tokens = float(mask.sum())
    stats = {f"{k}*tokens": float(v) * tokens for k, v in pg_metrics.items()}
    stats.update({"actor/pg_loss": pg_loss.item(), "entropy_sum": float((ent.detach() * mask).sum())})
    loss = pg_loss
    if cfg.entropy_coeff != 0:
        entropy_loss = agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
        loss = loss - cfg.entropy_coeff * entropy_loss
        stats["actor/entropy_loss"] = entropy_loss.item()
    if cfg.use_kl_loss:
        kld = kl_penalty(logprob=logp, ref_logprob=mb["ref_log_prob"].to(device), kl_penalty=cfg.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=cfg.loss_agg_mode, **info)
        loss = loss + cfg.kl_loss_coef * kl_loss
        stats["actor/kl_loss"] = kl_loss.item()
    return loss, stats


def _mini_batch_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mb: dict[str, torch.Tensor],
    cfg: ActorUpdateConfig,
    temperature: float,
    verl_cfg: Any,
    loss_fn: Any,
) -> dict[str, float]:
    """Micro-batches → accumulated gradient → clip → optimiser step; the mini-batch's metrics.

    With `cfg.zero_skip_active`, micro-batches of zero-advantage rows only are not forwarded
    (module docstring); the step still runs, on zero-filled gradients if nothing was forwarded."""
    rows, mask = mb["input_ids"].shape[0], mb["response_mask"]
    tokens = max(int(mask.sum()), 1)
    # Critical: every micro-batch is normalised by the mini-batch totals → accumulation is exact,
    # and a skipped micro-batch leaves them unchanged (they count every row, forwarded or not).
    verl_cfg.global_batch_info.update(
        dp_size=1, batch_num_tokens=tokens, global_batch_size=rows, loss_scale_factor=cfg.loss_scale_factor
    )
    mb, signal = zero_skip.zero_rows_last(mb, cfg.micro_batch_rows)
    starts = list(range(0, rows, cfg.micro_batch_rows))
    forwarded = zero_skip.forwarded_starts(signal, cfg.micro_batch_rows) if cfg.zero_skip_active else starts
    plan = plan_prefixes(mb, forwarded, cfg.micro_batch_rows) if cfg.use_prefix_grouper else None
    cluster_of = {s: i for i, c in enumerate(plan.clusters) for s in c} if plan else {}
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    forwarded_rows = forwarded_tokens = body_tokens = prefixed_tokens = 0
    prefix, prefix_cluster = None, None
    for s in forwarded:
        micro = {k: v[s : s + cfg.micro_batch_rows] for k, v in mb.items()}
        c = cluster_of.get(s)
        if c != prefix_cluster:  # a new cluster: the previous prefix's gradient goes through it once
            if prefix is not None:
                prefix.backward()
                body_tokens += prefix.body_tokens
            prefix_cluster, length = c, plan.lengths[c] if c is not None else 0
            prefix = None
            if length >= MIN_SHARED:
                begin = plan.begins[c]
                prefix = SharedPrefix(model, mb["input_ids"][plan.clusters[c][0], begin : begin + length])
        loss, stats = _micro_loss(model, micro, cfg, temperature, verl_cfg, loss_fn, prefix)
        loss.backward()
        n_micro = micro["input_ids"].shape[0]
        forwarded_rows += n_micro
        forwarded_tokens += int(micro["response_mask"].sum())
        if prefix is None:
            body_tokens += padded_body_tokens(micro["attention_mask"], micro["responses"].shape[-1])
        else:
            prefixed_tokens += n_micro * prefix.length
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
    if prefix is not None:
        prefix.backward()  # the last cluster's shared prefix, summed over its rows, in one pass
        body_tokens += prefix.body_tokens
    skipped_micro, skipped_rows = len(starts) - len(forwarded), rows - forwarded_rows
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if forwarded_rows == 0:
        zero_skip.zero_fill_grads(params)  # AdamW skips a None grad; a zero one still moves weights
    max_norm = cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm))
    nonfinite = not math.isfinite(grad_norm)
    if nonfinite:
        logger.warning("skipping an optimiser step: gradient norm is %s", grad_norm)
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    # `*tokens` accumulators are token-weighted sums (internal): only their means are metrics,
    # over the forwarded rows' tokens (the diagnostics of skipped rows are not computed)
    per = max(forwarded_tokens, 1)
    out = {k: v for k, v in totals.items() if k.startswith("actor/") and not k.endswith("*tokens")}
    out.update({k[: -len("*tokens")]: v / per for k, v in totals.items() if k.endswith("*tokens")})
    if forwarded_rows:
        out["actor/entropy"] = totals["entropy_sum"] / per
    out.setdefault("actor/pg_loss", 0.0)  # every row skipped: the loss is exactly 0
    out["actor/grad_norm"] = grad_norm
    out["actor/nonfinite_grad_steps"] = float(nonfinite)
    out["actor/skipped_zero_adv_micro_batches"] = float(skipped_micro)
    out["actor/skipped_zero_adv_rows"] = float(skipped_rows)
    out["actor/diagnostic_rows"] = float(forwarded_rows)
    out["actor/body_tokens"] = float(body_tokens)
    if cfg.use_prefix_grouper:
        # per forwarded row, the prompt tokens computed once for its cluster (0 on the padded path)
        out["actor/shared_prefix_tokens"] = prefixed_tokens / max(forwarded_rows, 1)
        out["actor/shared_prefixes"] = float(sum(1 for length in plan.lengths if length >= MIN_SHARED))
        out["actor/shared_prefix_fallbacks"] = float(plan.fallbacks)
    return out


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


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    cfg: ActorUpdateConfig,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """PPO epochs over mini-batches (one optimiser step each) of `data`; returns metrics.

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
    verl_cfg = cfg.to_verl_actor_config()
    register_loss()  # per_rollout_mean, where get_policy_loss_fn looks it up
    loss_fn = get_policy_loss_fn(cfg.loss_mode)
    n = len(data)
    steps: list[dict[str, float]] = []
    model.train()
    for epoch in range(cfg.ppo_epochs):
        order = _row_order(n, cfg, epoch)
        for s in range(0, n, cfg.ppo_mini_batch_size):
            idx = order[s : s + cfg.ppo_mini_batch_size]
            mb = {k: v[idx] for k, v in tensors.items()}
            steps.append(_mini_batch_step(model, optimizer, mb, cfg, temperature, verl_cfg, loss_fn))
    for key in dict.fromkeys(k for step in steps for k in step):
        values = [step[key] for step in steps if key in step]
        metrics[key] = float(sum(values)) if key in _SUMMED else float(np.mean(values))
    metrics["actor/zero_adv_skip_active"] = float(cfg.zero_skip_active)
    if cfg.use_kl_loss:
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    metrics["actor/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["actor/n_updates"] = len(steps)
    return metrics
