"""agl_lab.algorithms.selection and the whole chain (`prepare_update_batch`).

Pins the improvements over AGL v1: zero-advantage groups first, whole-rollout drops,
seeded RNG, no silent skip.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import agl_lab.algorithms as alg
from tests.algo_batches import make_batch, multi_row_batch, one_row_rollouts, rows_of, three_groups


def test_alignment_drops_whole_zero_advantage_group_first():
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
    runs = [
        alg.select_for_update(three_groups(), mini_batch_rows=3, max_ppo_update_times=2, seed=s)
        for s in (7, 7, 8, 9, 10)
    ]
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
    data = make_batch(
        [[1, 1]] * 4, [1, 1, 0, 1], ["r0", "r0", "r1", "r2"], ["g"] * 4, is_drop=[False, True, False, False]
    )
    kept, records, metrics = alg.select_for_update(data, mini_batch_rows=1, seed=0)
    assert list(kept) == [0, 2, 3]
    assert records == [{"rollout_id": "r0", "data_id": "g", "rows": 1, "reason": "marked"}]
    assert metrics["training/n_sample_dropped/marked"] == 1 and metrics["training/n_sample_collected"] == 4


def test_dropped_rollouts_do_not_change_kept_advantages():
    data = one_row_rollouts({"a": [1, 0, 0, 1, 1], "b": [0, 1, 1, 0, 0], "c": [1, 1, 0, 1, 0]})
    full, _ = alg.compute_rollout_level_advantage(
        one_row_rollouts({"a": [1, 0, 0, 1, 1], "b": [0, 1, 1, 0, 0], "c": [1, 1, 0, 1, 0]}), "grpo", num_repeat=5
    )
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
    out, _, _ = alg.prepare_update_batch(
        one_row_rollouts({"a": [1, 0]}), mini_batch_rows=4, num_repeat=2, loss_mode="vanilla"
    )
    assert "rollout_advantages" not in out.batch.keys()  # vanilla: raw advantages, no normalisation
    # (1 − ½) / unbiased std of (1, 0)
    assert out.batch["advantages"][0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))


# ---------------------------------------------------------------------------------------------
# Issue #12: zero advantage is decided from the computed advantages; group metrics on the
# trained batch (AGL's meaning) plus `*_collected` before the alignment drops.
# ---------------------------------------------------------------------------------------------


def _grpo_opts(**kw):
    return dict(adv_estimator="grpo", num_repeat=4, seed=0, **kw)


def test_single_rollout_group_has_an_advantage_and_is_not_dropped_as_zero_adv():
    """A group with one rollout (siblings failed before their first call): verl's GRPO gives it
    mean 0, std 1, so A = reward = 1. It must not be dropped in favour of A = 0 rollouts."""
    # s: one rollout, reward 1 (A = 1); z: zero-advantage group of 4 (A = 0); a: mixed, 4 rollouts
    data = one_row_rollouts({"s": [1.0], "z": [1, 1, 1, 1], "a": [1, 0, 0, 1]})  # 9 rows
    prepared, records, metrics = alg.prepare_update_batch(data, mini_batch_rows=4, **_grpo_opts())
    kept_ids = set(prepared.non_tensor_batch["rollout_id_list"])
    assert "s-r0" in kept_ids  # the rollout with an advantage stays
    assert {r["rollout_id"] for r in records} <= {f"z-r{k}" for k in range(4)} | {"a-r0", "a-r1", "a-r2", "a-r3"}
    assert all(r["reason"].startswith("zero_adv") for r in records if r["rollout_id"].startswith("z"))
    assert metrics["training/n_zero_adv_groups_collected"] == 1  # z only: s has A = 1
    assert metrics["training/n_groups_collected"] == 3


def test_zero_advantage_groups_reads_advantages_when_present():
    data = one_row_rollouts({"s": [1.0], "z": [1, 1]})
    # AGL's reward rule counts the lone rollout of reward 1 (verl gives it A = 1); agl_lab's does not
    assert alg.zero_advantage_groups(data, rule="agl") == ["s", "z"]
    assert alg.zero_advantage_groups(data) == ["z"]  # before advantages: bitwise-equal rewards
    data, _ = alg.compute_advantages(data, adv_estimator="grpo", num_repeat=2)
    assert alg.zero_advantage_groups(data) == ["z"]  # after: A = 0 on every loss token: the rules agree


def test_group_metrics_count_the_trained_batch_and_collected_separately():
    # 12 one-row rollouts, mini-batch 8: z (zero adv) is dropped whole → trained: a, b
    prepared, _, metrics = alg.prepare_update_batch(three_groups(), mini_batch_rows=8, **_grpo_opts())
    assert metrics["training/n_groups_collected"] == 3 and metrics["training/n_zero_adv_groups_collected"] == 1
    assert metrics["training/n_groups"] == 2 and metrics["training/n_zero_adv_groups"] == 0


# ---------------------------------------------------------------------------------------------
# Parity switches (agl_lab.parity): AGL v1's drop order and bf16 rewards
# ---------------------------------------------------------------------------------------------


def test_agl_drop_order_drops_same_reward_rows_before_advantages_and_may_cut_a_rollout():
    # one same-reward group z of 3 rows, mini-batch 2: one of its rows goes (a row, not a rollout)
    same = make_batch([[1, 1]] * 3, [1, 1, 1], ["z0", "z0", "z1"], ["z"] * 3)
    kept, records, metrics = alg.agl_alignment(same, mini_batch_rows=2)
    assert len(kept) == 2 and metrics["training/n_sample_dropped/same_reward"] == 1
    # 5 rows in mixed groups, mini-batch 2: one row goes at random, possibly part of a rollout
    batch = multi_row_batch().select_idxs(list(range(5)))  # a0 (3 rows), a1 (2 rows); rewards 1, 0
    cut = [alg.agl_alignment(batch, mini_batch_rows=2, seed=s) for s in range(8)]
    assert all(len(k) == 4 and m["training/n_sample_dropped/random"] == 1 for k, _, m in cut)
    assert {r["rows"] for _, recs, _ in cut for r in recs} == {1}  # one row of a multi-row rollout


def test_prepare_update_batch_with_agl_order_computes_advantages_after_the_drops():
    # group s has one rollout (reward 1); AGL's reward rule calls it "same reward" and drops it first
    data = one_row_rollouts({"s": [1.0], "a": [1, 0, 0, 1]})  # 5 rows, mini-batch 4
    prepared, records, metrics = alg.prepare_update_batch(data, mini_batch_rows=4, drop_order="agl", **_grpo_opts())
    assert [r["rollout_id"] for r in records] == ["s-r0"] and records[0]["reason"] == "same_reward"
    assert len(prepared) == 4 and metrics["training/n_groups"] == 1
    with pytest.raises(ValueError, match=r"agl_lab\.parity\.drop_order='later'"):
        alg.prepare_update_batch(data, mini_batch_rows=4, drop_order="later", **_grpo_opts())


@pytest.mark.parametrize("drop_order", alg.DROP_ORDERS)
def test_the_marked_drop_is_counted_on_the_built_batch_under_either_drop_order(drop_order):
    # 6 rows, 2 marked: both orders report the batch as built (AGL v1's order once reported 4 and 0)
    data = make_batch(
        [[1, 1]] * 6,
        [1, 1, 0, 1, 0, 1],
        ["r0", "r0", "r1", "r2", "r3", "r4"],
        ["g"] * 3 + ["h"] * 3,
        is_drop=[False, True, False, False, True, False],
    )
    _, records, metrics = alg.prepare_update_batch(data, mini_batch_rows=2, num_repeat=3, drop_order=drop_order)
    assert [r["reason"] for r in records if r["reason"] == "marked"] == ["marked", "marked"]
    assert metrics["training/n_sample_collected"] == 6 and metrics["training/n_sample_dropped/marked"] == 2


def test_bf16_rewards_reproduce_agls_precision():
    data = one_row_rollouts({"a": [0.1, 0.3]})
    prepared, _, _ = alg.prepare_update_batch(
        data, mini_batch_rows=2, bf16_rewards=True, loss_mode="vanilla", **_grpo_opts()
    )
    assert prepared.batch["token_level_scores"].dtype == torch.bfloat16
    # bf16(0.1) = 0.10009765625, bf16(0.3) = 0.30078125 (8 bits of mantissa)
    assert float(prepared.batch["token_level_scores"].double().sum()) == 0.10009765625 + 0.30078125
