"""agl_lab.engines.shared_prefix: the shared prompt forwarded once gives the padded path's numbers.

A real tiny Qwen2 (tests/hand_built.tiny_qwen2) and a batch laid out as the batch builder
lays it out (left-padded prompts, right-padded responses): 8 rows that start with the same 20
tokens, then 1–5 tokens of their own, then responses of 2–8 tokens. Both paths run on the same
batch and weights (`use_prefix_grouper` off and on): logprobs to 1e-5, gradients to 1e-5 of their
max, the loss to 1e-6 relative — full model and LoRA.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from verl import DataProto

from agl_lab.engines import shared_prefix
from agl_lab.engines.grouped_attention import use_grouped_attention
from agl_lab.engines.local_ppo import ActorUpdateConfig, _response_forward, ppo_update
from agl_lab.engines.lora import LoraSpec, add_lora
from agl_lab.engines.shared_prefix import (
    ForwardCost,
    PrefixPlan,
    SharedPrefix,
    common_prefix,
    micro_batches,
    padded_body_tokens,
    plan_prefixes,
    planned_body_tokens,
)
from tests.hand_built import tiny_qwen2

N, P, R, SHARED, T = 8, 26, 8, 20, 0.7
TAILS = [1, 3, 5, 2, 4, 1, 5, 3]  # prompt tokens after the shared ones
RESPONSES = [8, 5, 2, 7, 6, 8, 3, 4]


def shared_batch() -> DataProto:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 300, (SHARED,), generator=g)
    prompts, pmask = torch.zeros(N, P, dtype=torch.long), torch.zeros(N, P, dtype=torch.long)
    for i, tail in enumerate(TAILS):
        row = torch.cat([shared, torch.randint(3, 300, (tail,), generator=g)])
        prompts[i, P - len(row) :], pmask[i, P - len(row) :] = row, 1
    responses, rmask = torch.randint(3, 300, (N, R), generator=g), torch.zeros(N, R, dtype=torch.long)
    for i, length in enumerate(RESPONSES):
        rmask[i, :length] = 1
    responses[rmask == 0] = 0
    attention = torch.cat([pmask, rmask], 1)
    loss_mask = rmask.float()
    loss_mask[0, 2] = 0.0  # an observation token: attended, not trained
    adv = torch.randn(N, 1, generator=g).expand(N, R) * loss_mask / 10
    tensors = {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
        "responses": responses,
        "response_mask": loss_mask,
        "advantages": adv.contiguous(),
        "old_log_probs": -5.0 + 0.5 * torch.randn(N, R, generator=g),  # ratios off 1: clipping too
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": T})


def lora_model() -> torch.nn.Module:
    model = tiny_qwen2()
    add_lora(model, LoraSpec(rank=4, alpha=8))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # B = 0 at init would leave A without gradient
    return model


def test_common_prefix_finds_the_shared_tokens_and_refuses_other_layouts():
    b = shared_batch().batch
    ids, mask, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    # the shortest prompt is SHARED + 1 tokens: P stops one before it
    assert common_prefix(ids, mask, pos, R) == SHARED
    assert common_prefix(ids[[0, 5]], mask[[0, 5]], pos[[0, 5]], R) == SHARED  # both have one tail token
    other = ids.clone()
    other[3, P - SHARED - TAILS[3] + 4] += 1  # row 3 differs at its 5th token
    assert common_prefix(other, mask, pos, R) == 4
    holed = mask.clone()
    holed[1, P + 1] = 0  # a hole inside a row: not covered
    assert common_prefix(ids, holed, pos, R) == 0
    assert padded_body_tokens(mask, R) == N * (SHARED + 5 + 8)


@pytest.mark.parametrize("lora", [False, True])
def test_logprobs_match_the_padded_path(lora):
    model = (lora_model() if lora else tiny_qwen2()).eval()
    b = shared_batch().batch
    with torch.no_grad():
        padded, ent_p = _response_forward(
            model, b["input_ids"], b["attention_mask"], b["position_ids"], R, T, "detached"
        )
        start = int(b["attention_mask"][0].argmax())
        prefix = SharedPrefix(model, b["input_ids"][0, start : start + SHARED])
        shared, ent_s = prefix.response_forward(b["input_ids"], b["attention_mask"], R, T, "detached")
    assert shared.shape == padded.shape == (N, R)
    on = b["attention_mask"][:, P:].bool()
    assert (padded[on] < 0).all() and (shared[~on] == 0).all()
    assert (shared - padded).abs().max() < 1e-5 and (ent_s - ent_p).abs().max() < 1e-5
    # the suffix: each row's tail + response, padded to the longest (10 tokens)
    assert prefix.body_tokens == SHARED + N * max(t + r for t, r in zip(TAILS, RESPONSES))


@pytest.mark.parametrize("temperature", [T, 1.0])
def test_picking_hidden_states_before_the_head_scores_as_the_full_forward(monkeypatch, temperature):
    """The suffix's response positions picked H wide before the LM head (`_head_apart`, Qwen2 here)
    give the logprobs, entropy and gradients of HF's forward with the V-wide logits picked after
    it (the path of models outside `_PLAIN_HEAD`); at temperature 1 the logits go undivided."""
    model = lora_model()
    b = shared_batch().batch
    start = int(b["attention_mask"][0].argmax())
    results = []
    for plain in (shared_prefix._PLAIN_HEAD, frozenset()):
        monkeypatch.setattr(shared_prefix, "_PLAIN_HEAD", plain)
        model.zero_grad()
        prefix = SharedPrefix(model, b["input_ids"][0, start : start + SHARED])
        logp, ent = prefix.response_forward(b["input_ids"], b["attention_mask"], R, temperature, "grad")
        (logp.sum() + ent.sum()).backward()
        prefix.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((shared_prefix._head_apart(model), logp.detach(), ent.detach(), grads))
    (apart, logp_a, ent_a, grads_a), (whole, logp_w, ent_w, grads_w) = results
    assert apart and not whole
    assert (logp_a - logp_w).abs().max() < 1e-5 and (ent_a - ent_w).abs().max() < 1e-5
    assert grads_a.keys() == grads_w.keys() and len(grads_a) > 0
    for name, g in grads_a.items():
        assert (g - grads_w[name]).abs().max() <= 1e-5 * max(g.abs().max(), 1e-6), name


@pytest.mark.parametrize("lora,entropy_coeff", [(False, 0.0), (False, 0.01), (True, 0.0)])
def test_update_gradients_and_loss_match_the_padded_path(lora, entropy_coeff):
    data = shared_batch()
    base = lora_model() if lora else tiny_qwen2()
    runs = {}
    for on in (False, True):
        model = copy.deepcopy(base)
        cfg = ActorUpdateConfig(
            ppo_mini_batch_size=N,
            ppo_micro_batch_size_per_gpu=3,
            grad_clip=None,
            entropy_coeff=entropy_coeff,
            use_prefix_grouper=on,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        metrics = ppo_update(model, torch.optim.SGD(params, lr=0.0), data, cfg)  # lr 0: grads kept, weights not moved
        runs[on] = (torch.cat([p.grad.flatten() for p in params]), metrics)
    (g_pad, m_pad), (g_sh, m_sh) = runs[False], runs[True]
    assert g_pad.abs().max() > 0
    assert (g_sh - g_pad).abs().max() <= 1e-5 * g_pad.abs().max()
    assert m_sh["actor/pg_loss"] == pytest.approx(m_pad["actor/pg_loss"], rel=1e-6)
    assert m_sh["actor/entropy"] == pytest.approx(m_pad["actor/entropy"], rel=1e-5)
    assert m_sh["actor/shared_prefix_tokens"] == SHARED and m_sh["actor/shared_prefix_fallbacks"] == 0
    # 3 micro-batches of 3, 3, 2 rows: the padded path sends every row's prompt through the body
    assert m_sh["actor/body_tokens"] < m_pad["actor/body_tokens"]
    assert m_pad["actor/body_tokens"] == sum(
        padded_body_tokens(data.batch["attention_mask"][s : s + 3], R) for s in (0, 3, 6)
    )


def test_a_short_prefix_falls_back_to_the_padded_path():
    data = shared_batch()
    data.batch["input_ids"][1, P - SHARED - TAILS[1] + 2] += 1  # row 1 differs at token 3
    model = tiny_qwen2()
    cfg = ActorUpdateConfig(ppo_mini_batch_size=N, use_prefix_grouper=True)
    metrics = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), data, cfg)
    assert metrics["actor/shared_prefix_fallbacks"] == 1 and metrics["actor/shared_prefix_tokens"] == 0
    assert np.isfinite(metrics["actor/pg_loss"])


def grouped_batch(header: int = 3, own: int = 17) -> DataProto:
    """Two GRPO groups of 4 rows: a `header`-token start common to all, then each group's own
    `own` tokens (a reasoning-gym question, say) — the prompt identical within a group."""
    g = torch.Generator().manual_seed(11)
    head = torch.randint(3, 300, (header,), generator=g)
    width = header + own
    prompts = torch.stack(
        [torch.cat([head, q]) for q in torch.randint(3, 300, (2, own), generator=g) for _ in range(4)]
    )
    responses, rmask = torch.randint(3, 300, (N, R), generator=g), torch.zeros(N, R, dtype=torch.long)
    for i, length in enumerate(RESPONSES):
        rmask[i, :length] = 1
    responses[rmask == 0] = 0
    attention = torch.cat([torch.ones(N, width, dtype=torch.long), rmask], 1)
    tensors = {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
        "responses": responses,
        "response_mask": rmask.float(),
        "advantages": (torch.randn(N, 1, generator=g).expand(N, R) * rmask / 10).contiguous(),
        "old_log_probs": -5.0 + 0.5 * torch.randn(N, R, generator=g),
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": T})


def padded_and_shared(data: DataProto, micro_rows: int):
    """((gradient, metrics) with `use_prefix_grouper` off, the same on) of one update of a fresh tiny
    Qwen2 on `data` (SGD at lr 0: the gradients kept, the weights not moved)."""
    runs = {}
    for on in (False, True):
        model = tiny_qwen2()
        cfg = ActorUpdateConfig(
            ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=micro_rows, grad_clip=None, use_prefix_grouper=on
        )
        metrics = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), data, cfg)
        runs[on] = (torch.cat([p.grad.flatten() for p in model.parameters()]), metrics)
    return runs[False], runs[True]


def test_groups_that_differ_early_share_their_own_prompt_per_group():
    data = grouped_batch()
    (g_pad, m_pad), (g_sh, m_sh) = padded_and_shared(data, micro_rows=2)
    # the 3-token header alone is under MIN_SHARED; each group's 20-token prompt (to one before its end)
    assert m_sh["actor/shared_prefixes"] == 2 and m_sh["actor/shared_prefix_fallbacks"] == 0
    assert m_sh["actor/shared_prefix_tokens"] == 19
    assert m_sh["actor/body_tokens"] == 2 * 19 + sum(
        2 * (1 + max(RESPONSES[s : s + 2])) for s in range(0, N, 2)
    )  # each prefix once, then each micro-batch's last prompt token + responses
    assert m_sh["actor/body_tokens"] < m_pad["actor/body_tokens"] / 2
    assert (g_sh - g_pad).abs().max() <= 1e-5 * g_pad.abs().max()
    assert m_sh["actor/pg_loss"] == pytest.approx(m_pad["actor/pg_loss"], rel=1e-6)
    assert m_sh["actor/rows_by_length"] == 0  # by length the groups would mix: each prefix only the header


def test_rows_of_like_length_share_a_micro_batch_when_that_pads_less():
    """One shared prompt, suffixes (own prompt tokens + response) of 9, 8, 7, 9, 10, 9, 8, 7 tokens,
    micro-batches of 2: in the batch's order the widest of each pair costs 9 + 9 + 10 + 8, by length
    7 + 8 + 9 + 10 — 2 × 34 + the prefix's 20 = 88 tokens, not 92. The update takes the length
    order, and its gradients and loss are still the padded path's."""
    data = shared_batch()
    suffix = [t + r for t, r in zip(TAILS, RESPONSES)]
    (g_pad, m_pad), (g_sh, m_sh) = padded_and_shared(data, micro_rows=2)
    batch_order = SHARED + 2 * sum(max(suffix[s : s + 2]) for s in range(0, N, 2))
    by_length = SHARED + 2 * sum(sorted(suffix)[s + 1] for s in range(0, N, 2))
    assert (batch_order, by_length) == (92, 88)
    assert m_sh["actor/rows_by_length"] == 1 and m_sh["actor/body_tokens"] == by_length
    assert (g_sh - g_pad).abs().max() <= 1e-5 * g_pad.abs().max()
    assert m_sh["actor/pg_loss"] == pytest.approx(m_pad["actor/pg_loss"], rel=1e-6)


def test_the_grouped_attention_gives_the_update_s_gradient_and_loss(monkeypatch):
    """The update's suffix forward over a prefix cache (a mask over P + S keys) both ways; the grouped
    model folds there (every masked SDPA call sees 2 KV heads; the prefix's own causal forward has no
    mask and runs as HF runs it)."""
    folded = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        if kw.get("attn_mask") is not None:
            folded.append(q.shape[1] == k.shape[1] == 2 and k.shape[2] > q.shape[2] // 2)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    data = shared_batch()
    cfg = ActorUpdateConfig(
        ppo_mini_batch_size=N, ppo_micro_batch_size_per_gpu=3, grad_clip=None, use_prefix_grouper=True
    )
    runs = {}
    hf = tiny_qwen2()
    grouped = copy.deepcopy(hf)
    assert use_grouped_attention(grouped)
    for name, model in (("hf", hf), ("grouped", grouped)):
        folded.clear()
        metrics = ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), data, cfg)
        runs[name] = (torch.cat([p.grad.flatten() for p in model.parameters()]), metrics["actor/pg_loss"])
    (g_hf, loss_hf), (g_gr, loss_gr) = runs["hf"], runs["grouped"]
    assert g_hf.abs().max() > 0
    assert (g_gr - g_hf).abs().max() <= 1e-5 * g_hf.abs().max()
    assert abs(loss_gr - loss_hf) <= 1e-6 * abs(loss_hf)
    assert folded and all(folded)  # 2 layers × 3 micro-batches, each folded


def test_token_logprobs_give_verl_s_numbers_with_one_backward_pass():
    """`score_responses`' log-probabilities (`_TokenLogprobs`) against verl's `logprobs_from_logits`
    with autograd's gradient, and the detached entropy from their log-sum-exp against verl's
    `entropy_from_logits`; the hand-written backward against finite differences (float64)."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(3, 5, 400, generator=g)).requires_grad_()
    labels = torch.randint(0, 400, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    ours, lse = shared_prefix._TokenLogprobs.apply(logits, labels)
    (ours * weights).sum().backward()
    grad_ours, logits.grad = logits.grad.clone(), None
    theirs = logprobs_from_logits(logits, labels)
    (theirs * weights).sum().backward()
    assert (ours - theirs).abs().max() < 1e-6
    assert (grad_ours - logits.grad).abs().max() < 1e-6
    entropy = shared_prefix._entropy_given_lse(logits.detach(), lse)
    assert (entropy - entropy_from_logits(logits.detach())).abs().max() <= 1e-5 * entropy.abs().max()
    small = torch.randn(2, 3, 7, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: shared_prefix._TokenLogprobs.apply(x, torch.tensor([[0, 6, 3], [2, 2, 5]]))[0], (small,)
    )


def test_micro_batches_forward_each_cluster_prefix_once():
    """The generator behind the PPO step: the micro-batches in order, one `SharedPrefix` per cluster
    (the same object for its micro-batches), back-propagated once after the cluster's last backward —
    so the gradient of Σ logp is the padded path's; the padded plan has no prefix at all."""
    b = grouped_batch().batch
    mb = {k: b[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    starts = [0, 2, 4, 6]
    plan = plan_prefixes(mb, starts, 2)
    assert (plan.clusters, plan.lengths, plan.shared, plan.fallbacks) == ([[0, 2], [4, 6]], [19, 19], 2, 0)
    model, padded = tiny_qwen2(), tiny_qwen2()
    seen, cost = [], ForwardCost()
    for micro, prefix in micro_batches(model, mb, plan, 2, cost):
        logp, _ = prefix.response_forward(micro["input_ids"], micro["attention_mask"], R, T, "none")
        logp.sum().backward()
        seen.append((micro["input_ids"], prefix))
    assert all(torch.equal(ids, mb["input_ids"][s : s + 2]) for (ids, _), s in zip(seen, starts))
    prefixes = [prefix for _, prefix in seen]
    assert prefixes[0] is prefixes[1] and prefixes[2] is prefixes[3] and prefixes[1] is not prefixes[2]
    assert cost.prefixed_tokens == N * 19
    assert cost.body_tokens == 2 * 19 + sum(2 * (1 + max(RESPONSES[s : s + 2])) for s in starts)
    assert planned_body_tokens(mb, plan, 2) == cost.body_tokens  # what `_forward_plan` compares orders by
    logp, _ = _response_forward(padded, b["input_ids"], b["attention_mask"], b["position_ids"], R, T, "none")
    logp.sum().backward()
    g_sh = torch.cat([p.grad.flatten() for p in model.parameters()])
    g_pad = torch.cat([p.grad.flatten() for p in padded.parameters()])
    assert (g_sh - g_pad).abs().max() <= 1e-5 * g_pad.abs().max()  # a prefix skipped or doubled: far off

    cost = ForwardCost()
    assert [prefix for _, prefix in micro_batches(model, mb, PrefixPlan.padded(starts), 2, cost)] == [None] * 4
    assert cost.prefixed_tokens == 0
    assert cost.body_tokens == sum(padded_body_tokens(mb["attention_mask"][s : s + 2], R) for s in starts)
    assert planned_body_tokens(mb, PrefixPlan.padded(starts), 2) == cost.body_tokens
