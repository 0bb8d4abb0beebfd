"""One decode step of a Llama-family model written out in torch: the engine's hot loop.

`DecodeBatch.decode` calls `decode_step` for the models it supports (Llama, Qwen2 with full
attention — SmolLM2 and the tiny model are both) and HF's own forward otherwise; `DecodeBatch.prefill`
calls `forward` with the prompts' T new tokens a row (one fused causal attention a layer). It reads the
*same* parameters as the HF module (no copies: an update is visible at the next step) and the
same KV slabs, and computes the same function; what it removes is what made a batched decode
step on CPU cost up to twice its matrix products (profiled on SmolLM2-135M, 1 thread):

* **GQA without `repeat_kv`.** HF's SDPA path copies every layer's whole K and V cache to
  `num_attention_heads` heads at every step when an attention mask is given (on CPU it
  always is, in a padded batch): B·H·L·D floats × 2 × layers per token. Here the query heads
  are grouped per KV head — one fused attention (`scaled_dot_product_attention`) of G queries
  over each KV head's `[L, D]` cache, read in place.
* **One RoPE, one mask per step**, shared by all layers (HF rebuilds the 4-D mask and calls
  the rotary module through its generic dispatch each forward).
* **One freshness check a step**: the packed products are rebuilt when a tensor they are made from
  changed (`_products`: version counters and storages of a list collected once per model).
* **Fused products.** q/k/v are one product over the concatenated weights (their biases too), and
  gate/up another, with one RoPE over the query and key heads: two products and ~8 small ops fewer
  a layer (a SmolLM2 step of 4–16 rows 6–14 % faster).
* **Matrix products through oneDNN with pre-packed weights** (CPU, float32, when torch has
  oneDNN): for the small-M products of a decode step (M = batch rows) the default MKL path
  streamed the weights at 3–5 GB/s on an AMD host of this machine kind; oneDNN with weights
  reordered once into its blocked layout ran the same products 1.5–2.4× faster (the LM
  head — a 49k × 576 matrix — most). The packed copies are rebuilt whenever a parameter's
  in-place version counter moves (an optimizer step, `load_state_dict`), so the served
  weights are always the trained ones. Cost: one more copy of the linear weights in memory.

LoRA (`agl_lab.engines.lora`): an adapted projection is served with W + scale·B@A, merged when W, A
or B changed and cached, so an adapter update is visible at the next step like a full one.

Fidelity: the same float32 function with a different summation order — logprobs agree with
a full HF forward to ~1e-6 (tests/test_decode_batch.py checks `decode_step` against it). With
`agl_lab.model.compute_dtype=bfloat16` (`agl_lab.engines.precision`) the products take bfloat16
inputs from packed bfloat16 copies: ~1.4–1.8× faster a product, logprobs off by up to ~1e-2
(the tiny model) to a few tenths (SmolLM2's worst token).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from agl_lab.engines import precision
from agl_lab.engines.lora import effective_weight, is_lora

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
    if os.environ.get("AGL_LAB_DECODE_ONEDNN", "1") == "0":  # opt out: torch's default matmul path
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


_ONEDNN = _onednn_ok()
_PACK_HINT = 32  # batch-size hint of the packed layout: measured best for M = 1 … 64
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → [lora, sources, versions, _Products]


def invariance_gap(model: Any) -> str | None:
    """Why batch-invariant mode cannot promise bitwise rows for `model` here (None: it can).

    The promise rests on oneDNN's packed float32 kernels on the CPU (`_Products`); elsewhere the
    matrix products go through `F.linear`, whose result for a row may depend on the number of rows.
    """
    p = next(model.parameters())
    if not _ONEDNN:
        return "this torch build lacks oneDNN's packed linear kernels"
    if p.device.type != "cpu":
        return f"the model is on {p.device.type}, where matrix products go through F.linear"
    if p.dtype != torch.float32:
        return f"the model is {str(p.dtype).removeprefix('torch.')}, and only float32 uses oneDNN's packed kernels"
    if precision.mixed(model):
        return f"{precision.KEY}=bfloat16: the row invariance was measured for the float32 kernels only"
    return None


class _Products:
    """The step's matrix products, built once per weight version: q/k/v fused into one product and
    gate/up into another (two fewer calls and one RoPE instead of two per layer), each through
    oneDNN's packed copy of the concatenated weights where it can, `F.linear` on the weights
    themselves otherwise (no concatenated copy: the outputs are concatenated instead)."""

    def __init__(self, model: Any, weights: list[torch.Tensor], packed: bool, mixed: bool):
        self.packed, self.mixed = packed, mixed
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            q, k, v, o, gate, up, down = weights[7 * i : 7 * i + 7]
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            if any(b is not None for b in biases):
                outs = (q.shape[0], k.shape[0], v.shape[0])
                biases = [b if b is not None else q.new_zeros(n) for b, n in zip(biases, outs)]
                qkv_bias = torch.cat(biases).detach()
            else:
                qkv_bias = None
            self.layers.append(
                (
                    self._prepare([q, k, v]),
                    qkv_bias,
                    self._prepare([o]),
                    a.o_proj.bias,
                    self._prepare([gate, up]),
                    self._prepare([down]),
                )
            )
        self.head = self._prepare([weights[-1]])

    def _prepare(self, ws: list[torch.Tensor]) -> Any:
        if not self.packed:
            return ws
        return pack(ws[0] if len(ws) == 1 else torch.cat([w.detach() for w in ws]), self.mixed)

    def __call__(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] @ the prepared weight(s)ᵀ (+ bias) → [M, out] (the outputs of fused weights side by side)."""
        if self.packed:
            return packed_product(x, w, bias, self.mixed)
        out = F.linear(x, w[0]) if len(w) == 1 else torch.cat([F.linear(x, wi) for wi in w], dim=-1)
        return out if bias is None else out + bias


def _products(model: Any) -> _Products:
    """The model's `_Products`, cached per model and rebuilt when a tensor it is made from changed in
    place (version counter) or was given new storage: a projection's weight (a LoRA layer's W, A and
    B), a q/k/v or o bias (the q/k/v ones are copied into the fused bias), the head.

    The list of those tensors is collected once per model (walking the modules and merging took
    ~2 ms of a SmolLM2 step); a parameter *replaced* by a new object is not seen — the engines update
    weights in place (optimizer steps, `load_state_dict`), as `PrefixCache.check_weights` assumes."""
    lora = is_lora(model)
    cached = _packed.get(model)
    if cached is None or cached[0] != lora:  # first call, or an adapter injected since
        cached = _packed[model] = [lora, _sources(model), None, None]
    _, sources, key, products = cached
    w0 = sources[0]
    packed = _ONEDNN and w0.device.type == "cpu" and w0.dtype == torch.float32
    mixed = precision.mixed(model)  # agl_lab.model.compute_dtype=bfloat16: packed bfloat16 copies
    now = (packed, mixed, *((t.data_ptr(), t._version) for t in sources))
    if now != key:  # first call, or the weights were updated in place
        weights = _linear_weights(model, effective_weight if lora else _own_weight)
        with torch.inference_mode():
            cached[3] = products = _Products(model, weights, packed, packed and mixed)
        cached[2] = now
    return products


def _sources(model: Any) -> list[torch.Tensor]:
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            adapted = is_lora(model) and hasattr(proj, "base_layer")
            base = proj.base_layer if adapted else proj
            out.append(base.weight)
            if adapted and "default" in proj.lora_A:
                out += [proj.lora_A["default"].weight, proj.lora_B["default"].weight]
            if base.bias is not None:
                out.append(base.bias)
    return out + [model.lm_head.weight]


def pack(weight: torch.Tensor, mixed: bool = False) -> torch.Tensor:
    """oneDNN's blocked copy of a linear weight [out, in] (a bfloat16 copy when `mixed`)."""
    return torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().to(torch.bfloat16 if mixed else torch.float32), _PACK_HINT
    )


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, mixed: bool = False):
    """x [M, in] @ the packed weight (`pack`) + bias → [M, out] float32. `mixed`: bfloat16 in, float32
    out — the rest of the step (norms, RoPE, attention) stays float32."""
    if not mixed:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()
    return out if bias is None else out + bias


def _linear_weights(model: Any, weight: Callable[[Any], torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [weight(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)]
    return out + [weight(model.lm_head)]


def _own_weight(proj: Any) -> torch.Tensor:
    return proj.weight


def warm(model: Any) -> None:
    """Merge LoRA (`lora.merge_all`) and pack the decode weights now — at engine start and weight
    sync, under the weights lock — not inside the first decode step of the next phase (#51)."""
    if supports(model):
        with torch.inference_mode():
            _products(model)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    # HF's RMSNorm, float32 inside
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, 1, D] → x rotated (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------
# Batch-invariant attention: a row's numbers never depend on its batch-mates or padding
# ---------------------------------------------------------------------------------------

_LANES = 16  # key columns padded to a multiple of this: every exp runs in the same SIMD code
_CHUNK = 1 << 22  # floats of the [.., T, L, D] products computed at once (queries in chunks)


def _invariant_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(q·kᵀ · scaling) @ v with every reduction in a fixed order, whatever the shapes.

    q [B, KV, G, T, D], keys/values [B, KV, L, D], keep [B, 1, 1, T, L] bool → [B, KV, G, T, D].

    BLAS's batched matmul and torch's softmax pick kernels and summation trees by L and by
    where the padding lies (measured: a row's scores change with 1, 3 or 17 extra masked
    columns). Here the dot products are inner sums over the fixed D; the softmax denominator
    and the weighted sum of values are *sequential* scans (`cumsum`, accumulated in float64 on
    CPU), read at the last column. A masked column adds an exact 0 (exp(−inf) = 0, 0 · v = 0 for
    the finite zeros a slab holds), so padding anywhere — left, between a cached prefix and
    its suffix, or the causal tail of a prefill chunk — leaves every sum's bits unchanged.
    """
    b, kv, g, t, d = q.shape
    n = keys.shape[2]
    step = max(1, _CHUNK // (b * kv * g * n * d))
    outs = []
    for t0 in range(0, t, step):  # queries are independent: chunking changes no number
        # causal: no query of this chunk sees past its last one's column (dropped columns would add exact 0s)
        end = n - t + min(t, t0 + step)
        k, v, m = keys[:, :, :end], values[:, :, :end], keep[..., t0 : t0 + step, :end]
        pad = -end % _LANES
        if pad:
            k, v, m = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(m, (0, pad))  # m: False, masked
        scores = (q[:, :, :, t0 : t0 + step, None, :] * k[:, :, None, None]).sum(-1) * scaling
        scores = scores.masked_fill(~m, float("-inf"))  # [B, KV, G, t, L]
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        probs = e / e.cumsum(-1)[..., -1:]  # Critical: a scan, not .sum(): its order is fixed
        outs.append((probs[..., None] * v[:, :, None, None]).cumsum(-2)[..., -1, :])
    return torch.cat(outs, dim=3)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float):
    """One query per row (T = 1): q [B, KV, G, 1, D], keys/values [B, KV, L, D], bias [B, 1, 1, 1, L] additive."""
    # Critical: query heads grouped per KV head (HF's head order: head = kv · G + g): the G queries of a
    # KV head are one fused attention over its cache, read in place
    out = F.scaled_dot_product_attention(q[:, :, :, 0], keys, values, attn_mask=bias[:, :, :, 0], scale=scaling)
    return out[:, :, :, None]  # [B, KV, G, 1, D]


# `F.scaled_dot_product_attention`'s CPU kernel, called directly for its log-sum-exp (`_cascade_attention`)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cascade_ok(device: torch.device) -> bool:
    """Whether `forward` can attend to a shared prefix block on `device` (`_cascade_attention`): the
    CPU, where the measured gain is (on other devices a batch keeps every column in its rows' slabs)."""
    return device.type == "cpu" and _FLASH_CPU is not None


def _cascade_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    shared_keys: torch.Tensor,
    shared_values: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention over a prefix every row shares plus each row's own columns: q [B, KV, G, T, D],
    keys/values [B, KV, L, D] (the rows' slabs), bias [B, 1, G·T or 1, L] additive, shared_keys/values
    [KV, P, D] (one copy for all rows) → [B, KV, G, T, D].

    The two halves are two fused attentions, each returning its log-sum-exp, joined exactly: the
    softmax over P + L columns is the two partial outputs weighted by their shares of the total mass,
    sigmoid(lse₁ − lse₂) and its complement. The shared columns are read once for the whole batch
    (every row's queries of a KV head in one product), not once per row — a decode step of 12 rows
    over a 290-token system prompt read ~190 MB of K/V a step before, ~40 MB after.
    """
    b, kv, g, t, d = q.shape
    together = q.permute(1, 0, 2, 3, 4).reshape(1, kv, b * g * t, d)
    shared, lse_shared = _FLASH_CPU(together, shared_keys[None], shared_values[None], scale=scaling)
    shared = shared.reshape(kv, b, g, t, d).transpose(0, 1)
    lse_shared = lse_shared.reshape(kv, b, g, t).transpose(0, 1)
    own, lse_own = _FLASH_CPU(q.reshape(b, kv, g * t, d), keys, values, attn_mask=bias, scale=scaling)
    weight = torch.sigmoid(lse_shared - lse_own.view(b, kv, g, t))[..., None]  # the shared columns' share
    return torch.lerp(own.reshape(b, kv, g, t, d), shared, weight)


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scaling: float):
    """T new queries per row (a prefill): q [B, KV, G, T, D], keys/values [B, KV, L, D], keep [B, 1, 1, T, L]
    bool (`_query_mask`) → [B, KV, G, T, D]. One fused attention over the G·T queries of each KV head: the
    cache is read in place, never repeated per query head."""
    b, kv, g, t, d = q.shape
    mask = keep.expand(b, 1, g, t, keep.shape[-1]).reshape(b, 1, g * t, -1)
    out = F.scaled_dot_product_attention(q.reshape(b, kv, g * t, d), keys, values, attn_mask=mask, scale=scaling)
    return out.view(b, kv, g, t, d)


def _query_mask(mask: torch.Tensor, t: int) -> torch.Tensor:
    """mask [B, L+T] (1 = real column; the last T columns are the new tokens) → keep [B, 1, 1, T, L+T].

    Query j (column L + j) sees the real columns up to its own, and always itself: a padding
    query of a prefill then attends to one finite column, never to none (NaN in its K/V)."""
    n = mask.shape[1]
    cols = torch.arange(n, device=mask.device)
    own = (n - t + torch.arange(t, device=mask.device))[:, None]  # [T, 1]
    keep = (mask.bool()[:, None, :] & (cols <= own)) | (cols == own)
    return keep[:, None, None]


def forward(
    model: Any,
    layers: list,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    invariant: bool = False,
    shared: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Forward T new tokens per row through `model`, appending their K/V to the slabs.

    ids [B, T], positions [B, T] (position ids), mask [B, L+T] (1 = real column, the last T
    columns are the new tokens), layers: one `SlabLayer` per decoder layer holding L columns
    → next-token logits [B, V] of the last column, in the model's dtype.

    `shared` (keys, values), per layer [KV, P, D]: P columns that precede every row's slab columns
    (a prefix all rows share, `decode_batch.SharedPrefix`), attended by `_cascade_attention` — read
    once for the batch; not with `invariant`, and on the CPU only (`cascade_ok`).

    `invariant`: each row's logits are bitwise independent of its batch-mates, of padding and
    of how its prompt was split into prefill chunks (matrix products through oneDNN's packed
    kernels, row-independent at any M; attention by `_invariant_attention`). Without it a decode
    step (T = 1) attends by two BLAS products (`_grouped_attention`) and a prefill (T > 1) by
    torch's fused attention under the causal mask (`_causal_attention`).
    """
    inner, cfg = model.model, model.config
    b, t = ids.shape
    h_q, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q
    groups = h_q // h_kv

    products = _products(model)  # LoRA (agl_lab.engines.lora): W + scale·B@A, merged once per update
    hidden = inner.embed_tokens(ids)  # [B, T, d_model]
    cos, sin = (c[:, :, None] for c in inner.rotary_emb(hidden, positions))  # [B, T, 1, D]
    hidden = hidden.reshape(b * t, -1)
    if invariant or t > 1:
        keep = _query_mask(mask, t)
    else:  # additive mask [B, 1, 1, 1, L+1] shared by every layer: 0 on real columns, -inf on padding
        keep = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device)
        keep = keep.masked_fill_(mask == 0, float("-inf"))[:, None, None, None, :]
    attention = _invariant_attention if invariant else _causal_attention if t > 1 else _grouped_attention
    if shared is not None:
        if invariant:
            raise ValueError("a shared prefix block is not batch-invariant: give every column to the rows' slabs")
        if t > 1:  # additive, the G query heads of a KV head side by side as in `_causal_attention`: once, not a layer
            bias = torch.zeros(keep.shape, dtype=hidden.dtype, device=hidden.device).masked_fill_(~keep, float("-inf"))
            bias = bias.expand(b, 1, groups, t, keep.shape[-1]).reshape(b, 1, groups * t, -1)
        else:
            bias = keep[:, :, :, 0]  # [B, 1, 1, L+1]: the same for the G queries

    for i, (layer, slab, prepared) in enumerate(zip(inner.layers, layers, products.layers)):
        qkv_w, qkv_b, o_w, o_b, gate_up_w, down_w = prepared
        attn = layer.self_attn
        x = _rms_norm(layer.input_layernorm, hidden)
        qkv = products(x, qkv_w, qkv_b).view(b, t, h_q + 2 * h_kv, d)
        qk = _rope(qkv[:, :, : h_q + h_kv], cos, sin)  # one RoPE for the query and key heads
        q, k, v = qk[:, :, :h_q], qk[:, :, h_q:], qkv[:, :, h_q + h_kv :]
        keys, values = slab.update(k.transpose(1, 2), v.transpose(1, 2))  # [B, KV, L+T, D] views
        q = q.reshape(b, t, h_kv, groups, d).permute(0, 2, 3, 1, 4)  # [B, KV, G, T, D]
        if shared is None:
            out = attention(q, keys, values, keep, attn.scaling)
        else:
            out = _cascade_attention(q, keys, values, bias, shared[0][i], shared[1][i], attn.scaling)
        out = out.permute(0, 3, 1, 2, 4).reshape(b * t, h_q * d)
        hidden = hidden + products(out, o_w, o_b)

        x = _rms_norm(layer.post_attention_layernorm, hidden)
        gate, up = products(x, gate_up_w).chunk(2, dim=-1)  # [B·T, 2·I]: gate then up
        hidden = hidden + products(F.silu(gate) * up, down_w)

    last = hidden.view(b, t, -1)[:, -1]
    return products(_rms_norm(inner.norm, last), products.head)


def decode_step(
    model: Any,
    layers: list,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    invariant: bool = False,
    shared: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """One pending token per row: tokens [B], positions [B], mask [B, L+1] → logits [B, V] (`forward`)."""
    return forward(model, layers, tokens[:, None], positions[:, None], mask, invariant, shared)
