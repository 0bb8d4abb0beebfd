"""agl_lab.algorithms.advantage: rollout-level advantage, zero-advantage groups, estimator checks.

Parity tests (marked `# AGL parity`) use the fixtures and expected values of AGL v1's
tests/verl/test_rollout_level_advantage.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from verl.trainer.ppo import core_algos

import agl_lab.algorithms as alg
from tests.algo_batches import make_batch, three_groups, upstream_batch



def test_rollout_level_advantage_collapses_rollouts_and_broadcasts_rows():  # AGL parity
    seen = {}

    def estimator(sub, **kwargs):
        seen["rollouts"] = list(sub.non_tensor_batch["rollout_id_list"])
        seen["uids"] = list(sub.non_tensor_batch["uid"])
        seen["kwargs"] = kwargs
        mask = sub.batch["response_mask"]
        sub.batch["advantages"] = torch.tensor([[2.0], [-1.0]]) * mask
        sub.batch["returns"] = torch.tensor([[3.0], [-2.0]]) * mask
        return sub

    data, metrics = alg.compute_rollout_level_advantage(
        upstream_batch(), adv_estimator="grpo", gamma=1.0, lam=1.0, num_repeat=2, compute_advantage_fn=estimator)
    assert seen["rollouts"] == ["r1", "r2"] and seen["uids"] == ["data-1", "data-1"]
    assert seen["kwargs"]["adv_estimator"] == "grpo" and seen["kwargs"]["num_repeat"] == 2
    assert metrics == {"training/rollout_level_advantage/n_rows": 3,
                       "training/rollout_level_advantage/n_rollouts": 2,
                       "training/rollout_level_advantage/n_multi_row_rollouts": 1,
                       "training/rollout_level_advantage/max_rows_per_rollout": 2}
    assert data.batch["advantages"].tolist() == [[2, 2, 0], [2, 0, 0], [-1, -1, -1]]
    assert data.batch["returns"].tolist() == [[3, 3, 0], [3, 0, 0], [-2, -2, -2]]


def test_rollout_level_advantage_requires_rollout_ids():  # AGL parity
    data = upstream_batch()
    data.non_tensor_batch.pop("rollout_id_list")
    with pytest.raises(RuntimeError, match="rollout_id_list"):
        alg.compute_rollout_level_advantage(data, "grpo", num_repeat=2, compute_advantage_fn=lambda d, **k: d)


def test_rollout_level_advantage_rejects_inconsistent_rollout_rewards():  # AGL parity
    with pytest.raises(RuntimeError, match="same scalar token_level_rewards"):
        alg.compute_rollout_level_advantage(upstream_batch((1.0, 2.0, 3.0)), "grpo", num_repeat=2,
                                            compute_advantage_fn=lambda d, **k: d)


def test_rollout_level_advantage_rejects_non_scalar_token_advantages():  # AGL parity
    def estimator(sub, **kwargs):
        sub.batch["advantages"] = torch.tensor([[1.0, 2.0, 0.0], [-1.0, -1.0, -1.0]])
        return sub

    with pytest.raises(RuntimeError, match="scalar outcome-style advantages"):
        alg.compute_rollout_level_advantage(upstream_batch(), "grpo", num_repeat=2, compute_advantage_fn=estimator)


def test_rollout_level_advantage_group_key_falls_back_to_data_id():
    data = make_batch([[1, 1]], [1.0], ["r1"], ["d1"], uid=False)
    with pytest.raises(RuntimeError, match="uid or data_id_list"):
        d = make_batch([[1, 1]], [1.0], ["r1"], ["d1"], uid=False)
        d.non_tensor_batch.pop("data_id_list")
        alg.compute_rollout_level_advantage(d, "grpo", compute_advantage_fn=lambda d, **k: d)
    alg.compute_rollout_level_advantage(data, "grpo", compute_advantage_fn=lambda d, **k: d)
    assert list(data.non_tensor_batch["uid"]) == ["d1"]


def test_grpo_golden_numbers_with_verl_estimator():
    # Group g: rollout a (2 rows, reward 1), b (reward 0), c (reward 1); group z: two rollouts of 0.5.
    data = make_batch([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]],
                      [1, 1, 0, 1, 0.5, 0.5], ["a", "a", "b", "c", "z0", "z1"], ["g", "g", "g", "g", "z", "z"])
    data, metrics = alg.compute_rollout_level_advantage(data, "grpo", num_repeat=3)
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased std of (1, 0, 1)
    a_pos, a_neg = (1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6)
    expected = torch.tensor([[a_pos, a_pos, 0], [a_pos, 0, 0], [a_neg] * 3, [a_pos, a_pos, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(data.batch["advantages"], expected)
    assert round(a_pos, 6) == 0.577349 and round(a_neg, 6) == -1.154699
    # the 2-row rollout counted once: without collapsing, group g would be (1, 1, 0, 1)
    assert metrics["training/rollout_level_advantage/n_multi_row_rollouts"] == 1


@pytest.mark.parametrize("estimator", ["gae", core_algos.AdvantageEstimator.GAE, "optimal_token_baseline"])
def test_token_level_estimators_are_rejected_with_the_fix(estimator):
    with pytest.raises(ValueError, match="enable_rollout_level_advantage=false"):
        alg.compute_rollout_level_advantage(upstream_batch(), estimator, compute_advantage_fn=lambda d, **k: d)


@pytest.mark.parametrize("estimator", ["remax", core_algos.AdvantageEstimator.REMAX])
def test_remax_is_not_implemented(estimator):
    with pytest.raises(NotImplementedError, match="REMAX"):
        alg.compute_rollout_level_advantage(upstream_batch(), estimator, compute_advantage_fn=lambda d, **k: d)
    with pytest.raises(NotImplementedError, match="REMAX"):
        alg.check_estimator(estimator, rollout_level=False)



def test_group_metrics_and_zero_advantage_groups():
    data = three_groups()
    assert alg.group_metrics(data) == {"training/n_groups": 3, "training/n_zero_adv_groups": 1}
    assert alg.zero_advantage_groups(data) == ["z"]
    data.non_tensor_batch.pop("uid")
    data.non_tensor_batch.pop("data_id_list")
    assert alg.group_metrics(data) == {} and alg.zero_advantage_groups(data) == []



def test_gae_without_rollout_level_advantage_needs_a_critic():
    with pytest.raises(ValueError, match="needs critic values"):
        alg.prepare_update_batch(three_groups(), mini_batch_rows=4, adv_estimator="gae", rollout_level_advantage=False)
    # row-level GRPO (AGL's enable_rollout_level_advantage=false): a 2-row rollout counts twice
    data = make_batch([[1, 1]] * 3, [1, 1, 0], ["a", "a", "b"], ["g"] * 3)
    out, _, _ = alg.prepare_update_batch(data, mini_batch_rows=3, rollout_level_advantage=False, loss_mode="vanilla")
    mean, std = 2 / 3, math.sqrt(1 / 3)  # over rows (1, 1, 0)
    assert out.batch["advantages"][2, 0].item() == pytest.approx((0 - mean) / (std + 1e-6))
