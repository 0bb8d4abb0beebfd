"""The local update's config: `actor_rollout_ref.actor.*` of verl's ppo_trainer, in rows
(`ActorUpdateConfig`), and its AdamW (`build_optimizer`). `agl_lab.engines.local_ppo` re-exports both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from agl_lab.config_keys import LOSS_AGG_MODES
from agl_lab.engines import zero_skip
from agl_lab.rules import LOSS_NAME, mini_batch_rows

_PREFIX = "actor_rollout_ref.actor."


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
    use_prefix_grouper: bool = False

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
        return zero_skip.blocker(self.loss_mode, self.entropy_coeff, self.use_kl_loss)

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
            "use_prefix_grouper",
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
