"""DecodeBatch and sample_tokens: batched decoding is exact, sampling draws the right distribution."""

from __future__ import annotations

import torch

from agl_lab.engines.serving.decode_batch import DecodeBatch, sample_tokens
from agl_lab.engines.tiny import load_model_and_tokenizer


def _fresh_next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_sample_tokens_draws_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0]).repeat(40_000, 1)
    n = logits.shape[0]
    temps = torch.full((n,), 0.7)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_tokens(
        logits,
        temps,
        torch.ones(n),
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n, generator=gen, dtype=torch.float64),
        nucleus=False,
    )
    expected = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq - expected).abs().max() < 0.01
    assert torch.allclose(logp[0], torch.log_softmax(logits[0] / 0.7, -1))


def test_top_p_truncates_sampling_but_not_the_reported_logprobs():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(20_000, 1)
    n = logits.shape[0]
    gen = torch.Generator().manual_seed(1)
    tokens, logp = sample_tokens(
        logits,
        torch.ones(n),
        torch.full((n,), 0.75),
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n, generator=gen, dtype=torch.float64),
    )
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert freq[2:].sum() == 0  # nucleus = {0.5, 0.3}: mass 0.8 ≥ 0.75
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.015  # drawn renormalised within the nucleus …
    assert torch.allclose(logp[0].exp(), torch.tensor([0.5, 0.3, 0.15, 0.05]))  # … reported as is
    # top_p=1 through the sorted path draws the same tokens as the unsorted path
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a, _ = sample_tokens(logits, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.bool), u, nucleus=True)
    b, _ = sample_tokens(logits, torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.bool), u, nucleus=False)
    assert torch.equal(a, b)


def test_a_seeded_top_p_1_row_draws_the_same_token_beside_a_nucleus_batch_mate():
    """A row with top_p 1 draws from its unsorted distribution even when a batch-mate's top_p < 1
    sends the batch through the sort (before: the sorted order's inverse CDF, another token)."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 4_000, 50
    logits = torch.randn(n, vocab, generator=gen)  # unsorted: the sorted order differs from the ids
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ones, no = torch.ones(n), torch.zeros(n, dtype=torch.bool)
    alone, _ = sample_tokens(logits, ones, ones, no, u, nucleus=False)
    top_p = torch.where(torch.arange(n) % 2 == 0, 1.0, 0.6)  # every other row a nucleus batch-mate
    mixed, _ = sample_tokens(logits, ones, top_p, no, u, nucleus=True)
    assert torch.equal(mixed[0::2], alone[0::2])
    nucleus_alone, _ = sample_tokens(logits[1::2], ones[1::2], top_p[1::2], no[1::2], u[1::2], nucleus=True)
    assert torch.equal(mixed[1::2], nucleus_alone)  # the nucleus rows are untouched by their mates


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    greedy = torch.tensor([True, False] * 3)
    tokens, _ = sample_tokens(logits, torch.ones(6), torch.ones(6), greedy, torch.zeros(6, dtype=torch.float64))
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])


def test_prefill_decode_merge_select_equal_fresh_forwards(model, one_thread):
    """Teacher-forced decoding through slab growth, a merge and a select matches fresh forwards."""
    gen = torch.Generator().manual_seed(3)

    def rand_ids(k: int) -> list[int]:
        return torch.randint(4, 1024, (k,), generator=gen).tolist()

    def new_batch(prompts):
        batch, logits = DecodeBatch.prefill(
            model,
            prompts,
            temps=[1.0] * len(prompts),
            top_p=[1.0] * len(prompts),
            greedy=[False] * len(prompts),
            pad_id=3,
        )
        return batch, logits

    def feed(batch, histories, logits):
        forced = rand_ids(batch.size)
        for h, t in zip(histories, forced):
            h.append(t)
        batch.tokens = torch.tensor(forced)
        return batch.decode(model)

    def check(histories, logits):
        for h, row in zip(histories, logits):
            assert (_fresh_next_logits(model, h) - row.float()).abs().max() < 1e-4

    with torch.inference_mode():
        histories = [rand_ids(k) for k in (3, 17, 9)]
        batch, logits = new_batch([list(h) for h in histories])
        check(histories, logits)
        for _ in range(80):  # past the 64 spare columns: the slab grows
            logits = feed(batch, histories, logits)
        check(histories, logits)
        late = [rand_ids(k) for k in (40, 2)]
        other, late_logits = new_batch([list(h) for h in late])
        check(late, late_logits)
        late_tokens = rand_ids(2)
        for h, t in zip(late, late_tokens):
            h.append(t)
        other.tokens = torch.tensor(late_tokens)
        pending = rand_ids(3)
        for h, t in zip(histories, pending):
            h.append(t)
        batch.tokens = torch.tensor(pending)
        merged = batch.merge(other)
        histories = histories + late
        logits = merged.decode(model)
        check(histories, logits)
        kept = merged.select([1, 3])
        histories = [histories[1], histories[3]]
        for _ in range(5):
            logits = feed(kept, histories, logits)
        check(histories, logits)
        assert kept.mask.shape[1] == kept.length and kept.positions.tolist() == [len(h) for h in histories]


def test_prefill_with_cached_prefixes_equals_fresh_forwards(model, one_thread):
    """Rows whose first tokens come from a CachedPrefix (and rows without) compute what fresh forwards do."""
    from agl_lab.engines.serving.prefix_cache import CachedPrefix

    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(4, 1024, (40,), generator=gen).tolist()
    with torch.inference_mode():
        first, _ = DecodeBatch.prefill(model, [shared], [1.0], [1.0], [False], pad_id=3)
        entry = CachedPrefix(shared, *first.row_kv(0))
        prompts = [shared[:32] + [5, 6, 7], shared + [9] * 11, [11, 12, 13]]
        batch, logits = DecodeBatch.prefill(
            model,
            prompts,
            [1.0] * 3,
            [1.0] * 3,
            [False] * 3,
            pad_id=3,
            prefixes=[entry, entry, None],
            prefix_lens=[32, 40, 0],
        )
        histories = [list(p) for p in prompts]
        for _ in range(3):
            for h, row in zip(histories, logits):
                assert (_fresh_next_logits(model, h) - row.float()).abs().max() < 1e-4
            nxt = logits.argmax(-1)
            for h, t in zip(histories, nxt.tolist()):
                h.append(t)
            batch.tokens = nxt
            logits = batch.decode(model)
        assert batch.positions.tolist() == [len(h) for h in histories]
        # row_kv returns exactly the real columns: the prompt + every token fed since
        assert batch.row_kv(0)[0][0].shape[1] == len(histories[0])


def test_a_shared_prefix_block_computes_what_the_rows_own_columns_do(model, one_thread):
    """Rows whose prompts share cached columns hold them once (`SharedPrefix`); through decode steps, a
    merge with a batch of a partly different block (cut to the common columns, the rest copied into the
    rows), a merge with a batch of none, a select and the HF path, every row computes what a fresh
    forward of its history does, and `row_kv` returns its whole history."""
    from agl_lab.engines.serving.decode_batch import SHARED_MIN
    from agl_lab.engines.serving.prefix_cache import CachedPrefix

    gen = torch.Generator().manual_seed(6)

    def rand_ids(k: int) -> list[int]:
        return torch.randint(4, 1024, (k,), generator=gen).tolist()

    def cached(tokens):
        first, _ = DecodeBatch.prefill(model, [tokens], [1.0], [1.0], [False], pad_id=3)
        return CachedPrefix(tokens, *first.row_kv(0))

    def prefill(prompts, entry=None, n=0):
        k = len(prompts)
        entries = None if entry is None else [entry] * k
        return DecodeBatch.prefill(
            model, prompts, [1.0] * k, [1.0] * k, [False] * k, pad_id=3, prefixes=entries, prefix_lens=[n] * k
        )

    def check(histories, logits):
        for h, row in zip(histories, logits):
            assert (_fresh_next_logits(model, h) - row.float()).abs().max() < 1e-4

    def step(batch, histories, logits, **kw):
        forced = rand_ids(batch.size)
        for h, t in zip(histories, forced):
            h.append(t)
        batch.tokens = torch.tensor(forced)
        logits = batch.decode(model, **kw)
        check(histories, logits)
        return logits

    system = rand_ids(SHARED_MIN + 16)
    with torch.inference_mode():
        histories = [system + rand_ids(k) for k in (3, 11, 6)]
        batch, logits = prefill([list(h) for h in histories], cached(system), len(system))
        assert batch.shared is not None and batch.shared.tokens == system
        assert batch.length == 11  # the slabs hold only each row's own columns
        check(histories, logits)
        for _ in range(3):
            logits = step(batch, histories, logits)

        other = system[: SHARED_MIN + 4] + rand_ids(20)  # the first SHARED_MIN + 4 columns in common
        late = [other + rand_ids(5)]
        fresh, late_logits = prefill([list(h) for h in late], cached(other), len(other))
        check(late, late_logits)
        assert len(fresh.shared) == len(other)
        assert batch.align_shared(fresh) == 3 * 12 + 1 * 20  # rows × the columns each block gave back
        assert len(batch.shared) == len(fresh.shared) == SHARED_MIN + 4
        histories += late
        batch.tokens = torch.cat([logits.argmax(-1), late_logits.argmax(-1)])
        for h, t in zip(histories, batch.tokens.tolist()):
            h.append(t)
        batch.tokens = batch.tokens[:3]
        fresh.tokens = torch.tensor(histories[3][-1:])
        logits = batch.merge(fresh).decode(model)
        check(histories, logits)

        alone, alone_logits = prefill([rand_ids(9)])  # no block: the merged batch gives all of its columns back
        assert alone.shared is None
        assert batch.align_shared(alone) == 4 * (SHARED_MIN + 4) and batch.shared is None
        logits = step(batch, histories, logits)

        batch, logits = prefill([list(h) for h in histories[:2]], cached(system), len(system))
        histories = histories[:2]
        kept = batch.select([1])
        histories = histories[1:]
        logits = step(kept, histories, logits[1:])
        assert kept.shared is not None
        assert kept.row_kv(0)[0][0].shape[1] == len(histories[0])  # the block's columns, then the row's
        logits = step(kept, histories, logits, fast=False)  # HF's forward: the block goes back to the row first
        assert kept.shared is None and kept.row_kv(0)[0][0].shape[1] == len(histories[0])


def test_fast_decode_step_equals_the_hf_forward_and_follows_weight_updates(one_thread):
    from agl_lab.engines.serving import fast_decode

    model = load_model_and_tokenizer(device="cpu")[0]  # a private copy: this test edits weights
    assert fast_decode.supports(model)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    with torch.inference_mode():
        a, la = DecodeBatch.prefill(model, prompts, [1.0] * 2, [1.0] * 2, [False] * 2, pad_id=3)
        b, _ = DecodeBatch.prefill(model, prompts, [1.0] * 2, [1.0] * 2, [False] * 2, pad_id=3)
        for _ in range(4):
            a.tokens = b.tokens = la.argmax(-1)
            la, lb = a.decode(model, fast=True), b.decode(model, fast=False)
            assert (la - lb).abs().max() < 1e-4
    with torch.no_grad():  # an in-place update, as an optimizer step does: packed copies must follow
        model.lm_head.weight.mul_(1.5)
    with torch.inference_mode():
        a.tokens = b.tokens = la.argmax(-1)
        assert (a.decode(model, fast=True) - b.decode(model, fast=False)).abs().max() < 1e-4


def test_a_qwen2_model_with_attention_biases_prefills_and_decodes_as_its_hf_forward(one_thread):
    """Qwen2's q/k/v biases ride in the fused q/k/v product (`fast_decode._Products`): prefill and
    decode through `fast_decode` against the HF module, biases and grouped heads non-trivial."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agl_lab.engines.serving import fast_decode

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    assert fast_decode.supports(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    with torch.inference_mode():
        runs = [
            DecodeBatch.prefill(model, prompts, [1.0] * 2, [1.0] * 2, [False] * 2, pad_id=3, fast=f)
            for f in (True, False)
        ]
        (a, la), (b, lb) = runs
        assert (la - lb).abs().max() < 1e-4
        for _ in range(4):
            a.tokens = b.tokens = la.argmax(-1)
            la, lb = a.decode(model, fast=True), b.decode(model, fast=False)
            assert (la - lb).abs().max() < 1e-4
    with torch.no_grad():  # a bias alone updated in place: the fused bias must follow
        model.model.layers[0].self_attn.k_proj.bias.add_(1.0)
    with torch.inference_mode():
        a.tokens = b.tokens = la.argmax(-1)
        assert (a.decode(model, fast=True) - b.decode(model, fast=False)).abs().max() < 1e-4


# A scripted arrival schedule: (arrival step, prompt length, max tokens, temperature, top_p).
# Arrivals mid-decode, one longer than the running rows' cache (the slab grows on the left),
# retirements from the middle and the end of the batch, and >64 steps (the slab grows on the right).
_SCHEDULE = [
    (0, 7, 90, 0.0, 1.0),
    (0, 3, 6, 1.0, 0.99),
    (0, 12, 40, 0.8, 0.9),
    (4, 30, 9, 1.0, 0.999),
    (4, 2, 75, 0.0, 1.0),
    (11, 5, 3, 1.3, 0.95),
    (20, 60, 30, 0.0, 1.0),
    (21, 4, 50, 1.0, 0.98),
    (52, 70, 12, 0.7, 0.9),  # after the 60-token row retired: widens the trimmed window in place
]
# Every sampled row has top_p < 1: a batch with any top_p < 1 draws through the sorted (nucleus)
# path for all its rows, a row with top_p = 1 alone through the unsorted one — the same
# distribution, not the same token for the same uniform.


def run_schedule(model, only: int | None = None, invariant: bool = False, fast: bool = True):
    """Drive DecodeBatch as the scheduler does (decode, admit, retire) through `_SCHEDULE` (or its
    request `only`, alone from step 0) → per request (tokens, logprobs, its cached keys at retirement)."""
    ids = range(len(_SCHEDULE)) if only is None else [only]
    schedule = [_SCHEDULE[i] if only is None else (0, *_SCHEDULE[i][1:]) for i in ids]
    prompts = [
        torch.randint(4, 1024, (_SCHEDULE[i][1],), generator=torch.Generator().manual_seed(i)).tolist() for i in ids
    ]
    draws = [torch.Generator().manual_seed(100 + i) for i in ids]
    out = [([], [], None) for _ in schedule]
    running: list[int] = []
    batch = None

    def sample(logits, rows, b):
        u = torch.stack([torch.rand((), generator=draws[r], dtype=torch.float64) for r in rows])
        tokens, logp = sample_tokens(logits, b.temps, b.top_p, b.greedy, u, b.nucleus)
        b.tokens = tokens
        for r, t, lp in zip(rows, tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist()):
            out[r][0].append(t)
            out[r][1].append(lp)

    step = 0
    with torch.inference_mode():
        while step == 0 or running:
            if running:
                sample(batch.decode(model, fast=fast, invariant=invariant), running, batch)
            new = [r for r, (at, *_) in enumerate(schedule) if at == step]
            if new:
                fresh, logits = DecodeBatch.prefill(
                    model,
                    [prompts[r] for r in new],
                    temps=[schedule[r][3] or 1.0 for r in new],
                    top_p=[schedule[r][4] for r in new],
                    greedy=[schedule[r][3] == 0 for r in new],
                    pad_id=3,
                    invariant=invariant,
                )
                sample(logits, new, fresh)
                batch = batch.merge(fresh) if running else fresh
                running = running + new
            done = [i for i, r in enumerate(running) if len(out[r][0]) >= schedule[r][2]]
            for i in done:
                keys = batch.row_kv(i)[0][0]
                out[running[i]] = (out[running[i]][0], out[running[i]][1], keys)
            keep = [i for i in range(len(running)) if i not in done]
            if done:
                batch = batch.select(keep) if keep else None
                running = [running[i] for i in keep]
            step += 1
    return out


def test_a_scripted_schedule_decodes_each_request_as_if_alone(model, one_thread):
    """Arrivals mid-decode and retirements: batch-invariant rows are bitwise their solo decode;
    plain rows agree with it to float noise; a retired row's cached keys are its whole history.
    Without oneDNN's packed kernels (`AGL_LAB_DECODE_ONEDNN=0`) the engine warns that it cannot promise
    bitwise rows (`fast_decode.invariance_gap`), and only the plain half applies."""
    from agl_lab.engines.serving import fast_decode

    for invariant in (True, False) if fast_decode.invariance_gap(model) is None else (False,):
        together = run_schedule(model, invariant=invariant)
        for r, (tokens, logprobs, keys) in enumerate(together):
            solo = run_schedule(model, only=r, invariant=invariant)[0]
            n = _SCHEDULE[r][1] + _SCHEDULE[r][2] - 1  # prompt + sampled tokens but the pending last
            assert keys.shape[1] == n
            if invariant:
                assert tokens == solo[0] and logprobs == solo[1], r
                assert torch.equal(keys, solo[2]), r
            else:
                k = next((i for i, (a, b) in enumerate(zip(tokens, solo[0])) if a != b), len(tokens))
                assert k >= min(len(tokens), 8), r  # near-ties may split later; the first tokens agree
                assert max(abs(a - b) for a, b in zip(logprobs[:k], solo[1][:k])) < 1e-4, r


def test_the_fast_prefill_computes_what_the_hf_forward_does_with_a_lora_adapter_and_cached_prefixes(one_thread):
    """The prefill through `fast_decode.forward` (merged, packed weights; one fused attention a
    layer) against the HF module with PEFT's unmerged adapter: the same logits and the same K/V,
    rows with and without cached prefixes, padding between prefix and suffix."""
    from unittest import mock

    from agl_lab.engines.lora import LoraSpec, add_lora
    from agl_lab.engines.serving import fast_decode
    from agl_lab.engines.serving.prefix_cache import CachedPrefix

    model = load_model_and_tokenizer(device="cpu")[0]
    add_lora(model, LoraSpec(rank=4, alpha=8))
    with torch.no_grad():  # a trained adapter: B moved off its zero init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(4, 1024, (48,), generator=gen).tolist()
    prompts = [shared[:32] + [5, 6, 7], shared + [9] * 13, [11, 12, 13, 14]]
    out = {}
    with torch.inference_mode():
        for fast in (True, False):
            with mock.patch.object(fast_decode, "forward", wraps=fast_decode.forward) as forward:
                first, _ = DecodeBatch.prefill(model, [shared], [1.0], [1.0], [False], pad_id=3, fast=fast)
                entry = CachedPrefix(shared, *first.row_kv(0))
                batch, logits = DecodeBatch.prefill(
                    model, prompts, [1.0] * 3, [1.0] * 3, [False] * 3, pad_id=3,
                    prefixes=[entry, entry, None], prefix_lens=[32, 48, 0], fast=fast,
                )  # fmt: skip
            assert forward.call_count == (2 if fast else 0)  # the path compared is the one named
            out[fast] = (logits.float(), [batch.row_kv(i) for i in range(3)])
        for h, row in zip(prompts, out[True][0]):
            assert (_fresh_next_logits(model, h) - row).abs().max() < 1e-4
    assert (out[True][0] - out[False][0]).abs().max() < 1e-4
    for (kf, vf), (kh, vh) in zip(out[True][1], out[False][1]):
        for a, b in zip(kf + vf, kh + vh):
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4
