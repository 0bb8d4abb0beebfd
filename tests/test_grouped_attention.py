"""agl_lab.engines.grouped_attention: the query heads folded over their KV head give HF's sdpa numbers.

A real tiny Qwen2 (tests/hand_built.tiny_qwen2: 4 query heads over 2 KV heads) run both ways on the
same weights — HF's `sdpa` (K/V copied per query head) and `GROUPED_SDPA` — over left-padded rows (a
mask: the folded path) and without a mask, and which models are switched. The shared-prefix update
both ways: tests/test_shared_prefix.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from agl_lab.engines import grouped_attention
from agl_lab.engines.grouped_attention import GROUPED_SDPA, use_grouped_attention
from tests.hand_built import tiny_qwen2


def both():
    """(HF's sdpa model, the same weights on the grouped attention)."""
    hf = tiny_qwen2()
    grouped = copy.deepcopy(hf)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    assert hf.config._attn_implementation == "sdpa"
    return hf, grouped


def padded_rows():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 300, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4], mask[1, :2] = 0, 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))


def test_padded_rows_fold_the_query_heads_and_give_hf_s_logits_and_gradients(monkeypatch):
    hf, grouped = both()
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(grouped_attention.F, "scaled_dot_product_attention", spy)
    out = {}
    for name, model in (("hf", hf), ("grouped", grouped)):
        seen.clear()
        logits = model(**padded_rows()).logits
        (logits * torch.linspace(-1, 1, 300)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (logits.detach(), grads, list(seen))
    (hf_logits, hf_grads, hf_calls), (g_logits, g_grads, g_calls) = out["hf"], out["grouped"]
    # HF copies K/V to the 4 query heads; the grouped one hands SDPA 2 KV heads and 2 × 12 query rows
    assert hf_calls == [((3, 4, 12, 16), (3, 4, 12, 16))] * 2
    assert g_calls == [((3, 2, 24, 16), (3, 2, 12, 16))] * 2
    assert torch.equal(g_logits, hf_logits) or (g_logits - hf_logits).abs().max() < 1e-6
    assert hf_grads.keys() == g_grads.keys() and len(hf_grads) > 0
    for name, g in hf_grads.items():
        assert (g_grads[name] - g).abs().max() <= 1e-5 * max(g.abs().max(), 1e-6), name


def test_without_a_mask_hf_s_causal_kernel_runs_unchanged():
    hf, grouped = both()
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(4))
    assert torch.equal(grouped(input_ids=ids).logits, hf(input_ids=ids).logits)  # the same call: bit for bit


def test_only_an_sdpa_gqa_model_on_the_cpu_is_switched():
    eager = tiny_qwen2()
    eager.set_attn_implementation("eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"
    mha = tiny_qwen2()
    mha.config.num_key_value_heads = mha.config.num_attention_heads  # no groups: nothing to fold
    assert not use_grouped_attention(mha) and mha.config._attn_implementation == "sdpa"
