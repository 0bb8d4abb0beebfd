"""LoRA on the local engine, from verl's own keys, with the served model reading the adapter.

    actor_rollout_ref.model.lora_rank: 8           # 0 (verl's default): full fine-tune
    actor_rollout_ref.model.lora_alpha: 16
    actor_rollout_ref.model.target_modules: all-linear
    actor_rollout_ref.model.exclude_modules: null
    actor_rollout_ref.model.lora_adapter_path: null   # a PEFT adapter dir to start from

The adapter is the one verl's FSDP engine builds (`LoraConfig(task_type=CAUSAL_LM, r, lora_alpha,
target_modules, exclude_modules, bias="none")`, PEFT's default init: A Kaiming-uniform, B zero), but
injected into the module in place (`peft.inject_adapter_in_model`) instead of wrapped in a
`PeftModel`: the module keeps its class and tree, so the engine's scheduler, prefix cache and
fast decode path keep serving the *same* object the update trains. The frozen base weights move
to `<proj>.base_layer.weight`; only `lora_A` / `lora_B` require grad, so the optimizer (built over
trainable parameters) holds 2·r·(d_in + d_out) numbers per projection instead of d_in·d_out.

Serving and training read one merged weight: `effective_weight(proj)` = W + scale · B @ A,
recomputed only when W, A or B changed (their in-place version counters): one merge per adapted
projection per weight version, counted (`merge_count`). `agl_lab.engines.serving.fast_decode`
decodes with it; HF's forward (the logprobs, the update) applies it too (`_MergedProduct`: one
product instead of PEFT's three plus a scale and an add, and A's and B's gradients from two
rank-r products), so the trainer's logprobs are the engine's function, not a re-association of it.
PEFT's own forward runs wherever that path does not hold (adapters disabled or merged, autocast,
dtypes that differ, a trainable base weight). Measured on
SmolLM2-135M, r=8 (#51): the 210 merges cost 1.8 s of CPU and the oneDNN re-pack of the merged
weights 2.2 s more — once per version, but done lazily they landed in the first decode step after
each update, where under load they stalled every running generation. `merge_all` does them ahead:
`LocalEngine` warms (`fast_decode.warm`) at start and in `sync_weights`, before serving resumes.

On disk (`LocalEngine.save`): the base weights under HF's own names (a loadable model dir) and
the adapter in PEFT's format in `lora_adapter/` (what `PeftModel.from_pretrained` and verl's
`lora_adapter_path` read). `merged_state_dict` gives the merged weights for an export.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any

import torch

from agl_lab.engines import precision

ADAPTER_DIR = "lora_adapter"
_ADAPTER = "default"  # PEFT's adapter name; one adapter per model here
_PEFT_PREFIX = "base_model.model."  # key prefix of PeftModel.save_pretrained's files


@dataclass(frozen=True)
class LoraSpec:
    """verl's `actor_rollout_ref.model` LoRA keys. `rank == 0` means no LoRA."""

    rank: int = 0
    alpha: float = 16
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names
    exclude_modules: Any = None
    adapter_path: str | None = None

    @classmethod
    def from_model_config(cls, model_cfg: Mapping[str, Any] | None) -> LoraSpec:
        """From `actor_rollout_ref.model` (a dict or DictConfig); checks the values, naming the key."""
        from agl_lab.config import ConfigError

        cfg = dict(model_cfg or {})
        rank = cfg.get("lora_rank", 0) or 0
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ConfigError(f"actor_rollout_ref.model.lora_rank must be an integer ≥ 0 (0: no LoRA), got {rank!r}")
        alpha = cfg.get("lora_alpha", 16)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise ConfigError(f"actor_rollout_ref.model.lora_alpha must be a number > 0, got {alpha!r}")
        targets = _plain(cfg.get("target_modules", "all-linear"))
        if not (
            isinstance(targets, str)
            or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))
        ):
            raise ConfigError(
                "actor_rollout_ref.model.target_modules must be 'all-linear' or a list of module "
                f"names (e.g. [q_proj, v_proj]), got {targets!r}"
            )
        path = cfg.get("lora_adapter_path")
        return cls(
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            exclude_modules=_plain(cfg.get("exclude_modules")),
            adapter_path=str(path) if path else None,
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.adapter_path is not None

    def peft_config(self) -> Any:
        from peft import LoraConfig, TaskType

        return LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=self.target_modules,
            exclude_modules=self.exclude_modules,
            bias="none",
            lora_dropout=0.0,
        )


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def add_lora(model: torch.nn.Module, spec: LoraSpec) -> dict[str, int]:
    """Inject `spec`'s adapter into `model` in place (base weights frozen); load
    `spec.adapter_path` when given. Returns {"trainable": n, "total": n} parameter counts.

    A target list that matches no module fails naming the key (PEFT's own error says only
    that no target was found)."""
    from peft import inject_adapter_in_model

    from agl_lab.config import ConfigError

    if spec.adapter_path is not None:
        spec = _spec_of_adapter(spec)
    try:
        inject_adapter_in_model(spec.peft_config(), model, adapter_name=_ADAPTER)
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"actor_rollout_ref.model.target_modules={spec.target_modules!r} selects no layer of "
            f"this model ({exc}); its linear layers are named {names}, or use 'all-linear'"
        ) from None
    model._agl_lora = True
    for proj in adapted_layers(model):
        proj.forward = MethodType(_forward, proj)  # an instance attribute: deep copies keep it
    if spec.adapter_path is not None:
        load_adapter(model, spec.adapter_path)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": sum(p.numel() for p in model.parameters())}


def _spec_of_adapter(spec: LoraSpec) -> LoraSpec:
    """`adapter_path`'s own rank, alpha and targets (as verl does: the adapter's config wins)."""
    from agl_lab.config import ConfigError

    config_file = Path(spec.adapter_path).expanduser() / "adapter_config.json"
    if not config_file.exists():
        raise ConfigError(
            f"actor_rollout_ref.model.lora_adapter_path={spec.adapter_path!r} has no "
            "adapter_config.json: pass a directory written by PEFT's save_pretrained or LocalEngine.save"
        )
    saved = json.loads(config_file.read_text())
    return LoraSpec(
        rank=int(saved["r"]),
        alpha=saved["lora_alpha"],
        target_modules=saved["target_modules"],
        exclude_modules=saved.get("exclude_modules"),
        adapter_path=spec.adapter_path,
    )


def is_lora(model: torch.nn.Module) -> bool:
    """True for a model `add_lora` adapted (a flag it sets: checked at every decode step)."""
    return getattr(model, "_agl_lora", False)


def effective_weight(proj: torch.nn.Module) -> torch.Tensor:
    """The weight `proj` applies: its own, or for a LoRA layer W + scale · B @ A [d_out, d_in].

    Cached on the layer and recomputed only when W, A or B changed in place (an optimizer step,
    `load_state_dict`), so a decode step costs one dict lookup per projection."""
    lora_a = getattr(proj, "lora_A", None)
    if lora_a is None or _ADAPTER not in lora_a:
        return proj.weight
    w, a, b = proj.base_layer.weight, lora_a[_ADAPTER].weight, proj.lora_B[_ADAPTER].weight
    key = (w._version, a._version, b._version, w.data_ptr(), a.data_ptr(), b.data_ptr())
    cached = getattr(proj, "_agl_merged", None)
    if cached is None or cached[0] != key:
        # a normal tensor even inside the decode loop's inference_mode: the packed-weight cache
        # of fast_decode reads its version counter
        with torch.inference_mode(False), torch.no_grad():
            merged = torch.addmm(w, b, a, alpha=float(proj.scaling[_ADAPTER]))
        cached = (key, merged)
        proj._agl_merged = cached
        proj._agl_merges = getattr(proj, "_agl_merges", 0) + 1
    return cached[1]


class _MergedProduct(torch.autograd.Function):
    """y = x @ Wₑᵀ + bias for Wₑ = W + s · B @ A (`effective_weight`), with PEFT's gradients.

    x [..., in], merged [out, in], a [r, in], b [out, r] → y [..., out]. Backward, for dy [N, out]
    and x [N, in]: dx = dy @ Wₑ (what PEFT's dy @ W + s · (dy @ B) @ A sums to), dB = s · dyᵀ @ (x @ Aᵀ)
    [out, r] and dA = s · (dy @ B)ᵀ @ x [r, in]; W and the bias are frozen (no gradient). `merged`
    may be Wₑ's bfloat16 copy (`precision.copies`): then y and dx as `precision.Bf16Product` makes
    them, dA and dB still float32."""

    @staticmethod
    def forward(ctx, x, merged, a, b, bias, scale):
        ctx.save_for_backward(x, merged, a, b)
        ctx.scale = scale
        if merged.dtype != x.dtype:  # the bfloat16 copy (`precision.copies`)
            return precision.bf16_linear(x, merged, bias)
        return torch.nn.functional.linear(x, merged, bias)

    @staticmethod
    def backward(ctx, dy):
        x, merged, a, b = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ merged if merged.dtype == dy.dtype else precision.bf16_input_grad(dy, merged)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        db = (dy2.t() @ (x2 @ a.t())).mul_(ctx.scale)  # [out, r]
        da = ((dy2 @ b).t() @ x2).mul_(ctx.scale)  # [r, in]
        return dx, None, da, db, None, None


def _forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An adapted projection's forward (bound per layer by `add_lora`): the merged product where
    it equals PEFT's layer, PEFT's own forward otherwise."""
    base = self.base_layer
    if (
        args
        or kwargs
        or self.disable_adapters
        or self.merged
        or self.active_adapters != [_ADAPTER]
        or _ADAPTER in self.lora_variant
        or not isinstance(self.lora_dropout[_ADAPTER], torch.nn.Identity)
        or base.weight.requires_grad
        or (base.bias is not None and base.bias.requires_grad)
        or x.dtype != base.weight.dtype
        or torch.is_autocast_enabled(x.device.type)
    ):
        return type(self).forward(self, x, *args, **kwargs)
    a, b = self.lora_A[_ADAPTER].weight, self.lora_B[_ADAPTER].weight
    merged = effective_weight(self)
    if precision.copies():  # agl_lab.model.compute_dtype=bfloat16: the decode loop's bfloat16 weight
        merged = precision.bf16_copy(self, merged)
    return _MergedProduct.apply(x, merged, a, b, base.bias, float(self.scaling[_ADAPTER]))


def adapted_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The projections `add_lora` adapted (each holds a base layer and this project's adapter)."""
    return [m for m in model.modules() if _ADAPTER in (getattr(m, "lora_A", None) or {})]


def merge_all(model: torch.nn.Module) -> int:
    """Merge every adapted projection whose W, A or B changed since its last merge; returns how many
    merged now (0 when the weights did not change). The warm-up before serving resumes."""
    before = merge_count(model)
    for proj in adapted_layers(model):
        effective_weight(proj)
    return merge_count(model) - before


def merge_count(model: torch.nn.Module) -> int:
    """Merges done so far on `model`'s adapted projections: one per projection per weight version."""
    return sum(getattr(proj, "_agl_merges", 0) for proj in adapted_layers(model))


# --- on disk ------------------------------------------------------------------------------


def split_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights under HF's names, adapter under PEFT's file names)."""
    base, adapter = {}, {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:  # model.layers.0.self_attn.q_proj.lora_A.default.weight
            adapter[_PEFT_PREFIX + name.replace(f".{_ADAPTER}.", ".")] = tensor
        else:
            base[name.replace(".base_layer.", ".")] = tensor
    return base, adapter


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights with each adapter merged in, under HF's names (for an export)."""
    merged = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            merged[f"{name}.weight"] = effective_weight(module).detach().clone()
    base, _ = split_state_dict(model)
    return {**base, **merged}


def save_adapter(model: torch.nn.Module, spec: LoraSpec, path: str | Path) -> Path:
    """Write the adapter as PEFT does (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _, adapter = split_state_dict(model)
    save_file({k: v.detach().contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"))
    config = spec.peft_config().to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    return out


def injected_name(name: str) -> str:
    """A weight name as verl or PEFT sends/saves it → its parameter name in an injected model:
    `base_model.model.X.lora_A.weight` (PEFT's file) or `X.lora_A.default.weight` → `X.lora_A.default.weight`."""
    name = name.removeprefix(_PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{_ADAPTER}.weight")
    return name


def spec_of_peft_config(peft_config: Mapping[str, Any]) -> LoraSpec:
    """The LoraSpec of a PEFT config dict (what verl's weight sync sends with an adapter)."""
    targets = peft_config.get("target_modules", "all-linear")
    targets = sorted(targets) if isinstance(targets, (set, frozenset, tuple)) else targets
    exclude = peft_config.get("exclude_modules")
    exclude = sorted(exclude) if isinstance(exclude, (set, frozenset, tuple)) else exclude
    return LoraSpec(
        rank=int(peft_config["r"]),
        alpha=peft_config.get("lora_alpha", 16),
        target_modules=targets,
        exclude_modules=exclude,
    )


def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Load a PEFT adapter dir into an injected model; every adapter tensor must find its layer."""
    from safetensors.torch import load_file

    src = Path(path).expanduser()
    files = list(src.glob("adapter_model.safetensors")) or list(src.glob("adapter_model.bin"))
    if not files:
        raise FileNotFoundError(f"{src} has no adapter_model.safetensors (a PEFT adapter directory)")
    saved = (
        load_file(str(files[0]))
        if files[0].suffix == ".safetensors"
        else torch.load(files[0], map_location="cpu", weights_only=True)
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, tensor in saved.items():
            name = injected_name(key)
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(
                    f"{src}: adapter tensor {key} {tuple(tensor.shape)} has no matching layer in this "
                    "model (another base model, or another rank/targets)"
                )
            params[name].copy_(tensor)


def load_base(model: torch.nn.Module, base: Mapping[str, torch.Tensor]) -> None:
    """Load HF-named base weights into an injected model (names gain `.base_layer.`)."""
    target = model.state_dict()
    mapped = {}
    for name in target:
        if ".lora_" in name:
            continue
        hf = name.replace(".base_layer.", ".")
        if hf not in base:
            raise KeyError(f"base weights lack {hf}")
        mapped[name] = base[hf]
    model.load_state_dict(mapped, strict=False)
