"""One decode step of a Llama-family model written out in torch: the engine's hot loop.

`DecodeBatch.decode` calls `decode_step` for the models it supports (Llama, Qwen2 with full
attention — SmolLM2 and the tiny model are both) and HF's own forward otherwise. It reads the
*same* parameters as the HF module (no copies: an update is visible at the next step) and the
same KV slabs, and computes the same function; what it removes is what made a batched decode
step on CPU cost up to twice its matrix products (profiled on SmolLM2-135M, 1 thread):

* **GQA without `repeat_kv`.** HF's SDPA path copies every layer's whole K and V cache to
  `num_attention_heads` heads at every step when an attention mask is given (on CPU it
  always is, in a padded batch): B·H·L·D floats × 2 × layers per token. Here the query heads
  are grouped per KV head, `[B, KV, G, D] @ [B, KV, D, L]`, and the cache is read in place.
* **One RoPE, one mask per step**, shared by all layers (HF rebuilds the 4-D mask and calls
  the rotary module through its generic dispatch each forward).
* **The LM head through oneDNN** when torch has it: for the [B, d] × [d, V] product of a
  49k-word vocabulary it ran ~1.5–2.5× faster than the default (MKL) path on this machine's
  AMD CPUs; it is the largest single matrix of a small model.

Fidelity: the same float32 function with a different summation order — logprobs agree with
a full HF forward to ~1e-6 (tests/test_decode_batch.py checks `decode_step` against it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_SUPPORTED = {"LlamaForCausalLM", "Qwen2ForCausalLM"}


def supports(model: Any) -> bool:
    """True when `decode_step` computes exactly what `model`'s forward computes."""
    cfg = getattr(model, "config", None)
    if type(model).__name__ not in _SUPPORTED or cfg is None:
        return False
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (
        all(t == "full_attention" for t in layer_types)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "pretraining_tp", 1) == 1
        and getattr(model, "lm_head", None) is not None
        and getattr(model.lm_head, "bias", None) is None
    )


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_ok()


def lm_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [B, d] @ weight[V, d]ᵀ → logits [B, V] (oneDNN on CPU float32 when available)."""
    if _ONEDNN and hidden.device.type == "cpu" and hidden.dtype == torch.float32 and not torch.is_grad_enabled():
        return torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")
    return F.linear(hidden, weight)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    # HF's RMSNorm, float32 inside
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, D]; cos/sin [B, 1, D] → x rotated (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_step(model: Any, layers: list, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Forward one pending token per row through `model`, appending its K/V to the slabs.

    tokens [B], positions [B] (position id of each token), mask [B, L+1] (1 = real column,
    the last column is the new token), layers: one `SlabLayer` per decoder layer holding L
    columns → next-token logits [B, V] in the model's dtype.
    """
    inner, cfg = model.model, model.config
    b = tokens.shape[0]
    h_q, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q
    groups = h_q // h_kv

    hidden = inner.embed_tokens(tokens)  # [B, d_model]
    cos, sin = inner.rotary_emb(hidden[:, None], positions[:, None])  # [B, 1, D]
    # additive mask [B, 1, 1, L+1] shared by every layer: 0 on real columns, -inf on padding
    bias = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device)
    bias = bias.masked_fill_(mask == 0, float("-inf"))[:, None, None, :]

    for layer, slab in zip(inner.layers, layers):
        attn = layer.self_attn
        x = _rms_norm(layer.input_layernorm, hidden)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, h_q, d)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, h_kv, d)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, h_kv, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = slab.update(k[:, :, None], v[:, :, None])  # [B, KV, L+1, D] views, no copy
        # Critical: query heads grouped per KV head (HF's head order: head = kv · G + g)
        scores = torch.matmul(q.view(b, h_kv, groups, d), keys.transpose(2, 3)) * attn.scaling
        probs = torch.softmax(scores + bias, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, KV, G, L+1]
        out = torch.matmul(probs, values).reshape(b, h_q * d)
        hidden = hidden + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)

        mlp = layer.mlp
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        gate_up = F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)
        hidden = hidden + F.linear(gate_up, mlp.down_proj.weight)

    return lm_head(_rms_norm(inner.norm, hidden), model.lm_head.weight)
