"""agl_lab.algorithms.advantage: rollout-level advantage, zero-advantage groups, estimator checks.

Parity tests (marked `# AGL parity`) use the fixtures and expected values of AGL v1's
tests/verl/test_rollout_level_advantage.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
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
        upstream_batch(), adv_estimator="grpo", gamma=1.0, lam=1.0, num_repeat=2, compute_advantage_fn=estimator
    )
    assert seen["rollouts"] == ["r1", "r2"] and seen["uids"] == ["data-1", "data-1"]
    assert seen["kwargs"]["adv_estimator"] == "grpo" and seen["kwargs"]["num_repeat"] == 2
    assert metrics == {
        "training/rollout_level_advantage/n_rows": 3,
        "training/rollout_level_advantage/n_rollouts": 2,
        "training/rollout_level_advantage/n_multi_row_rollouts": 1,
        "training/rollout_level_advantage/max_rows_per_rollout": 2,
    }
    assert data.batch["advantages"].tolist() == [[2, 2, 0], [2, 0, 0], [-1, -1, -1]]
    assert data.batch["returns"].tolist() == [[3, 3, 0], [3, 0, 0], [-2, -2, -2]]


def test_rollout_level_advantage_requires_rollout_ids():  # AGL parity
    data = upstream_batch()
    data.non_tensor_batch.pop("rollout_id_list")
    with pytest.raises(RuntimeError, match="rollout_id_list"):
        alg.compute_rollout_level_advantage(data, "grpo", num_repeat=2, compute_advantage_fn=lambda d, **k: d)


def test_rollout_level_advantage_rejects_inconsistent_rollout_rewards():  # AGL parity
    with pytest.raises(RuntimeError, match="same scalar token_level_rewards"):
        alg.compute_rollout_level_advantage(
            upstream_batch((1.0, 2.0, 3.0)), "grpo", num_repeat=2, compute_advantage_fn=lambda d, **k: d
        )


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
    data = make_batch(
        [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]],
        [1, 1, 0, 1, 0.5, 0.5],
        ["a", "a", "b", "c", "z0", "z1"],
        ["g", "g", "g", "g", "z", "z"],
    )
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
    assert alg.group_metrics(data) == {
        "training/n_groups": 3,
        "training/n_zero_adv_groups": 1,
        "training/n_zero_signal_rollouts": 4,
        "training/zero_signal_rollout_frac": 4 / 12,
    }
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


# ---------------------------------------------------------------------------------------------
# Exact zero-advantage groups (issue 36): float64 group statistics, all-equal groups exactly 0
# ---------------------------------------------------------------------------------------------

EQUAL_REWARDS = (0.1, 1 / 3, 0.7, 1e-3)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("reward", EQUAL_REWARDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(n, reward, norm_by_std):
    # a mixed group next to it, so the batch is not all one group
    data = make_batch(
        [[1, 1, 0]] * (n + 2),
        [reward] * n + [0.0, 1.0],
        [f"z{k}" for k in range(n)] + ["m0", "m1"],
        ["z"] * n + ["m", "m"],
    )
    out, metrics = alg.compute_rollout_level_advantage(data, "grpo", num_repeat=n, norm_adv_by_std_in_grpo=norm_by_std)
    assert bool((out.batch["advantages"][:n] == 0).all()), out.batch["advantages"][:n]
    assert bool((out.batch["returns"][:n] == 0).all())
    assert alg.zero_advantage_groups(out) == ["z"]
    assert alg.group_metrics(out) == {
        "training/n_groups": 2,
        "training/n_zero_adv_groups": 1,
        "training/n_zero_signal_rollouts": n,
        "training/zero_signal_rollout_frac": n / (n + 2),
    }


def test_verl_float32_numbers_are_one_ulp_off_zero_and_the_parity_switch_restores_them():
    # The bug of issue 36: eight rewards of 0.1, float32 mean one ulp off, (r − mean)/(std + 1e-6) ≈ −0.0074.
    data = make_batch([[1, 1]] * 8, [0.1] * 8, [f"r{k}" for k in range(8)], ["g"] * 8)
    verl_out, _ = alg.compute_rollout_level_advantage(
        data.select_idxs(list(range(8))), "grpo", num_repeat=8, exact_zero=False
    )
    off = verl_out.batch["advantages"][:, 0]
    assert bool((off != 0).all()) and off.abs().max().item() == pytest.approx(0.0074, abs=5e-4)
    assert alg.zero_advantage_groups(verl_out) == []  # parity: verl's numbers, counted as they are
    ours, _ = alg.compute_rollout_level_advantage(data, "grpo", num_repeat=8)
    assert bool((ours.batch["advantages"] == 0).all())


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("reward", EQUAL_REWARDS)
def test_a_group_with_one_different_reward_matches_verls_estimator(n, reward):
    rewards = [reward] * (n - 1) + [reward + 0.25]
    data = make_batch([[1, 1, 1]] * n, rewards, [f"r{k}" for k in range(n)], ["g"] * n)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    exact, _ = core_algos.compute_grpo_outcome_advantage(  # verl's formula on float64 statistics
        data.batch["token_level_rewards"].double(), data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    ours, _ = alg.compute_rollout_level_advantage(data, "grpo", num_repeat=n)
    assert ours.batch["advantages"].dtype == verl_adv.dtype == torch.float32
    # to 1e-7 of the exact value (float32 rounding of it); verl's float32 statistics are off it by
    # up to ~1e-6 at n=16 (its own rounding), so against verl float32's tolerance
    torch.testing.assert_close(ours.batch["advantages"].double(), exact, atol=1e-7, rtol=0)
    torch.testing.assert_close(ours.batch["advantages"], verl_adv)


def test_a_group_of_one_keeps_verls_mean_zero_std_one():
    data = make_batch([[1, 1]] * 3, [0.5, 0.0, 1.0], ["a", "b", "c"], ["solo", "zero", "pair"])
    out, _ = alg.compute_rollout_level_advantage(data, "grpo")
    assert out.batch["advantages"][0, 0].item() == pytest.approx(0.5 / (1 + 1e-6))
    # a lone rollout with reward 0 carries no signal; a lone 0.5 does (A = its reward)
    assert alg.zero_advantage_groups(out) == ["zero"]
    assert alg.zero_advantage_groups(data) == ["zero"]  # the reward rule, before advantages, agrees


@pytest.mark.parametrize("estimator", ["rloo", "grpo_passk", "opo"])
def test_other_group_baseline_estimators_give_equal_groups_exact_zeros(estimator):
    data = make_batch([[1, 1]] * 10, [0.1] * 8 + [0.0, 1.0], [f"r{k}" for k in range(10)], ["z"] * 8 + ["m"] * 2)
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": True})  # grpo_passk reads it
    out, _ = alg.compute_rollout_level_advantage(data, estimator, num_repeat=8, config=config)
    assert bool((out.batch["advantages"][:8] == 0).all())
    assert not bool((out.batch["advantages"][8:] == 0).all())


def test_row_level_advantage_gets_exact_zeros_too():
    data = make_batch([[1, 1]] * 8, [0.1] * 8, ["a", "a", "b", "c", "d", "e", "f", "g"], ["g"] * 8)
    out, _ = alg.compute_advantages(data, rollout_level=False, adv_estimator="grpo", num_repeat=8)
    assert bool((out.batch["advantages"] == 0).all())


def test_before_advantages_zero_groups_use_bitwise_equal_rewards():
    # 0.1 and 0.1 + 1e-7 are allclose (AGL's rule) but not equal: GRPO gives them a signal
    data = make_batch([[1]] * 4, [0.1, 0.1 + 1e-7, 0.5, 0.5], ["a", "b", "c", "d"], ["near", "near", "eq", "eq"])
    assert alg.zero_advantage_groups(data) == ["eq"]
    assert alg.zero_advantage_groups(data, rule="agl") == ["near", "eq"]


def _eight_tenths_and_mixed():
    # issue 36's case: a group of eight 0.1 rewards next to two mixed groups of eight
    return make_batch(
        [[1, 1]] * 24, [0.1] * 8 + [0.0, 1.0] * 8, [f"r{k}" for k in range(24)], ["z"] * 8 + ["m"] * 8 + ["p"] * 8
    )


def test_the_metric_the_drop_order_and_the_trained_batch_agree_on_an_equal_reward_group():
    prepared, records, metrics = alg.prepare_update_batch(
        _eight_tenths_and_mixed(), mini_batch_rows=16, loss_mode="vanilla"
    )
    assert metrics["training/n_zero_adv_groups_collected"] == 1
    assert metrics["training/n_zero_signal_rollouts_collected"] == 8
    assert metrics["training/zero_signal_rollout_frac_collected"] == 8 / 24
    # the equal-reward group is what the alignment drops, whole, first
    assert {r["reason"] for r in records} == {"zero_adv_group"} and {r["data_id"] for r in records} == {"z"}
    assert metrics["training/n_zero_signal_rollouts"] == 0 and len(prepared) == 16


def test_the_grpo_float32_parity_switch_restores_verls_numbers_end_to_end():
    prepared, records, metrics = alg.prepare_update_batch(
        _eight_tenths_and_mixed(), mini_batch_rows=16, loss_mode="vanilla", grpo_float32=True
    )
    # verl's float32 statistics: the 0.1 group is not zero, so nothing marks it for the first drop
    assert metrics["training/n_zero_adv_groups_collected"] == 0
    assert metrics["training/n_zero_signal_rollouts_collected"] == 0
    assert not {r["reason"] for r in records} & {"zero_adv_group", "zero_adv_rollout"}
