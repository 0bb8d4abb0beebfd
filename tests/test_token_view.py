"""agl_lab.token_view: one row token by token after a real update of the warm-started tiny model —
checked against an independent forward of the same model (logprob and entropy at each position),
the sampler's logprobs, the loss mask of the batch and the loss weights of the update."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from agl_lab.token_view import TOKEN_COLUMNS
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

WARM = [o for o in SMALL if not o.startswith("agl_lab.model.warm_start_steps")]  # the cached 200-step warm start


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    t = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=[*WARM, "data.train_batch_size=8"],
        run_dir=tmp_path_factory.mktemp("run"),
        console=False,
    )
    t.rollout()
    b = t.build_batch()
    before = t.tokens(0, b)  # the batch before any update: the current policy only
    u = t.update()
    yield t, b, u, before
    t.close()


def _reference(model, b, i, temperature):
    """log π(token) and entropy at each response position of row i, from a plain forward of the row's
    attended tokens (no padding, no trimming, no micro-batches)."""
    row = b.data.batch
    ids = row["input_ids"][i][row["attention_mask"][i].bool()]
    n_prompt = int(row["attention_mask"][i][: row["prompts"].shape[-1]].sum())
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float() / temperature  # [L, V]
    logp = torch.log_softmax(logits, -1)
    pred = logp[n_prompt - 1 : -1]  # Critical: position t predicts token t+1
    response = ids[n_prompt:]
    token_lp = pred.gather(-1, response[:, None])[:, 0]
    entropy = -(pred.exp() * pred).sum(-1)
    return token_lp.numpy(), entropy.numpy()


def test_one_line_per_response_token_with_the_rows_ids_and_loss_mask(stepped):
    t, b, u, _ = stepped
    line = b.rows[b.rows.batch_index >= 0].sort_values("observation_tokens").iloc[-1]  # a row with an observation
    assert line.observation_tokens > 0
    tok = u.tokens(line)
    assert list(tok.columns) == TOKEN_COLUMNS and len(tok) == line.response_tokens
    i = int(line.batch_index)
    assert tok.token_id.tolist() == b.data.batch["responses"][i][: len(tok)].tolist()
    assert tok.loss_mask.sum() == line.loss_tokens and (tok.loss_mask == 0).sum() == line.observation_tokens
    assert "".join(tok.token) == t.tokenizer.decode(tok.token_id.tolist())
    pd.testing.assert_frame_equal(tok, u.tokens(i))  # an int ≡ its b.rows line
    obs = tok[tok.loss_mask == 0]
    assert (obs.advantage == 0).all() and (obs.loss_advantage == 0).all()  # observations carry no loss
    assert obs.rollout_logprob.isna().all() and tok[tok.loss_mask == 1].rollout_logprob.notna().all()


def test_new_logprob_and_entropy_are_the_updated_models_at_each_position(stepped):
    t, b, u, _ = stepped
    i = int(b.rows[b.rows.batch_index >= 0].batch_index.iloc[0])
    tok = u.tokens(i)
    ref_lp, ref_ent = _reference(t.engine.model, b, i, u.temperature)
    np.testing.assert_allclose(tok.new_logprob, ref_lp, atol=2e-5)
    np.testing.assert_allclose(tok.entropy, ref_ent, atol=2e-5)
    assert tok.attrs["policy_version"] == u.policy_version == 1
    np.testing.assert_allclose(tok.ratio, np.exp(tok.new_logprob - tok.old_logprob), rtol=1e-6)


def test_old_logprob_is_the_sampler_s_and_the_update_moved_the_policy_along_the_advantage(stepped):
    t, b, u, _ = stepped
    moved = 0.0
    for i in b.rows[b.rows.batch_index >= 0].batch_index:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = u.tokens(int(i))
        if not tok.attrs["trained"]:  # dropped before the update (alignment): said, and nothing of the update shown
            assert any("was not trained" in str(w.message) for w in caught)
            assert tok.old_logprob.isna().all() and tok.advantage.isna().all()
            continue
        on = tok[tok.loss_mask == 1]
        assert (on.old_logprob - on.rollout_logprob).abs().max() < 1e-3  # on-policy before the update
        assert on.advantage.nunique() == 1  # one advantage per rollout, on every loss token
        moved += float((on.advantage * (on.new_logprob - on.old_logprob)).sum())
    # one optimiser step on the surrogate Σ A·log π raises it (to first order): the ratios moved with A
    assert moved > 0


def test_loss_advantage_sums_to_the_rollouts_signed_loss_weight(stepped):
    t, b, u, _ = stepped
    single = u.weights[u.weights.n_rows == 1]
    assert len(single) and (single.advantage != 0).any()
    for _, w in single.iterrows():
        line = b.rows[(b.rows.rollout_id == w.rollout_id) & (b.rows.batch_index >= 0)].iloc[0]
        tok = u.tokens(line)
        assert tok.loss_advantage.sum() == pytest.approx(w.signed_weight, rel=1e-5, abs=1e-9)
        assert tok[tok.loss_mask == 1].advantage.iloc[0] == pytest.approx(w.advantage, rel=1e-6)


def test_before_an_update_only_the_current_policy_is_shown(stepped):
    _, _, _, before = stepped
    on = before[before.loss_mask == 1]
    assert before.old_logprob.isna().all() and before.ratio.isna().all() and before.advantage.isna().all()
    assert (on.new_logprob - on.rollout_logprob).abs().max() < 1e-3  # policy version 0 sampled it
    assert before.attrs["policy_version"] == 0


def test_a_later_update_is_named_and_bad_rows_fail_clearly(stepped):
    t, b, u, _ = stepped
    with pytest.raises(IndexError, match="the batch has rows 0–"):
        u.tokens(len(b.data))
    t.rollout()
    t.build_batch()
    t.update()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = u.tokens(0)
    assert tok.attrs["policy_version"] == 2 and any("policy version 2" in str(w.message) for w in caught)
    assert math.isfinite(tok.entropy.iloc[0])


def test_a_row_dropped_before_the_update_shows_its_tokens_and_says_it_was_not_trained(stepped):
    import dataclasses

    t, b, u, _ = stepped
    first = u.trained.non_tensor_batch
    rid, call = str(first["rollout_id_list"][0]), int(first["turn_index_list"][0])
    line = b.rows[(b.rows.rollout_id == rid) & (b.rows.first_call == call)].iloc[0]
    without = dataclasses.replace(u, trained=u.trained.select_idxs(list(range(1, len(u.trained)))))  # as if dropped
    with pytest.warns(UserWarning, match="was not trained .*UpdateResult.dropped"):
        tok = without.tokens(line)
    assert not tok.attrs["trained"] and len(tok) == line.response_tokens
    assert tok.old_logprob.isna().all() and tok.advantage.isna().all() and tok.new_logprob.notna().all()
    assert u.tokens(line).attrs["trained"]
