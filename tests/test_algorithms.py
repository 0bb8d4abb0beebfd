"""agl_lab.algorithms: golden numbers on hand-built batches, AGL v1 parity, invariances.

Parity tests (marked `# §7.5` / `# §7.6`) use upstream's fixtures and expected values; the
others pin the improvements (rollouts divisor, whole-rollout drops, seeded RNG).
"""

from __future__ import annotations

import importlib
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos

import agl_lab.algorithms as alg

# ---------------------------------------------------------------------------------------------
# Hand-built batches
# ---------------------------------------------------------------------------------------------


def make_batch(masks, rewards, rollout_ids, data_ids, *, is_drop=None, uid=True) -> DataProto:
    """Rows with the given response masks; the reward sits on each row's last mask token."""
    mask = torch.tensor(masks, dtype=torch.float32)
    scores = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        on = torch.nonzero(mask[i]).flatten()
        scores[i, int(on[-1]) if len(on) else 0] = r
    tensors = {"response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores.clone()}
    if is_drop is not None:
        tensors["is_drop_mask"] = torch.tensor(is_drop, dtype=torch.bool)
    non_tensors = {"rollout_id_list": np.array(rollout_ids, dtype=object),
                   "data_id_list": np.array(data_ids, dtype=object)}
    if uid:
        non_tensors["uid"] = np.array(data_ids, dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def one_row_rollouts(rewards_by_group: dict[str, list[float]], width: int = 3) -> DataProto:
    """Trajectory-level batch: one row per rollout, rollouts named g{group}-r{k}."""
    rids, dids, rewards = [], [], []
    for g, rs in rewards_by_group.items():
        for k, r in enumerate(rs):
            rids.append(f"{g}-r{k}")
            dids.append(g)
            rewards.append(r)
    return make_batch([[1] * width] * len(rids), rewards, rids, dids)


def rows_of(data: DataProto, rollout_id: str) -> int:
    return int((data.non_tensor_batch["rollout_id_list"] == rollout_id).sum())


# Upstream §7.6 fixture: rows (r1, r1, r2), one group "data-1".
def upstream_batch(rewards=(1.0, 1.0, 3.0)) -> DataProto:
    return make_batch([[1, 1, 0], [1, 0, 0], [1, 1, 1]], list(rewards), ["r1", "r1", "r2"], ["data-1"] * 3)


# ---------------------------------------------------------------------------------------------
# Rollout-level advantage
# ---------------------------------------------------------------------------------------------


def test_rollout_level_advantage_collapses_rollouts_and_broadcasts_rows():  # §7.6
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


def test_rollout_level_advantage_requires_rollout_ids():  # §7.6
    data = upstream_batch()
    data.non_tensor_batch.pop("rollout_id_list")
    with pytest.raises(RuntimeError, match="rollout_id_list"):
        alg.compute_rollout_level_advantage(data, "grpo", num_repeat=2, compute_advantage_fn=lambda d, **k: d)


def test_rollout_level_advantage_rejects_inconsistent_rollout_rewards():  # §7.6
    with pytest.raises(RuntimeError, match="same scalar token_level_rewards"):
        alg.compute_rollout_level_advantage(upstream_batch((1.0, 2.0, 3.0)), "grpo", num_repeat=2,
                                            compute_advantage_fn=lambda d, **k: d)


def test_rollout_level_advantage_rejects_non_scalar_token_advantages():  # §7.6
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


# ---------------------------------------------------------------------------------------------
# Per-rollout normalisation and the per_rollout_mean loss
# ---------------------------------------------------------------------------------------------

MASK_753 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


def _mass(norm: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> float:
    return float((norm * mask)[rows].sum())


def test_normalize_rows_divisor_matches_upstream():  # §7.5
    norm = alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"], num_trained_rows=3,
                                               divisor="rows")
    assert _mass(norm, MASK_753, [0, 1]) == pytest.approx(1 / 3)
    assert _mass(norm, MASK_753, [2]) == pytest.approx(1 / 3)


def test_normalize_rollouts_divisor_gives_each_rollout_one_over_R():
    norm = alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"])
    assert _mass(norm, MASK_753, [0, 1]) == pytest.approx(1 / 2)
    assert _mass(norm, MASK_753, [2]) == pytest.approx(1 / 2)
    # golden per-token values: A has 3 tokens → 1/(3·2); B has 3 tokens → 1/(3·2)
    assert norm[0, 0].item() == pytest.approx(1 / 6) and norm[2, 2].item() == pytest.approx(1 / 6)


def test_normalize_validates_inputs():  # §7.5
    with pytest.raises(ValueError, match="rollout_ids length"):
        alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "B"], num_trained_rows=3)
    with pytest.raises(ValueError, match="num_trained_rows"):
        alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"], num_trained_rows=0,
                                            divisor="rows")
    with pytest.raises(ValueError, match="agl_lab.algorithm.normalize_by"):
        alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"], divisor="tokens")


def test_one_merged_row_equals_its_transition_rows_under_rollouts_divisor():
    # Rollout r1 = two calls of 2 tokens each. Trajectory level: one row with an observation
    # token between them (mask 0). Transition level: two rows. r2 is one 3-token call.
    merged = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    split = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    adv_m = torch.tensor([[2.0], [-1.0]]) * merged
    adv_s = torch.tensor([[2.0], [2.0], [-1.0]]) * split
    n_m = alg.normalize_advantages_by_rollout(adv_m, merged, ["r1", "r2"])
    n_s = alg.normalize_advantages_by_rollout(adv_s, split, ["r1", "r1", "r2"])
    # the same coefficient on every loss token of r1 (2/(4·2)) and r2, in both layouts
    assert n_m[0, 0].item() == n_s[0, 0].item() == n_s[1, 1].item() == pytest.approx(0.25)
    assert _mass(n_m, merged, [0]) == _mass(n_s, split, [0, 1]) == pytest.approx(1.0)
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                          global_batch_info={})
    loss_m, _ = alg.compute_policy_loss_per_rollout_mean(torch.zeros(2, 5), torch.zeros(2, 5), n_m, merged,
                                                         config=cfg)
    loss_s, _ = alg.compute_policy_loss_per_rollout_mean(torch.zeros(3, 5), torch.zeros(3, 5), n_s, split,
                                                         config=cfg)
    assert loss_m.item() == pytest.approx(loss_s.item())
    # AGL v1's rows divisor does not have this property: r1 gets 1/2 merged, 1/3 split
    r_m = alg.normalize_advantages_by_rollout(adv_m, merged, ["r1", "r2"], divisor="rows")
    r_s = alg.normalize_advantages_by_rollout(adv_s, split, ["r1", "r1", "r2"], divisor="rows")
    assert _mass(r_m, merged, [0]) == pytest.approx(1.0) and _mass(r_s, split, [0, 1]) == pytest.approx(2 / 3)


def test_loss_is_registered():  # §7.5
    assert "per_rollout_mean" in core_algos.POLICY_LOSS_REGISTRY
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is alg.compute_policy_loss_per_rollout_mean


def test_reimport_keeps_one_registered_loss():
    mod = importlib.reload(alg)
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is mod.compute_policy_loss_per_rollout_mean
    mod.register_in_worker()  # the Ray hook is a no-op once imported
    mod._register_loss()
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is mod.compute_policy_loss_per_rollout_mean


def test_policy_loss_matches_masked_sum():  # §7.5
    adv = torch.tensor([[0.5, 0.5, 0.0], [-0.2, -0.2, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0,
                          global_batch_info={"dp_size": 2})
    loss, metrics = alg.compute_policy_loss_per_rollout_mean(logp, logp.clone(), adv, mask, config=cfg)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() * 2)
    assert metrics["actor/ppo_kl"] == 0.0
    # through verl's registry, with verl's own actor config
    from verl.workers.config import FSDPActorConfig

    vcfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                           clip_ratio_low=None, clip_ratio_high=None)
    vcfg.global_batch_info["dp_size"] = 2
    loss2, _ = core_algos.get_policy_loss_fn("per_rollout_mean")(
        old_log_prob=logp, log_prob=logp.clone(), advantages=adv, response_mask=mask.bool(),
        loss_agg_mode="token-mean", config=vcfg, rollout_is_weights=None)
    assert loss2.item() == pytest.approx(loss.item())


def test_policy_loss_equals_verl_vanilla_with_token_sum():
    from verl.workers.config import FSDPActorConfig

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 6, generator=g) * 3
    new = old + torch.randn(8, 6, generator=g)  # ratios far outside [0.9, 1.28] and above c = 2
    adv = torch.randn(8, 1, generator=g).expand(8, 6) * 2
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    weights = torch.rand(8, 6, generator=g) + 0.5
    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                          clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.0)
    cfg.global_batch_info["dp_size"] = 3
    ours, m_ours = alg.compute_policy_loss_per_rollout_mean(old, new, adv, mask, config=cfg, rollout_is_weights=weights)
    theirs, m_theirs = core_algos.compute_policy_loss_vanilla(old, new, adv, mask, loss_agg_mode="token-sum",
                                                              config=cfg, rollout_is_weights=weights)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert m_ours == pytest.approx(m_theirs)
    assert 0 < m_ours["actor/pg_clipfrac"] < 1 and m_ours["actor/pg_clipfrac_lower"] > 0


def test_policy_loss_checks_its_config():
    t = torch.zeros(1, 2)
    with pytest.raises(AssertionError, match="requires the actor config"):
        alg.compute_policy_loss_per_rollout_mean(t, t, t, torch.ones(1, 2))
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=1.0)
    with pytest.raises(AssertionError, match="clip_ratio_c must be greater than 1.0, got 1.0"):
        alg.compute_policy_loss_per_rollout_mean(t, t, t, torch.ones(1, 2), config=cfg)


# ---------------------------------------------------------------------------------------------
# Groups and selection for the update
# ---------------------------------------------------------------------------------------------


def three_groups() -> DataProto:
    # z: zero-variance (all 1.0); a, b: mixed rewards. 12 one-row rollouts.
    return one_row_rollouts({"z": [1, 1, 1, 1], "a": [1, 0, 0, 1], "b": [0, 1, 1, 1]})


def test_group_metrics_and_zero_variance_groups():
    data = three_groups()
    assert alg.group_metrics(data) == {"training/n_groups": 3, "training/n_zero_adv_groups": 1}
    assert alg.zero_variance_groups(data) == ["z"]
    data.non_tensor_batch.pop("uid")
    data.non_tensor_batch.pop("data_id_list")
    assert alg.group_metrics(data) == {} and alg.zero_variance_groups(data) == []


def test_alignment_drops_whole_zero_variance_group_first():
    kept, records, metrics = alg.select_for_update(three_groups(), mini_batch_rows=8, seed=0)
    assert len(kept) == 8 and list(kept) == list(range(4, 12))  # group z is rows 0..3
    assert {r["reason"] for r in records} == {"zero_adv_group"} and len(records) == 4
    assert records[0].keys() == {"rollout_id", "data_id", "rows", "reason"}
    assert metrics["training/n_sample_dropped/same_reward"] == 4
    assert metrics["training/n_dropped_groups/zero_adv"] == 1
    assert metrics["training/n_sample_dropped/random"] == 0
    assert metrics["training/n_sample_collected"] == 12 and metrics["training/n_sample_trained"] == 8
    assert metrics["training/skipped_steps"] == 0


def test_alignment_then_random_whole_rollouts_with_seeded_rng():
    # cap: 2 updates of 3 rows → keep 6 of 12: z (4 rows) goes first, then 2 random rollouts
    runs = [alg.select_for_update(three_groups(), mini_batch_rows=3, max_ppo_update_times=2, seed=s)
            for s in (7, 7, 8, 9, 10)]
    for kept, records, metrics in runs:
        assert len(kept) == 6
        assert metrics["training/n_sample_dropped/same_reward"] == 4
        assert metrics["training/n_sample_dropped/random"] == 2
        assert [r["reason"] for r in records] == ["zero_adv_group"] * 4 + ["random"] * 2
    assert list(runs[0][0]) == list(runs[1][0])  # same seed → same drops
    assert len({tuple(k) for k, _, _ in runs}) > 1  # other seeds → other drops


def test_random_policy_ignores_zero_advantage():
    kept, records, metrics = alg.select_for_update(three_groups(), mini_batch_rows=8, seed=3, policy="random")
    assert len(kept) == 8 and {r["reason"] for r in records} == {"random"}
    assert metrics["training/n_dropped_groups/zero_adv"] == 0


def multi_row_batch() -> DataProto:
    # transition level: rollouts with 3, 2, 2, 1, 3, 1 rows in two mixed groups
    sizes = {"a0": 3, "a1": 2, "a2": 2, "b0": 1, "b1": 3, "b2": 1}
    reward = {"a0": 1, "a1": 0, "a2": 1, "b0": 0, "b1": 1, "b2": 1}
    rids = [rid for rid, k in sizes.items() for _ in range(k)]
    return make_batch([[1, 1]] * len(rids), [reward[r] for r in rids], rids, [r[0] for r in rids])


@pytest.mark.parametrize("seed", range(12))
def test_drops_never_cut_a_rollout(seed):
    data = multi_row_batch()  # 12 rows
    kept, records, metrics = alg.select_for_update(data, mini_batch_rows=5, seed=seed)
    ids = data.non_tensor_batch["rollout_id_list"]
    kept_ids = set(ids[kept])
    for rid in kept_ids:
        assert (ids[kept] == rid).sum() == rows_of(data, rid)  # whole rollout kept
    assert {r["rollout_id"] for r in records} == set(ids) - kept_ids
    assert sum(r["rows"] for r in records) == 12 - len(kept)
    assert metrics["training/n_sample_target"] == 10
    assert len(kept) <= 10  # whole-rollout drops may overshoot, never exceed the cap


def test_overshoot_leaves_a_partial_last_mini_batch():
    # four rollouts of 3 rows, mini-batch 5 → target 10; no 3-row rollout fits the 2-row need
    rids = [f"r{k}" for k in range(4) for _ in range(3)]
    data = make_batch([[1]] * 12, [float(k // 6) for k in range(12)], rids, ["g"] * 12)
    kept, records, metrics = alg.select_for_update(data, mini_batch_rows=5, seed=0)
    assert len(kept) == 9 and len(records) == 1 and records[0]["rows"] == 3
    assert metrics["training/n_mini_batches"] == 2
    # a single rollout is never dropped to nothing: its 6 rows are all trained
    one = make_batch([[1]] * 6, [1.0] * 6, ["r"] * 6, ["g"] * 6)
    kept, records, metrics = alg.select_for_update(one, mini_batch_rows=4, seed=0)
    assert len(kept) == 6 and records == [] and metrics["training/n_sample_trained"] == 6


def test_small_batch_is_trained_or_skipped_loudly(caplog):
    data = one_row_rollouts({"a": [1, 0, 1]})
    kept, records, metrics = alg.select_for_update(data, mini_batch_rows=8, small_batch="train")
    assert list(kept) == [0, 1, 2] and records == [] and metrics["training/skipped_steps"] == 0
    with caplog.at_level(logging.WARNING, logger="agl_lab.algorithms"):
        kept, records, metrics = alg.select_for_update(data, mini_batch_rows=8, small_batch="skip")
    assert len(kept) == 0 and metrics["training/skipped_steps"] == 1
    assert [r["reason"] for r in records] == ["small_batch_skip"] * 3
    assert metrics["training/n_sample_dropped/small_batch"] == 3
    assert "skipping this training step" in caplog.text
    with pytest.raises(ValueError, match="agl_lab.algorithm.small_batch"):
        alg.select_for_update(data, mini_batch_rows=8, small_batch="drop")


def test_marked_rows_are_dropped_and_recorded():
    data = make_batch([[1, 1]] * 4, [1, 1, 0, 1], ["r0", "r0", "r1", "r2"], ["g"] * 4,
                      is_drop=[False, True, False, False])
    kept, records, metrics = alg.select_for_update(data, mini_batch_rows=1, seed=0)
    assert list(kept) == [0, 2, 3]
    assert records == [{"rollout_id": "r0", "data_id": "g", "rows": 1, "reason": "marked"}]
    assert metrics["training/n_sample_dropped/marked"] == 1 and metrics["training/n_sample_collected"] == 4


# ---------------------------------------------------------------------------------------------
# The whole chain
# ---------------------------------------------------------------------------------------------


def test_dropped_rollouts_do_not_change_kept_advantages():
    data = one_row_rollouts({"a": [1, 0, 0, 1, 1], "b": [0, 1, 1, 0, 0], "c": [1, 1, 0, 1, 0]})
    full, _ = alg.compute_rollout_level_advantage(one_row_rollouts(
        {"a": [1, 0, 0, 1, 1], "b": [0, 1, 1, 0, 0], "c": [1, 1, 0, 1, 0]}), "grpo", num_repeat=5)
    out, records, metrics = alg.prepare_update_batch(data, mini_batch_rows=4, num_repeat=5, seed=1)
    assert len(out) == 12 and metrics["training/n_sample_dropped/random"] == 3
    full_adv = dict(zip(full.non_tensor_batch["rollout_id_list"], full.batch["advantages"][:, 0].tolist()))
    for rid, a in zip(out.non_tensor_batch["rollout_id_list"], out.batch["rollout_advantages"][:, 0].tolist()):
        assert a == pytest.approx(full_adv[rid])
    # per_rollout_mean normalisation, rollouts divisor: A / (3 tokens × 12 rollouts)
    torch.testing.assert_close(out.batch["advantages"], out.batch["rollout_advantages"] / 36)
    assert metrics["training/n_groups"] == 3 and metrics["critic/n_transition_after_dropping"] == 12


def test_prepare_update_batch_skip_and_vanilla():
    data = one_row_rollouts({"a": [1, 0]})
    out, records, metrics = alg.prepare_update_batch(data, mini_batch_rows=4, num_repeat=2, small_batch="skip")
    assert out is None and metrics["training/skipped_steps"] == 1 and len(records) == 2
    out, _, _ = alg.prepare_update_batch(one_row_rollouts({"a": [1, 0]}), mini_batch_rows=4, num_repeat=2,
                                         loss_mode="vanilla")
    assert "rollout_advantages" not in out.batch.keys()  # vanilla: raw advantages, no normalisation
    # (1 − ½) / unbiased std of (1, 0)
    assert out.batch["advantages"][0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))


def test_rollout_weights_table():
    data = make_batch(MASK_753.tolist(), [1, 1, 3], ["A", "A", "B"], ["g"] * 3)
    data.batch["advantages"] = torch.tensor([[2.0], [2.0], [-1.0]]) * MASK_753
    table = alg.rollout_weights_table(data)
    assert list(table.columns) == ["rollout_id", "data_id", "reward", "advantage", "n_rows", "loss_tokens",
                                   "loss_weight", "signed_weight"]
    assert table.loss_weight.tolist() == pytest.approx([0.5, 0.5])
    assert table.advantage.tolist() == [2.0, -1.0] and table.n_rows.tolist() == [2, 1]
    assert table.loss_tokens.tolist() == [3, 3] and table.reward.tolist() == [1.0, 3.0]
    assert alg.rollout_weights_table(data, divisor="rows").loss_weight.tolist() == pytest.approx([1 / 3, 1 / 3])
    tm = alg.rollout_weights_table(data, loss_mode="vanilla", loss_agg_mode="token-mean")
    assert tm.loss_weight.tolist() == pytest.approx([0.5, 0.5])
    sm = alg.rollout_weights_table(data, loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean")
    assert sm.loss_weight.tolist() == pytest.approx([2 / 3, 1 / 3])  # 2 rows of A vs 1 of B
    # the weights are the coefficients normalize_advantages_by_rollout really applies
    norm = alg.normalize_advantages_by_rollout(data.batch["advantages"], MASK_753, ["A", "A", "B"])
    assert (norm * MASK_753)[:2].sum().item() == pytest.approx(table.signed_weight[0])


def test_gae_without_rollout_level_advantage_needs_a_critic():
    with pytest.raises(ValueError, match="needs critic values"):
        alg.prepare_update_batch(three_groups(), mini_batch_rows=4, adv_estimator="gae", rollout_level_advantage=False)
    # row-level GRPO (AGL's enable_rollout_level_advantage=false): a 2-row rollout counts twice
    data = make_batch([[1, 1]] * 3, [1, 1, 0], ["a", "a", "b"], ["g"] * 3)
    out, _, _ = alg.prepare_update_batch(data, mini_batch_rows=3, rollout_level_advantage=False, loss_mode="vanilla")
    mean, std = 2 / 3, math.sqrt(1 / 3)  # over rows (1, 1, 0)
    assert out.batch["advantages"][2, 0].item() == pytest.approx((0 - mean) / (std + 1e-6))
