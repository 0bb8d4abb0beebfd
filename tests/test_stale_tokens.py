"""Issue #50 item 4: with staleness 1, a token sampled by policy version v is trained with its
version-v logprob as the behaviour term. The batch is sampled from the local engine's server at
version v, the engine then trains once (v + 1), and `prepare` runs on the stale batch."""

from __future__ import annotations

import pytest
import torch

from agl_lab.engines.local import LocalEngine
from tests.replica_probe import calls_to_batch, sample_calls

ACTOR = {"ppo_mini_batch_size": 64, "loss_mode": "vanilla", "lr": 5e-2}
THRESHOLD = 1.5


def correction(bypass: bool) -> dict:
    return {
        "rollout_correction": {
            "rollout_is": None if bypass else "token",
            "rollout_is_threshold": None if bypass else THRESHOLD,
            "rollout_rs": None,
            "rollout_rs_threshold": None,
            "bypass_mode": bypass,
            "loss_type": "ppo_clip",
            "rollout_is_batch_normalize": False,
        }
    }


def stale_batch(eng: LocalEngine):
    """A batch sampled at version v (its rollout_log_probs recorded then), after one step to v + 1."""
    v = eng.policy_version
    data = calls_to_batch(sample_calls(eng, 1.0), eng.tokenizer.pad_token_id)
    recorded = data.batch["rollout_log_probs"].clone()
    at_v = eng.compute_log_probs(data, 1.0)
    data.batch["old_log_probs"] = at_v
    data.batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.batch["response_mask"].float()
    eng.update(data)
    eng.sync_weights()
    assert eng.policy_version == v + 1
    stale = data.select_idxs(list(range(len(data))))
    for key in ("old_log_probs", "advantages"):
        stale.batch.pop(key)
    stale.batch["token_level_scores"] = torch.zeros_like(stale.batch["response_mask"], dtype=torch.float32)
    stale.meta_info["temperature"] = 1.0
    return stale, recorded, at_v


def test_bypass_trains_against_the_sampling_versions_logprob():
    # the algorithm's rollout_correction.bypass_mode alone turns it on, as the config path does
    with LocalEngine(device="cpu", actor=ACTOR, algorithm=correction(bypass=True)) as eng:
        assert eng.bypass_mode
        stale, recorded, _ = stale_batch(eng)
        out, _ = eng.prepare(stale)
        now = eng.compute_log_probs(stale, 1.0)
    mask = out.batch["response_mask"].bool()
    # the behaviour term is the version-v sampling logprob, bit for bit, not the v + 1 recomputation
    assert torch.equal(out.batch["old_log_probs"][mask], recorded[mask].to(out.batch["old_log_probs"].dtype))
    assert (now - recorded)[mask].abs().max() > 1e-3  # the policy did move: the test can fail


def test_token_is_weights_are_truncated_exp_of_new_old_minus_sampling():
    with LocalEngine(device="cpu", actor=ACTOR, algorithm=correction(bypass=False)) as eng:
        stale, recorded, _ = stale_batch(eng)
        out, metrics = eng.prepare(stale)
        old_v1 = eng.compute_log_probs(stale, 1.0)
    mask = out.batch["response_mask"].float()
    golden = torch.exp((old_v1 - recorded) * mask).clamp(max=THRESHOLD) * mask
    assert torch.allclose(out.batch["old_log_probs"], old_v1, atol=1e-6)
    assert torch.allclose(out.batch["rollout_is_weights"] * mask, golden, atol=1e-5)
    assert (golden[mask.bool()] != 1.0).any()
    assert any(k.startswith("rollout_corr/") for k in metrics)


def test_a_bypass_mode_argument_that_disagrees_with_the_algorithm_is_refused():
    with pytest.raises(ValueError, match="disagrees with algorithm.rollout_correction.bypass_mode=True"):
        LocalEngine(device="cpu", actor=ACTOR, algorithm=correction(bypass=True), bypass_mode=False)
