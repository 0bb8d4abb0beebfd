"""PrefixCache: block-chain lookup, exact verification, LRU budget, invalidation on weight updates."""

from __future__ import annotations

import torch

from agl_lab.engines.serving.prefix_cache import BLOCK, CachedPrefix, PrefixCache


def _entry(tokens: list[int], layers: int = 2) -> CachedPrefix:
    kv = [
        torch.arange(len(tokens), dtype=torch.float32).repeat(1, 1)[:, :, None].expand(1, len(tokens), 4).clone()
        for _ in range(layers)
    ]
    return CachedPrefix(list(tokens), kv, [t.clone() for t in kv])


def test_longest_prefix_past_the_last_block_and_never_the_whole_prompt():
    cache = PrefixCache()
    base = list(range(100, 100 + 3 * BLOCK + 5))
    cache.put(_entry(base))
    # two whole blocks found by hash, then the 3 tokens after them that the entry shares
    m, e = cache.match(base[: 2 * BLOCK + 3] + [1, 2, 3])
    assert m == 2 * BLOCK + 3 and e.tokens == base
    # a prompt equal to the cached tokens keeps at least one token to run
    m, _ = cache.match(base[: 3 * BLOCK])
    assert m == 3 * BLOCK - 1
    m, _ = cache.match(base + [7, 8])  # longer than the entry: all of the entry
    assert m == len(base)
    assert cache.match([7] * 40) == (0, None)
    assert cache.match(base[:BLOCK]) == (0, None)  # the last token must run: no full block before it


def test_hash_hit_is_verified_token_by_token(monkeypatch):
    cache = PrefixCache()
    cache.put(_entry(list(range(2 * BLOCK))))
    # forge a collision: every block hash of any prompt maps to the stored entry
    monkeypatch.setattr(
        "agl_lab.engines.serving.prefix_cache._block_hashes", lambda tokens: list(cache._index)[: len(tokens) // BLOCK]
    )
    assert cache.match([9] * (2 * BLOCK + 1)) == (0, None)


def test_lru_budget_evicts_least_recently_used():
    one = _entry(list(range(2 * BLOCK)))
    cache = PrefixCache(max_bytes=int(2.5 * one.nbytes))
    a, b, c = (list(range(s, s + 2 * BLOCK)) for s in (0, 1000, 2000))
    cache.put(_entry(a))
    cache.put(_entry(b))
    cache.match(a + [1])  # a is now the most recent
    cache.put(_entry(c))  # over budget: b goes
    assert cache.match(a + [1])[0] == 2 * BLOCK and cache.match(c + [1])[0] == 2 * BLOCK
    assert cache.match(b + [1]) == (0, None) and cache.stats["evictions"] == 1


def test_weight_update_empties_the_cache():
    model = torch.nn.Linear(2, 2)
    cache = PrefixCache()
    cache.check_weights(model)
    cache.put(_entry(list(range(2 * BLOCK))))
    generation = cache.generation
    cache.check_weights(model)  # unchanged weights: kept
    assert len(cache) == 1
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step is an in-place update
    cache.check_weights(model)
    assert len(cache) == 0 and cache.generation > generation
    cache.put(_entry(list(range(2 * BLOCK))))
    model.weight.data = torch.zeros(2, 2)  # new storage, same parameter object: seen too
    cache.check_weights(model)
    assert len(cache) == 0


def test_requests_admitted_together_compute_their_common_prefix_once():
    """A GRPO group's prompts admitted in one batch: the shared blocks run once, every row stays exact."""
    from agl_lab.engines.serving.scheduler import BatchScheduler, SamplingParams
    from agl_lab.engines.tiny import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(device="cpu")
    shared = [5 + i % 50 for i in range(3 * BLOCK + 7)]  # 3 whole blocks + 7 tokens in common
    prompts = [shared + [60, 61], shared + [60, 62, 63], shared + [64], shared + [60, 61]]
    sched = BatchScheduler(model, tok, batch_window_ms=0)
    try:
        sched.pause(wait=True)  # queue all four, then admit them in one prefill
        params = SamplingParams(max_tokens=4, seed=3, ignore_eos=True)
        futures = [sched.submit(p, params) for p in prompts]
        sched.resume()
        results = [f.result(timeout=120) for f in futures]
    finally:
        sched.close()
    stats = sched.stats
    assert stats["prefills"] == 1 and stats["shared_prefills"] == 1
    # the common prefix once (3 whole blocks + 7 tokens), then each row only its own tokens
    common = len(shared)
    assert stats["prefill_tokens"] == common + sum(len(p) - common for p in prompts)
    # what was computed or served adds up to the prompts (the shared blocks count once as computed)
    assert stats["prefill_tokens"] + stats["cached_tokens"] == sum(len(p) for p in prompts)
    # the decode steps read the common prefix once for the four rows (`decode_batch.SharedPrefix`)
    assert stats["shared_columns"] == common * stats["steps"] > 0 and stats["spilled_columns"] == 0
    for prompt, res in zip(prompts, results):  # logprobs as one fresh forward computes them
        ids = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        fresh = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
        assert (fresh - torch.tensor(res.logprobs)).abs().max().item() < 1e-4
