"""The actor model loaded the way verl 0.9.1's FSDP worker loads it, for a given config.

A first GPU run fails before step 1 when the model cannot be built in the worker (verl's
default `attn_implementation: flash_attention_2` needs the `flash_attn` package, which
`verl[vllm]` does not install). This module runs verl's own worker code for the actor, in
this process, so that failure shows on any machine — CPU included — before a GPU is rented:

| verl 0.9.1 (ActorRolloutRefWorker.init_model → TrainingWorker → FSDPEngine) | here        |
|-----------------------------------------------------------------------------|-------------|
| `omega_conf_to_dataclass(config.model)` → `HFModelConfig` (tokenizer, AutoConfig with `override_config.attn_implementation`) | same call |
| `omega_conf_to_dataclass(config.actor)` → `ActorConfig` (`.engine`, `.optim`, `.checkpoint`) | same call |
| `engine_config.use_remove_padding = model_config.use_remove_padding`, micro-batch fields | same assignments |
| `EngineRegistry.new("language_model", strategy, …)` → `FSDPEngineWithLMHead` (device mesh) | same class |
| `FSDPEngine._build_module()`: `from_pretrained(torch_dtype, config=hf_config)`, verl's monkey patch (remove padding), dtype, gradient checkpointing | verl's own method |

Not run: FSDP wrapping, offload and the optimizer (`_build_fsdp_module`, `_build_optimizer`),
which need no extra package. Needs a `torch.distributed` process group (the worker has one);
`load_actor_module` starts a one-process group when none exists (gloo; `cpu:gloo,cuda:nccl`
with CUDA) and ends it afterwards. On a machine without CUDA the verl platform must be
agl_lab's CPU platform (`python -m agl_lab.engines.verl.model_load` activates it).

    python -m agl_lab.engines.verl.model_load configs/gpu_verl.yaml agl_lab.model.path=/path/to/model

prints one JSON line (attention implementation, dtype, parameters, gradient checkpointing,
and how far packed rows — verl's remove-padding input — are from padded rows, in the
logits of the real tokens; measured on the GPU when there is one, as FSDP moves the module
there) and exits 0, or prints the error and exits 1.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from agl_lab.engines.verl.api import verl_import


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A world-size-1 `torch.distributed` group for the length of the block (none if one exists)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    with tempfile.TemporaryDirectory(prefix="agl_lab_pg_") as tmp:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def actor_configs(config: Any) -> tuple[Any, Any]:
    """(HFModelConfig, ActorConfig) as verl's worker builds them from `config` (agl_lab keys applied)."""
    from omegaconf import DictConfig, OmegaConf

    from agl_lab.engines.verl.trainer import apply_agl_lab_keys

    cfg = copy.deepcopy(config) if isinstance(config, DictConfig) else OmegaConf.create(config)
    apply_agl_lab_keys(cfg)
    OmegaConf.resolve(cfg)
    to_dataclass = verl_import("omega_conf_to_dataclass")
    model_config = to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    engine = actor_config.engine  # the worker's assignments (ActorRolloutRefWorker.init_model)
    rollout = cfg.actor_rollout_ref.rollout
    engine.use_dynamic_bsz = cfg.actor_rollout_ref.actor.use_dynamic_bsz
    engine.infer_max_token_len_per_gpu = rollout.log_prob_max_token_len_per_gpu
    engine.infer_micro_batch_size_per_gpu = rollout.log_prob_micro_batch_size_per_gpu
    engine.max_token_len_per_gpu = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    engine.micro_batch_size_per_gpu = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    engine.use_remove_padding = model_config.get("use_remove_padding", False)
    engine.use_fused_kernels = model_config.get("use_fused_kernels", False)
    return model_config, actor_config


def load_actor_module(config: Any) -> Any:
    """The actor's `torch.nn.Module` exactly as verl's `FSDPEngine._build_module` builds it (before FSDP)."""
    model_config, actor = actor_configs(config)
    with one_process_group():
        engine_cls = verl_import("EngineRegistry.get_engine_cls")("language_model", actor.engine.strategy)
        engine = engine_cls(
            model_config=model_config,
            engine_config=actor.engine,
            optimizer_config=actor.optim,
            checkpoint_config=actor.checkpoint,
        )
        return engine._build_module()


def packed_vs_padded(module: Any, lengths: Sequence[int] = (5, 9, 3), seed: int = 0) -> float:
    """Max |logit difference| over the real tokens between padded rows (attention mask) and the
    same rows packed into one (position ids restarting per row, no mask: verl's remove-padding
    input). A float, 0 when the attention implementation separates packed sequences exactly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab = int(module.config.vocab_size)
    width = max(lengths)
    device = next(module.parameters()).device
    rows = [torch.randint(1, vocab, (n,), generator=gen).to(device) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, row in enumerate(rows):  # right padding, as verl's actor sees rows after removing left pads
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            padded = module(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            packed = module(
                input_ids=torch.cat(rows)[None],
                use_cache=False,
                position_ids=torch.cat([torch.arange(len(r), device=device) for r in rows])[None],
            ).logits[0]
    finally:
        module.train(was_training)
    real = torch.cat([padded[i, : len(r)] for i, r in enumerate(rows)])
    return float((real.float() - packed.float()).abs().max())


def describe(module: Any) -> dict[str, Any]:
    """What a user checks of the loaded actor: attention implementation, dtype, size, checkpointing."""
    param = next(module.parameters())
    return {
        "class": type(module).__name__,
        "attn_implementation": getattr(module.config, "_attn_implementation", None),
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "parameters": sum(p.numel() for p in module.parameters()),
        "gradient_checkpointing": bool(getattr(module, "is_gradient_checkpointing", False)),
        "packed_vs_padded_max_abs": packed_vs_padded(module),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m agl_lab.engines.verl.model_load CONFIG [key=value ...]", file=sys.stderr)
        return 2
    import torch

    from agl_lab.config import load_config

    cfg = load_config(args[0], args[1:])
    if not torch.cuda.is_available():  # verl's platform must say "cpu" for the device mesh
        from agl_lab.engines.verl.cpu import activate

        activate()
    try:
        module = load_actor_module(cfg)
    except Exception as exc:  # noqa: BLE001 (reported as the result)
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    if torch.cuda.is_available():  # verl's FSDP moves the loaded (CPU) module to the GPU: measure it there
        module = module.to("cuda")
    print(json.dumps({"ok": True, **describe(module)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
