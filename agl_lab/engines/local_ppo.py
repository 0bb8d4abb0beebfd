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

**Zero-advantage micro-batches are skipped, exactly** (`skip_zero_advantage`, on by default):
a row whose advantages are 0 on every loss token adds exactly 0 to every gradient when the
loss has no other term for it (no entropy bonus, no KL loss) and the loss is row-separable
(`per_rollout_mean`, verl's `vanilla`: `ZERO_SKIP_EXACT_LOSSES`). Within a mini-batch the rows
with a non-zero advantage go first (a stable order, with the skip on or off, so zero rows fall
together in whole micro-batches); a micro-batch of only zero rows is not forwarded. The
normalisers (mini-batch tokens and rows in `global_batch_info`, the per-rollout divisor in the
advantages) are those of the whole mini-batch either way, and the optimiser step always runs —
with zero-filled gradients when nothing was forwarded (AdamW's moments and weight decay move
the weights with a zero gradient). Gradients and weights are then bit-identical with and
without the skip (tests/test_local_ppo.py); the diagnostics (`actor/entropy`, clip fractions,
`actor/ppo_kl`) average over the forwarded rows only (`actor/diagnostic_rows`).

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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from verl import DataProto
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

from agl_lab.algorithms.loss import register_loss
from agl_lab.config_keys import LOSS_AGG_MODES
from agl_lab.rules import LOSS_NAME, mini_batch_rows

logger = logging.getLogger(__name__)

_PREFIX = "actor_rollout_ref.actor."

# Losses that are a sum of per-row terms, each a multiple of the row's advantage: a row with
# advantage 0 adds exactly 0 to the loss and its gradient (verl 0.9.1's compute_policy_loss_vanilla
# and agl_lab's per_rollout_mean, the global-batch normalisers fixed per mini-batch).
ZERO_SKIP_EXACT_LOSSES = (LOSS_NAME, "vanilla")


# =============================================================================================
# Config: the actor keys of verl's ppo_trainer, in rows
# =============================================================================================


@dataclass
class ActorUpdateConfig:
    """What one policy update needs. Sizes are in **rows** (verl's mini-batch is in tasks).

    `ppo_micro_batch_size_per_gpu=None` means one micro-batch per mini-batch; `grad_clip`
    None or ≤ 0 disables clipping (the norm is still reported). `lr`, `weight_decay` and
    `betas` are for `build_optimizer`; `policy_loss_options` are extra fields of verl's
    `PolicyLossConfig` (e.g. `clip_cov_ratio` for loss_mode=clip_cov).
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int | None = None
    loss_mode: str = LOSS_NAME
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float | None = 1.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    shuffle: bool = False
    seed: int = 42
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    policy_loss_options: dict[str, Any] = field(default_factory=dict)
    skip_zero_advantage: bool = True

    def __post_init__(self) -> None:
        for key in ("ppo_epochs", "ppo_mini_batch_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{_PREFIX}{key} must be a positive integer, got {getattr(self, key)}")
        micro = self.ppo_micro_batch_size_per_gpu
        if micro is not None and micro <= 0:
            raise ValueError(f"{_PREFIX}ppo_micro_batch_size_per_gpu must be positive or null, got {micro}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"{_PREFIX}loss_agg_mode={self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"{_PREFIX}clip_ratio_c must be greater than 1.0, got {self.clip_ratio_c}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]

    @property
    def micro_batch_rows(self) -> int:
        return self.ppo_micro_batch_size_per_gpu or self.ppo_mini_batch_size

    def zero_skip_blocker(self) -> str | None:
        """Why skipping zero-advantage micro-batches would not be exact here, or None when it is."""
        if self.entropy_coeff != 0:
            return f"{_PREFIX}entropy_coeff={self.entropy_coeff} (the entropy bonus is non-zero for every row)"
        if self.use_kl_loss:
            return f"{_PREFIX}use_kl_loss=true (the KL loss is non-zero for every row)"
        if self.loss_mode not in ZERO_SKIP_EXACT_LOSSES:
            return f"{_PREFIX}policy_loss.loss_mode={self.loss_mode} (not one of {list(ZERO_SKIP_EXACT_LOSSES)})"
        return None

    @property
    def zero_skip_active(self) -> bool:
        """`skip_zero_advantage` is on and exact for this loss (`zero_skip_blocker` is None)."""
        return self.skip_zero_advantage and self.zero_skip_blocker() is None

    @classmethod
    def from_verl_actor_config(cls, actor: Any, *, rollout_n: int = 1, **overrides: Any) -> ActorUpdateConfig:
        """Map `actor_rollout_ref.actor.*` (dict, DictConfig or verl dataclass) to this config.

        verl's `ppo_mini_batch_size` counts tasks: rows = it × `rollout_n`
        (`actor_rollout_ref.rollout.n`). Unknown keys are ignored. The sampling temperature is
        not part of it: it travels with the batch, in `data.meta_info["temperature"]`, as in verl.
        """
        micro = _get(actor, "ppo_micro_batch_size_per_gpu")
        if micro is None:
            micro = _get(actor, "ppo_micro_batch_size")  # deprecated verl key
        grad_clip = _get(actor, "grad_clip")
        if grad_clip is None:
            grad_clip = _get(actor, "optim.clip_grad", 1.0)
        loss_options = _plain(_get(actor, "policy_loss", {}) or {})
        loss_options = {k: v for k, v in loss_options.items() if not k.startswith("_") and k != "rollout_correction"}
        kwargs: dict[str, Any] = dict(
            ppo_epochs=int(_get(actor, "ppo_epochs", 1)),
            ppo_mini_batch_size=mini_batch_rows(_get(actor, "ppo_mini_batch_size", 256), rollout_n),
            ppo_micro_batch_size_per_gpu=None if micro is None else int(micro),
            loss_mode=str(loss_options.pop("loss_mode", LOSS_NAME)),
            grad_clip=grad_clip,
            seed=int(_get(actor, "data_loader_seed", 42)),
            lr=float(_get(actor, "optim.lr", 1e-6)),
            weight_decay=float(_get(actor, "optim.weight_decay", 0.01)),
            betas=tuple(_get(actor, "optim.betas", (0.9, 0.999))),
            policy_loss_options=loss_options,
        )
        for key in (
            "clip_ratio",
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "entropy_coeff",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_loss_type",
            "loss_agg_mode",
            "loss_scale_factor",
            "shuffle",
        ):
            value = _get(actor, key)
            if value is not None:
                kwargs[key] = value
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_verl_actor_config(self) -> Any:
        """The verl `FSDPActorConfig` verl's policy losses read (clip ratios, global_batch_info)."""
        from verl.workers.config import FSDPActorConfig, PolicyLossConfig

        known = {f.name for f in fields(PolicyLossConfig)} - {"loss_mode"}
        unknown = sorted(set(self.policy_loss_options) - known)
        if unknown:
            raise ValueError(
                f"{_PREFIX}policy_loss has unknown keys {unknown}; verl's PolicyLossConfig accepts {sorted(known)}"
            )
        return FSDPActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_epochs=self.ppo_epochs,
            shuffle=self.shuffle,
            ppo_mini_batch_size=self.ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu=self.micro_batch_rows,
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            loss_scale_factor=self.loss_scale_factor,
            entropy_coeff=self.entropy_coeff,
            use_kl_loss=self.use_kl_loss,
            kl_loss_coef=self.kl_loss_coef,
            kl_loss_type=self.kl_loss_type,
            grad_clip=self.grad_clip,
            data_loader_seed=self.seed,
            policy_loss=PolicyLossConfig(loss_mode=self.loss_mode, **self.policy_loss_options),
        )


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """`cfg.a.b` for dicts, DictConfigs and dataclasses; `default` when a part is missing."""
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, Mapping):
            node = node.get(part, None)
        else:
            node = getattr(node, part, None)
        if node is None:
            return default
    return node


def _plain(node: Any) -> dict[str, Any]:
    if isinstance(node, Mapping):
        return {k: node[k] for k in node}
    return {f.name: getattr(node, f.name) for f in fields(node) if not f.name.startswith("_")}


def build_optimizer(model: torch.nn.Module, cfg: ActorUpdateConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with `cfg.lr`, `weight_decay`, `betas`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)


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
    kept = max(int(attended[-1]) + 1 - prompt_width, 1)
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
    attended = attention_mask[:, -kept:].to(device, logits.dtype)  # padding → 0.0, cut off or not
    widen = lambda t: F.pad(t * attended, (0, response_length - kept))  # noqa: E731  [n, R'] → [n, R]
    logprobs = widen(logprobs_from_logits(logits, input_ids[:, -kept:].to(device)))
    if entropy == "none":
        return logprobs, None
    return logprobs, widen(entropy_from_logits(logits if entropy == "grad" else logits.detach()))


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, normalised by the mini-batch totals in `verl_cfg.global_batch_info`."""
    response_length = mb["responses"].shape[-1]
    logp, ent = _response_forward(
        model,
        mb["input_ids"],
        mb["attention_mask"],
        mb["position_ids"],
        response_length,
        temperature,
        "grad" if cfg.entropy_coeff != 0 else "detached",
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


def trained_row_mask(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows with a non-zero advantage on at least one loss token (the others carry no
    policy gradient)."""
    return ((advantages != 0) & response_mask.bool()).any(-1)


def _zero_rows_last(mb: dict[str, torch.Tensor], micro_rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The mini-batch with its signal rows first, zero-advantage rows last (stable), and the
    signal mask [n] in that order. Unchanged with one micro-batch per mini-batch."""
    signal = trained_row_mask(mb["advantages"], mb["response_mask"])
    if mb["input_ids"].shape[0] <= micro_rows:
        return mb, signal
    order = torch.cat([torch.nonzero(signal).flatten(), torch.nonzero(~signal).flatten()])
    return {k: v[order] for k, v in mb.items()}, signal[order]


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
    mb, signal = _zero_rows_last(mb, cfg.micro_batch_rows)
    skip = cfg.zero_skip_active
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    skipped_micro = skipped_rows = forwarded_rows = forwarded_tokens = 0
    for s in range(0, rows, cfg.micro_batch_rows):
        micro = {k: v[s : s + cfg.micro_batch_rows] for k, v in mb.items()}
        n_micro = micro["input_ids"].shape[0]
        if skip and not bool(signal[s : s + n_micro].any()):
            skipped_micro, skipped_rows = skipped_micro + 1, skipped_rows + n_micro
            continue
        loss, stats = _micro_loss(model, micro, cfg, temperature, verl_cfg, loss_fn)
        loss.backward()
        forwarded_rows += n_micro
        forwarded_tokens += int(micro["response_mask"].sum())
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if forwarded_rows == 0:
        # Critical: AdamW skips a parameter whose grad is None; a zero gradient still moves it
        # (moments decay, weight decay) exactly as the forwarded all-zero micro-batches would.
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
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
    return out


def _row_order(n: int, cfg: ActorUpdateConfig, epoch: int) -> torch.Tensor:
    if not cfg.shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))


# Step metrics that are counts over the whole update (the rest are means over optimiser steps).
_SUMMED = (
    "actor/nonfinite_grad_steps",
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
