"""Golden tests of agl_lab.batch on hand-built rollouts (fake tokenizer = space-joined ids).

Covers every rule of the module docstring, AGL v1's tests/verl/test_rollout_adapter.py
(AGL v1's tests/verl/test_rollout_adapter.py; its W&B side tables are in test_logger.py) and the invariances: reordering
rollouts, running twice, trajectory row ≡ last transition row's tokens. Rows and breaks are
read through the DataFrames of `agl_lab.results.BatchResult`, as a notebook reads them.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from agl_lab import batch
from agl_lab.results import BatchResult
from tests.hand_built import R, SpaceTokenizer, T, mixed_rollouts


def build_batch(*args, **kwargs) -> BatchResult:
    """`agl_lab.batch.build_batch` with its record wrapped for the `.rows` / `.breaks` frames."""
    return BatchResult(batch.build_batch(*args, **kwargs))


def rows_of(result, key):
    return result.data.batch[key].tolist()


# =========================================================================== transition level


def test_transition_golden_tensors():
    r1 = R("r1", [T([1, 2], [3]), T([1, 2, 3, 4], [5, 6])], reward=0.7, data_id="g1")
    res = build_batch([r1], "transition", max_prompt_length=4, max_response_length=3, pad_token_id=0)
    assert rows_of(res, "prompts") == [[0, 0, 1, 2], [1, 2, 3, 4]]
    assert rows_of(res, "responses") == [[3, 0, 0], [5, 6, 0]]
    assert rows_of(res, "input_ids") == [[0, 0, 1, 2, 3, 0, 0], [1, 2, 3, 4, 5, 6, 0]]
    assert rows_of(res, "attention_mask") == [[0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert rows_of(res, "position_ids") == [[0, 0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5, 5]]
    # transition: response_mask is the response attention mask
    assert rows_of(res, "response_mask") == [[1, 0, 0], [1, 1, 0]]
    assert rows_of(res, "is_drop_mask") == [False, False]
    scores = res.data.batch["token_level_scores"]
    assert scores.dtype == torch.float32  # deviation: AGL v1 uses bfloat16 (0.7 → 0.69921875)
    assert scores.tolist() == [[np.float32(0.7), 0, 0], [0, np.float32(0.7), 0]]
    np.testing.assert_allclose(res.data.batch["rollout_log_probs"], [[-0.1, 0, 0], [-0.1, -0.1, 0]], rtol=1e-6)
    nt = res.data.non_tensor_batch
    assert list(nt["data_id_list"]) == ["g1", "g1"] and list(nt["uid"]) == ["g1", "g1"]
    assert list(nt["rollout_id_list"]) == ["r1", "r1"]
    assert list(nt["turn_index_list"]) == [0, 1]


def test_metrics_names_and_values():
    rollouts = [
        R("a", [T([1], [2, 3]), T([1, 2, 3, 4], [5])], reward=1.0, sample_idx=0),
        R("b", [T([7], [8, 9, 10, 11])], reward=None, sample_idx=1),
        R("c", [], reward=0.5, sample_idx=2),
    ]
    m = build_batch(
        rollouts, "transition", max_prompt_length=4, max_response_length=3, reward_fillna_value=-1.0
    ).metrics
    assert m == {
        "training/reward": pytest.approx((1.0 - 1.0 + 0.5) / 3),  # averaged over all rollouts
        "training/n_sample": 3,
        "training/n_rollouts": 3,
        "training/n_rollouts_w_trace": 2,
        "training/n_rollouts_w_reward": 2,
        "training/n_failed_rollouts_excluded": 0,
        "training/n_truncated_sample": 1,
        "training/n_skipped_empty_rows": 0,
        "training/n_dropped_prompt_too_long": 0,
        "training/n_rows_without_logprobs": 0,
        "training/n_turns": 3,
        "training/n_repeated_prompt_calls_dropped": 0,
        "response_length/training/avg_by_turn": pytest.approx(7 / 3),
        "response_length/training/max_by_turn": 4,
        "response_length/training/min_by_turn": 1,
    }
    traj = build_batch(rollouts, "trajectory", max_prompt_length=4, max_response_length=8).metrics
    for key in (
        "training/n_unmerged_rollouts",
        "training/n_trace_merge_mismatch_rows",
        "training/merge_breaks/retokenization",
        "training/merge_breaks/template",
        "training/merge_breaks/history_edit",
        "training/merge_breaks/other",
    ):
        assert traj[key] == 0


# =========================================================================== trajectory merge


def test_trajectory_merge_masks_observations():
    r = R("r1", [T([1, 2], [3, 4]), T([1, 2, 3, 4, 5, 6], [7]), T([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])], reward=2.0)
    res = build_batch([r], "trajectory", max_prompt_length=3, max_response_length=10)
    assert len(res.data) == 1
    assert rows_of(res, "prompts") == [[0, 1, 2]]
    assert rows_of(res, "responses") == [[3, 4, 5, 6, 7, 8, 9, 10, 0, 0]]
    assert rows_of(res, "response_mask") == [[1, 1, 0, 0, 1, 0, 1, 1, 0, 0]]
    assert rows_of(res, "attention_mask") == [[0, 1, 1] + [1] * 8 + [0, 0]]  # observations attended
    np.testing.assert_allclose(
        res.data.batch["rollout_log_probs"], [[-0.1, -0.1, 0.0, 0.0, -0.1, 0.0, -0.1, -0.1, 0.0, 0.0]], rtol=1e-6
    )
    assert res.data.batch["token_level_scores"].tolist() == [[0] * 7 + [2.0, 0, 0]]
    assert list(res.data.non_tensor_batch["turn_index_list"]) == [0]
    row = res.rows.iloc[0]
    assert (row.first_call, row.last_call, row.n_calls) == (0, 2, 3)
    assert (row.loss_tokens, row.observation_tokens, row.prompt_tokens) == (5, 3, 2)
    assert res.metrics["training/n_unmerged_rollouts"] == 0 and res.breaks.empty


def test_trajectory_row_equals_last_transition_row():
    calls = [T([5, 6, 7], [8, 9]), T([5, 6, 7, 8, 9, 1], [2, 3, 4]), T([5, 6, 7, 8, 9, 1, 2, 3, 4, 11, 12], [13])]
    r = R("r", calls)
    traj = build_batch([r], "trajectory", max_prompt_length=3, max_response_length=12)
    trans = build_batch([r], "transition", max_prompt_length=12, max_response_length=3)
    t_ids = traj.data.batch["input_ids"][0][traj.data.batch["attention_mask"][0].bool()].tolist()
    last = trans.data.batch["input_ids"][-1][trans.data.batch["attention_mask"][-1].bool()].tolist()
    assert t_ids == last  # same tokens as the full context of the last call
    # model tokens are exactly the transition rows' responses, at their context positions
    full_mask = torch.cat([torch.zeros(3, dtype=torch.long), traj.data.batch["response_mask"][0]])
    model_positions = torch.nonzero(full_mask).flatten().tolist()
    expected = []
    for t in calls:
        expected += list(range(len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)))
    assert [p - 0 for p in model_positions] == expected
    model_tokens = [t_ids[p] for p in expected]
    assert model_tokens == [tok for t in calls for tok in t.response_ids]


def test_merge_break_emits_new_row_and_unmerged_count():
    r = R("r", [T([1], [2]), T([1, 2, 3], [4]), T([9], [10]), T([9, 10], [11])], reward=1.0)
    res = build_batch([r], "trajectory", max_prompt_length=4, max_response_length=4)
    assert rows_of(res, "prompts") == [[0, 0, 0, 1], [0, 0, 0, 9]]
    assert rows_of(res, "responses") == [[2, 3, 4, 0], [10, 11, 0, 0]]
    assert rows_of(res, "response_mask") == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert list(res.data.non_tensor_batch["turn_index_list"]) == [0, 2]
    assert res.metrics["training/n_unmerged_rollouts"] == 1
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 1
    b = res.breaks.iloc[0]
    assert (b.call, b.against_call, b.kind) == (2, 1, "other")
    assert res.metrics["training/merge_breaks/other"] == 1


def test_multi_segment_keeps_interleaved_subagent_chains():
    main1, sub1 = T([1, 2], [3]), T([50, 51], [52])
    main2, sub2 = T([1, 2, 3, 4], [5]), T([50, 51, 52, 53], [54])
    r = R("r", [main1, sub1, main2, sub2])
    single = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4)
    assert len(single.data) == 4 and len(single.breaks) == 3
    multi = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4, multi_segment=True)
    assert rows_of(multi, "prompts") == [[1, 2], [50, 51]]  # ordered by first call
    assert rows_of(multi, "responses") == [[3, 4, 5, 0], [52, 53, 54, 0]]
    assert rows_of(multi, "response_mask") == [[1, 0, 1, 0], [1, 0, 1, 0]]
    assert list(multi.data.non_tensor_batch["turn_index_list"]) == [0, 1]
    assert multi.breaks.call.tolist() == [1]  # only the sub-agent's first call breaks
    assert multi.metrics["training/n_unmerged_rollouts"] == 1


def test_multi_segment_extends_the_longest_matching_context():
    # call 1 re-asks a shorter prompt (not an extension of [1,2,3]) → second segment [1,2]+[3,4];
    # call 2 extends both contexts ([1,2,3] and [1,2,3,4]) → it joins the longer one.
    r = R("r", [T([1], [2, 3]), T([1, 2], [3, 4]), T([1, 2, 3, 4, 5], [6])])
    res = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4, multi_segment=True)
    assert rows_of(res, "prompts") == [[0, 1], [1, 2]]
    assert rows_of(res, "responses") == [[2, 3, 0, 0], [3, 4, 5, 6]]
    assert rows_of(res, "response_mask") == [[1, 1, 0, 0], [1, 1, 0, 1]]
    assert res.rows.n_calls.tolist() == [1, 2]


# =========================================================================== limits and logprobs


def test_prompt_over_limit_is_marked_drop_and_cut_to_head():
    r = R("r", [T([1, 2, 3, 4, 5, 6], [7])])
    res = build_batch([r], "transition", max_prompt_length=4, max_response_length=2)
    assert rows_of(res, "prompts") == [[1, 2, 3, 4]]
    assert rows_of(res, "is_drop_mask") == [True]
    assert res.metrics["training/n_dropped_prompt_too_long"] == 1
    assert res.rows.is_drop.tolist() == [True] and res.rows.tokens_cut.tolist() == [2]


def test_response_over_limit_keeps_head_and_reward_on_last_kept_token():
    # trajectory response = [3, 4(obs), 5(obs), 6] cut to 3 → last kept token is an observation
    r = R("r", [T([1, 2], [3]), T([1, 2, 3, 4, 5], [6])], reward=1.5)
    res = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=3)
    assert rows_of(res, "responses") == [[3, 4, 5]]
    assert rows_of(res, "response_mask") == [[1, 0, 0]]
    assert res.data.batch["token_level_scores"].tolist() == [[0, 0, 1.5]]
    assert res.metrics["training/n_truncated_sample"] == 1
    assert res.rows.truncated.tolist() == [True] and res.rows.tokens_cut.tolist() == [1]


@pytest.mark.parametrize(
    "bad_call",
    [
        T([1, 2, 3, 4], [5], logprobs=None),  # a call without logprobs
        T([1, 2, 3, 4], [5], logprobs=[-0.1, -0.2]),  # length disagrees with the response
    ],
)
def test_row_loses_logprobs_when_any_call_lacks_them(bad_call):
    merged = R("a", [T([1, 2], [3]), bad_call], sample_idx=0)
    clean = R("b", [T([8], [9])], sample_idx=1)
    res = build_batch([merged, clean], "trajectory", max_prompt_length=2, max_response_length=3)
    assert "rollout_log_probs" not in res.data.batch.keys()  # all-or-nothing
    assert res.metrics["training/n_rows_without_logprobs"] == 1
    assert res.rows.has_logprobs.tolist() == [False, True]
    only_clean = build_batch([clean], "trajectory", max_prompt_length=2, max_response_length=3)
    assert "rollout_log_probs" in only_clean.data.batch.keys()


def test_empty_rows_are_skipped_and_zero_rows_raise():
    r = R("r", [T([1], []), T([5], [6])])
    res = build_batch([r], "transition", max_prompt_length=2, max_response_length=2)
    assert len(res.data) == 1 and res.metrics["training/n_skipped_empty_rows"] == 1
    assert res.rows.batch_index.tolist() == [-1, 0] and res.rows.skipped_empty.tolist() == [True, False]
    with pytest.raises(RuntimeError, match="zero training rows: 2 rollouts"):
        build_batch([R("x", [T([1], [])]), R("y", [])], "trajectory", max_prompt_length=2, max_response_length=2)


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="Unknown trace_aggregator_level: 'turn'"):
        build_batch([R("r", [T([1], [2])])], "turn", max_prompt_length=2, max_response_length=2)
    with pytest.raises(ValueError, match="max_response_length must be a positive int"):
        build_batch([R("r", [T([1], [2])])], "trajectory", max_prompt_length=2, max_response_length=0)


# =========================================================================== invariances


def _snapshot(res):
    tensors = {k: v.tolist() for k, v in res.data.batch.items()}
    non = {k: list(v) for k, v in res.data.non_tensor_batch.items()}
    return tensors, non, res.metrics, res.rows.to_dict("list"), res.breaks.to_dict("list")


def test_reordering_rollouts_does_not_change_the_batch():
    rollouts = mixed_rollouts()
    reference = _snapshot(
        build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5, tokenizer=SpaceTokenizer())
    )
    shuffled = rollouts[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != rollouts
    again = _snapshot(
        build_batch(shuffled, "trajectory", max_prompt_length=3, max_response_length=5, tokenizer=SpaceTokenizer())
    )
    assert again == reference
    # carry-overs from an older step come first
    assert build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5).rows.rollout_id.tolist()[
        :3
    ] == ["r0", "r2", "r4"]


def test_build_batch_does_not_mutate_inputs():
    rollouts = mixed_rollouts()
    before = copy.deepcopy(rollouts)
    first = _snapshot(build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5))
    assert rollouts == before  # AGL v1 extended the first triplet's logprob list in place
    assert _snapshot(build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5)) == first
