"""The shared prompt computed once: the token prefix a mini-batch's rows share, forwarded and
back-propagated one time for all of them (`actor_rollout_ref.actor.use_prefix_grouper` on the local
engine) — for the whole mini-batch when its rows share a long system prompt, per GRPO group when
the tasks differ early (`plan_prefixes`).

The rows of a GRPO mini-batch repeat the same prompt (system text, tool list, worked examples:
303 of ~315 prompt tokens in every calc row). The padded path forwards and back-propagates it
once per row. Here:

    P = common_prefix(rows)                  longest token prefix every row starts with
    prefix forward [1, P], use_cache=True    → per layer K, V [1, kv_heads, P, head_dim] (with grad)
    K, V detached into leaves                (their gradients accumulate over the micro-batches)
    for micro-batch:                         suffix [n, S] = each row's tokens after P, right-padded,
        forward(suffix, past=K,V expanded)   positions P.., mask [n, P + S]; loss.backward()
        (rows' response positions differ)    hidden [n, S, H] → the R' response positions of each
                                             row picked [n, R', H] → LM head [n, R', V] (`_head_apart`)
    prefix backward once                     autograd.backward(K, V ← the leaves' summed gradients)

`micro_batches` runs that lifecycle for the PPO step (`local_ppo.ppo_step`), one prefix per
cluster of micro-batches (`plan_prefixes`), and counts the tokens through the body (`ForwardCost`).

In a decoder-only model a later token sees an earlier one only through its keys and values,
so the suffix's logits are those of the padded path, and the gradient that reaches the prefix is
the sum over rows — the same gradient, in another summation order (fp32 rounding;
tests/test_shared_prefix.py checks logprobs to 1e-5, gradients to 1e-5 of their max, the loss to
1e-6 relative, full model and LoRA). P stops one token before the shortest prompt, so every
response logit comes from the suffix. A row layout this does not cover (attended tokens not one
contiguous run, position ids not 0, 1, 2, … over them) or a prefix under `MIN_SHARED` tokens
falls back to the padded path (metric `actor/shared_prefix_fallbacks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from verl.utils.torch_functional import entropy_from_logits

from agl_lab.engines import precision

MIN_SHARED = 8  # tokens: below this the prefix forward saves less than its own overhead


def kept_response_width(attention_mask: torch.Tensor, response_length: int) -> int:
    """R' ≤ R: the response columns of [n, prompt + R] rows up to the last one some row attends
    to (at least 1). Only these reach the vocabulary-sized ops: [n, R', V] is an update's largest
    tensor."""
    seen = attention_mask[:, attention_mask.shape[1] - response_length :].bool().any(0).nonzero()
    return int(seen[-1]) + 1 if seen.numel() else 1


def score_responses(
    logits: torch.Tensor, responses: torch.Tensor, attended: torch.Tensor, response_length: int, entropy: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [n, R', V] (already divided by the temperature) scoring responses [n, R'] →
    (logprobs [n, R], entropy [n, R] | None), zero where `attended` [n, R'] is 0 and past R';
    entropy: none | grad (verl's `entropy_from_logits`, differentiable) | detached (from the
    logprobs' own log-sum-exp, `_entropy_given_lse`). Both forward paths (padded and shared-prefix)
    end here."""
    attended = attended.to(logits.device, logits.dtype)
    widen = lambda t: F.pad(t * attended, (0, response_length - t.shape[1]))  # noqa: E731  [n, R'] → [n, R]
    logprobs, lse = _TokenLogprobs.apply(logits, responses.to(logits.device))
    if entropy == "none":
        return widen(logprobs), None
    if entropy == "grad":
        return widen(logprobs), widen(entropy_from_logits(logits))
    return widen(logprobs), widen(_entropy_given_lse(logits.detach(), lse.detach()))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[label] = logits[label] − logsumexp(logits), and that log-sum-exp:
    logits [..., V] float, labels [...] → (logprobs [...], lse [...]; lse without gradient).

    The numbers of verl's `logprobs_from_logits` on the CPU (`logprobs_from_logits_v2`: a gather
    minus a log-sum-exp), with one V-wide pass backward where autograd makes four: the gradient
    −g·softmax + g at the label, written into one tensor — autograd zero-fills a V-wide tensor for
    the gather's gradient, scatters into it, and adds the log-sum-exp's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(logits, -1)
        logprobs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(lse)
        return logprobs, lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _lse_grad: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        out = torch.sub(logits, lse.unsqueeze(-1)).exp_()  # softmax [..., V]
        out.mul_(-grad.unsqueeze(-1))
        out.scatter_add_(-1, labels.unsqueeze(-1), grad.unsqueeze(-1))
        return out, None


def _entropy_given_lse(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = lse − Σ softmax · logits, [..., V] and [...] → [...], reusing the logprobs' log-sum-exp
    (verl's `entropy_from_logits` computes its own and a softmax: the same value to ~1e-5 relative,
    float32 sums over V in another order)."""
    probs = torch.sub(logits, lse.unsqueeze(-1)).exp_()
    return lse - torch.linalg.vecdot(probs, logits)


def at_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; at 1.0 the logits themselves (the same numbers: no [n, R', V] division
    forward and backward)."""
    return logits if temperature == 1.0 else logits / temperature


# Causal LMs whose forward is exactly lm_head(self.model(...).last_hidden_state[:, -k:]): no logit
# soft-capping or scaling after the head (Gemma 2, Granite, … keep HF's forward). By class, as
# `fast_decode._SUPPORTED`: the class is what names the forward.
_PLAIN_HEAD = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def _head_apart(model: torch.nn.Module) -> bool:
    """Whether the suffix's response positions can be picked from the hidden states before the LM
    head: [n, R', H] gathered instead of [n, R', V] logits, the head over R' positions only."""
    return type(model).__name__ in _PLAIN_HEAD


def _runs(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(start [n], length [n]) of each row's attended tokens, or None when a row's attended
    tokens are not one contiguous run with positions 0, 1, 2, …"""
    mask = attention_mask.bool()
    length = mask.sum(-1)
    if bool((length == 0).any()):
        return None
    start = mask.long().argmax(-1)
    cols = torch.arange(mask.shape[1]).unsqueeze(0)
    inside = (cols >= start.unsqueeze(1)) & (cols < (start + length).unsqueeze(1))
    if not torch.equal(inside, mask):
        return None
    expected = (cols - start.unsqueeze(1)).clamp(min=0)
    if not torch.equal(position_ids.long()[mask], expected[mask]):
        return None
    return start, length


def common_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, response_length: int
) -> int:
    """P: the longest token prefix shared by the attended sequence of every row of [n, L] (the
    response in the last R columns), at most the shortest prompt − 1; 0 when the layout is not
    covered (`_runs`)."""
    runs = _runs(attention_mask, position_ids)
    if runs is None:
        return 0
    start, _ = runs
    prompt = attention_mask[:, : input_ids.shape[1] - response_length].sum(-1)
    m = int(prompt.min()) - 1
    if m <= 0:
        return 0
    cols = start.unsqueeze(1) + torch.arange(m).unsqueeze(0)  # [n, m]
    heads = input_ids.gather(1, cols)
    same = (heads == heads[:1]).all(0)
    return m if bool(same.all()) else int((~same).nonzero()[0])


class SharedPrefix:
    """One mini-batch's prefix, forwarded once (`__init__`), its K/V reused by every micro-batch
    (`response_forward`), back-propagated once (`backward`). `body_tokens` counts the tokens
    through the transformer body (prefix once + every suffix cell, padding included)."""

    def __init__(self, model: torch.nn.Module, prefix_ids: torch.Tensor):
        """`prefix_ids` [P]: forwarded as [1, P] with the cache on, under the caller's grad mode."""
        device = next(model.parameters()).device
        self.model, self.length = model, int(prefix_ids.shape[0])
        with precision.autocast(model):  # as local_ppo._response_forward
            out = model(input_ids=prefix_ids.view(1, -1).to(device), use_cache=True, logits_to_keep=1)
        self._kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        self._leaves = [t.detach().requires_grad_(t.requires_grad) for t in self._kv]
        self.body_tokens = self.length

    def _cache(self, n: int) -> DynamicCache:
        pairs = [
            (self._leaves[i].expand(n, -1, -1, -1), self._leaves[i + 1].expand(n, -1, -1, -1))
            for i in range(0, len(self._leaves), 2)
        ]
        return DynamicCache(ddp_cache_data=pairs)

    def response_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        temperature: float,
        entropy: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [n, L] (prompt then R response columns; every row starts with the prefix) →
        (logprobs [n, R], entropy [n, R] | None) as `local_ppo._response_forward` returns them."""
        device = self._leaves[0].device
        n, width = input_ids.shape
        prompt_width = width - response_length
        mask = attention_mask.bool()
        start, length = mask.long().argmax(-1), mask.sum(-1)
        prompt_len = mask[:, :prompt_width].sum(-1)
        p = self.length
        s_len = length - p  # suffix tokens per row (≥ 2: P < shortest prompt)
        width_s = int(s_len.max())
        cols = torch.arange(width_s).unsqueeze(0)
        src = (start + p).unsqueeze(1) + cols  # [n, S] columns of the suffix in the padded row
        valid = cols < s_len.unsqueeze(1)
        suffix = torch.where(valid, input_ids.gather(1, src.clamp(max=width - 1)), 0)
        full_mask = torch.cat([torch.ones(n, p, dtype=torch.long), valid.long()], 1)
        positions = (p + cols).expand(n, -1)
        # response token j of row i sits at suffix index prompt_len_i − P + j; its logit at one before
        first = int(prompt_len.min()) - p - 1
        kept = kept_response_width(attention_mask, response_length)
        j = torch.arange(kept).unsqueeze(0)
        at = (prompt_len - p - 1 - first).unsqueeze(1) + j  # [n, R'] into the last width_s − first positions
        inputs = dict(
            input_ids=suffix.to(device),
            attention_mask=full_mask.to(device),
            position_ids=positions.to(device),
            past_key_values=self._cache(n),
            use_cache=True,
        )

        def pick(t: torch.Tensor) -> torch.Tensor:  # each row's R' positions: [n, width_s − first, D] → [n, R', D]
            index = at.clamp(max=t.shape[1] - 1).to(device).unsqueeze(-1)
            return t.gather(1, index.expand(-1, -1, t.shape[-1]))

        with precision.autocast(self.model):
            if _head_apart(self.model):  # pick the R' hidden states, then the head: H wide, not V
                logits = self.model.lm_head(pick(self.model.model(**inputs).last_hidden_state[:, first:])).float()
            else:
                logits = pick(self.model(**inputs, logits_to_keep=width_s - first).logits.float())
        self.body_tokens += n * width_s
        cols = slice(prompt_width, prompt_width + kept)
        return score_responses(
            at_temperature(logits, temperature), input_ids[:, cols], attention_mask[:, cols], response_length, entropy
        )

    def backward(self) -> None:
        """Push the gradients the micro-batches left on the K/V leaves through the prefix, once."""
        pairs = [(kv, leaf.grad) for kv, leaf in zip(self._kv, self._leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([kv for kv, _ in pairs], grad_tensors=[g for _, g in pairs])


@dataclass
class PrefixPlan:
    """Which forwarded micro-batches share which prefix: `clusters` of consecutive micro-batch starts,
    each with the prefix length its rows share (`lengths`; 0: the padded path), and where it begins
    in the first row of the cluster (`begins`). `micro_batches` builds one `SharedPrefix` per cluster,
    when its first micro-batch comes up."""

    clusters: list[list[int]]
    lengths: list[int]
    begins: list[int]

    @classmethod
    def padded(cls, starts: list[int]) -> PrefixPlan:
        """Every micro-batch on the padded path (`use_prefix_grouper` off): one cluster, no prefix."""
        return cls([list(starts)], [0], [0])

    @property
    def shared(self) -> int:
        """Clusters whose rows get their prefix from one `SharedPrefix`."""
        return sum(1 for length in self.lengths if length >= MIN_SHARED)

    @property
    def fallbacks(self) -> int:
        return sum(1 for length in self.lengths if length < MIN_SHARED)


def plan_prefixes(mb: dict[str, torch.Tensor], starts: list[int], micro_rows: int) -> PrefixPlan:
    """Group the forwarded micro-batches (`starts`) of a mini-batch `mb` by the prompt prefix they share.

    Left to right, a micro-batch joins the current cluster when that costs fewer tokens through the
    body: a cluster of rows i with prefix L costs L + Σ (attended_i − L). So a GRPO mini-batch whose
    rows share one long system prompt forms one cluster (calc: 303 shared tokens, ~12 per task),
    and one whose tasks differ early (a reasoning-gym question after a short header) forms one
    cluster per group, each sharing its whole prompt."""
    n, response_length = mb["input_ids"].shape[0], mb["responses"].shape[-1]
    ids, mask, pos = mb["input_ids"], mb["attention_mask"], mb["position_ids"]
    rows_of = {s: torch.arange(s, min(s + micro_rows, n)) for s in starts}
    attended = mask.sum(-1)

    def prefix_len(idx: torch.Tensor) -> int:
        return common_prefix(ids[idx], mask[idx], pos[idx], response_length)

    def cost(idx: torch.Tensor, length: int) -> int:
        length = length if length >= MIN_SHARED else 0  # under MIN_SHARED: the padded path
        return length + int((attended[idx] - length).sum())

    clusters: list[list[int]] = []
    lengths: list[int] = []
    for s in starts:
        own = prefix_len(rows_of[s])
        if clusters:
            idx = torch.cat([rows_of[t] for t in clusters[-1]] + [rows_of[s]])
            joined = prefix_len(idx)
            before = torch.cat([rows_of[t] for t in clusters[-1]])
            if cost(idx, joined) < cost(before, lengths[-1]) + cost(rows_of[s], own):
                clusters[-1].append(s)
                lengths[-1] = joined
                continue
        clusters.append([s])
        lengths.append(own)
    begins = [int(mask[c[0]].long().argmax()) for c in clusters]
    return PrefixPlan(clusters, lengths, begins)


@dataclass
class ForwardCost:
    """What one mini-batch's forwards cost: `body_tokens` through the transformer body (each shared
    prefix once, then every micro-batch's cells, padding included) and `prefixed_tokens`, the prompt
    tokens the forwarded rows took from their cluster's prefix instead (summed over rows)."""

    body_tokens: int = 0
    prefixed_tokens: int = 0


def micro_batches(
    model: torch.nn.Module, mb: dict[str, torch.Tensor], plan: PrefixPlan, micro_rows: int, cost: ForwardCost
) -> Iterator[tuple[dict[str, torch.Tensor], SharedPrefix | None]]:
    """The forwarded micro-batches of a mini-batch `mb`, cluster by cluster, each with the prefix its
    rows share (None: the padded path); `cost` counts the tokens through the body.

    A cluster's `SharedPrefix` is forwarded before its first micro-batch is yielded and
    back-propagated once after its last: the caller runs each micro-batch's `loss.backward()`
    before it asks for the next one (the gradients the suffixes leave on K/V are then complete)."""
    for cluster, length, begin in zip(plan.clusters, plan.lengths, plan.begins):
        prefix = None
        if length >= MIN_SHARED:
            prefix = SharedPrefix(model, mb["input_ids"][cluster[0], begin : begin + length])
        for s in cluster:
            micro = {k: v[s : s + micro_rows] for k, v in mb.items()}
            yield micro, prefix
            if prefix is None:
                cost.body_tokens += padded_body_tokens(micro["attention_mask"], micro["responses"].shape[-1])
            else:
                cost.prefixed_tokens += micro["input_ids"].shape[0] * prefix.length
        if prefix is not None:
            prefix.backward()  # the cluster's prefix, its gradient summed over its rows, in one pass
            cost.body_tokens += prefix.body_tokens


def planned_body_tokens(mb: dict[str, torch.Tensor], plan: PrefixPlan, micro_rows: int) -> int:
    """The tokens `micro_batches` will send through the body for `plan` (its `ForwardCost.body_tokens`),
    before any forward: a shared cluster costs its prefix P once plus, per micro-batch, rows × the
    longest suffix (attended − P); a padded one `padded_body_tokens` per micro-batch."""
    response_length, total = mb["responses"].shape[-1], 0
    for cluster, length in zip(plan.clusters, plan.lengths):
        masks = [mb["attention_mask"][s : s + micro_rows] for s in cluster]
        if length >= MIN_SHARED:
            total += length + sum(m.shape[0] * (int(m.sum(-1).max()) - length) for m in masks)
        else:
            total += sum(padded_body_tokens(m, response_length) for m in masks)
    return total


def padded_body_tokens(attention_mask: torch.Tensor, response_length: int) -> int:
    """Tokens the padded path sends through the body for rows [n, L]: n × the trimmed width."""
    attended = attention_mask.bool().any(0).nonzero()
    if not attended.numel():
        return int(attention_mask.numel())
    prompt_width = attention_mask.shape[1] - response_length
    first = min(int(attended[0]), prompt_width)
    last = max(int(attended[-1]) + 1, prompt_width + 1)
    return int(attention_mask.shape[0] * (last - first))
