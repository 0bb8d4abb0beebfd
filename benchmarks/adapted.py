"""The decode benchmarks' model: SmolLM2-135M (or an HF model directory) with a trained-looking LoRA adapter.

`decode_step.py`, `shared_block.py` and `openmp_pools.py` decode with it: float32, 2 torch threads,
LoRA r16 on every linear with B drawn at random (a trained adapter: the merged weights differ from
the base), seeded.
"""

from __future__ import annotations

from typing import Any

import torch

from agl_lab.engines.lora import LoraSpec, adapted_layers, add_lora


def adapted_model(model_path: str | None = None) -> tuple[Any, str]:
    """(model in eval mode, its directory): `model_path`, or the SmolLM2 preset when None."""
    from transformers import AutoModelForCausalLM

    from agl_lab.models import smollm2

    torch.set_num_threads(2)
    torch.manual_seed(0)
    path = model_path or str(smollm2())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    add_lora(model, LoraSpec(rank=16, alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for proj in adapted_layers(model):
            proj.lora_B["default"].weight.normal_(0, 0.01)
    return model, path
