"""Grouped-query attention without copying keys and values: each KV head's G query heads folded into
its query length (`GROUPED_SDPA`, the attention the local engine's CPU models run in HF's forward).

HF's `sdpa` attention, given a mask (padded rows; the update's suffixes over a shared prefix), repeats
every KV head for its G query heads before `scaled_dot_product_attention` — a copy of K and V per
layer forward, and a sum over the copies backward (SmolLM2: 9 query heads over 3 KV heads, G = 3).
Here the copies are not made: query head h = k·G + g reads KV head k, so

    query [b, H, S, D] → [b, KV, G·S, D]      (row g·S + i: query head k·G + g, position i)
    mask  [b, 1, S, L] → [b, 1, G·S, L]       (the same S rows for each g: `repeat` along the rows)
    scaled_dot_product_attention(query, key [b, KV, L, D], value) → [b, KV, G·S, D] → [b, S, H, D]

Each query row still attends over the same keys with the same mask, so the output is HF's (bit for bit
in the measured cases) and the K/V gradients differ only in summation order (~1e-7;
tests/test_grouped_attention.py). Without a mask (a causal forward with no padding, as the shared
prefix's) HF's `sdpa` runs as it is: its `is_causal` kernel skips the masked blocks, which an explicit
folded mask would not. `python benchmarks/lora_update.py --cases merged,sdpa` measures the update with and
without it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

GROUPED_SDPA = "agl_grouped_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: query [b, H, S, D], key/value [b, KV, L, D], mask [b | 1, 1, S, L]
    or None → (output [b, S, H, D], None). Folds the query heads when there is a mask, G > 1 and no
    dropout; otherwise HF's `sdpa_attention_forward` itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, s, d = query.shape
    if (
        groups == 1
        or dropout
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or attention_mask.shape[2] != s
        or key.shape[1] * groups != heads
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    folded = query.reshape(b, key.shape[1], groups * s, d)
    out = F.scaled_dot_product_attention(
        folded, key, value, attn_mask=attention_mask.repeat(1, 1, groups, 1), scale=scaling
    )
    return out.reshape(b, heads, s, d).transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> bool:
    """Switch `model` (a HF causal LM running `sdpa`, on the CPU, with fewer KV heads than query heads)
    to `GROUPED_SDPA`; True when switched. Other implementations a user chose (eager, flash) stay."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if config._attn_implementation != "sdpa" or not heads or not kv_heads or kv_heads >= heads:
        return False
    if next(model.parameters()).device.type != "cpu":  # measured on the CPU only (docs/engines.md)
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks HF builds for sdpa
    model.set_attn_implementation(GROUPED_SDPA)
    return True
