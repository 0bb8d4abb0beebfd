"""DataFrame views: golden frames on hand-built rollouts, agreement with build_batch, and the
BatchResult frames."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from agl_lab import batch
from agl_lab.records import CompletedRollout, Triplet
from agl_lab.results import BatchResult
from agl_lab.views import breaks_df, groups_df, lifecycle_df, rows_df, triplets_df


def build_batch(*args, **kwargs) -> BatchResult:
    return BatchResult(batch.build_batch(*args, **kwargs))


class SpaceTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def server(version):
    return {"server": {"model": "tiny", "version": version}}


@pytest.fixture
def rollouts():
    a = CompletedRollout(
        "a",
        "g1",
        step=0,
        sample_idx=0,
        final_reward=1.0,
        triplets=[
            Triplet([1, 2], [3], [-0.1], metadata=server(0)),
            Triplet([1, 2, 3, 4], [5, 6], [-0.1, -0.2], reward=1.0, metadata=server(1)),
        ],
        enqueue_time=100.0,
        running_at=101.5,
        finished_at=104.0,
    )
    b = CompletedRollout(
        "b",
        "g1",
        step=0,
        sample_idx=0,
        final_reward=1.0,
        triplets=[Triplet([7, 8, 9], [10], None), Triplet([11], [12, 13, 14, 15], [-0.1] * 4, reward=1.0)],
        enqueue_time=100.0,
        running_at=None,
        finished_at=103.0,
        state="failed",
    )
    c = CompletedRollout("c", "g2", step=0, sample_idx=1, final_reward=None, triplets=[Triplet([20], [21], [-0.3])])
    d = CompletedRollout("d", "g2", step=0, sample_idx=1, final_reward=0.5, triplets=[])
    return [d, c, b, a]  # completion order: views sort like the batch


def test_triplets_df_golden(rollouts):
    df = triplets_df(rollouts)
    assert list(df.columns) == [
        "rollout_id",
        "data_id",
        "call",
        "prompt_tokens",
        "response_tokens",
        "reward",
        "has_logprobs",
        "server_version",
        "repeats_dropped",
    ]
    assert df.rollout_id.tolist() == ["a", "a", "b", "b", "c"]
    assert df.call.tolist() == [0, 1, 0, 1, 0]
    assert df.prompt_tokens.tolist() == [2, 4, 3, 1, 1]
    assert df.response_tokens.tolist() == [1, 2, 1, 4, 1]
    assert df.has_logprobs.tolist() == [True, True, False, True, True]
    assert df.server_version.tolist()[:2] == [0, 1] and df.server_version.isna().tolist()[2:] == [True] * 3


def test_rows_df_golden_and_equal_to_batch_rows(rollouts):
    result = build_batch(rollouts, "trajectory", max_prompt_length=2, max_response_length=3, tokenizer=SpaceTokenizer())
    df = rows_df(rollouts, result)
    pd.testing.assert_frame_equal(df, result.rows)
    pd.testing.assert_frame_equal(rows_df(rollouts, result.built), result.rows)
    assert result.rows is result.rows  # cached
    planned = rows_df(rollouts, level="trajectory", max_prompt_length=2, max_response_length=3)
    pd.testing.assert_frame_equal(planned, result.rows)
    assert df.rollout_id.tolist() == ["a", "b", "b", "c"]
    assert df[["first_call", "last_call", "n_calls"]].values.tolist() == [[0, 1, 2], [0, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert df.prompt_tokens.tolist() == [2, 2, 1, 1]  # b's first prompt (3 tokens) cut to 2
    assert df.response_tokens.tolist() == [3, 1, 3, 1]  # a: [3,4,5,6] truncated to 3; b: 4 → 3
    assert df.loss_tokens.tolist() == [2, 1, 3, 1] and df.observation_tokens.tolist() == [1, 0, 0, 0]
    assert df.is_drop.tolist() == [False, True, False, False]
    assert df.truncated.tolist() == [True, False, True, False]
    assert df.tokens_cut.tolist() == [1, 1, 1, 0]
    assert df.has_logprobs.tolist() == [True, False, True, True]
    assert df.reward.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert df.batch_index.tolist() == [0, 1, 2, 3]


def test_breaks_df_equal_to_batch_breaks(rollouts):
    result = build_batch(rollouts, "trajectory", max_prompt_length=4, max_response_length=8, tokenizer=SpaceTokenizer())
    df = breaks_df(rollouts, tokenizer=SpaceTokenizer())
    pd.testing.assert_frame_equal(df, result.breaks)
    assert df[["rollout_id", "call", "against_call", "kind"]].values.tolist() == [["b", 1, 0, "other"]]
    assert df.previous_trace.tolist() == ["7 8 9 10"] and df.current_trace.tolist() == ["11 12 13 14 15"]
    assert breaks_df(rollouts[:1]).empty and "kind" in breaks_df(rollouts[:1]).columns


def test_groups_df_zero_adv_and_rows(rollouts):
    result = build_batch(rollouts, "transition", max_prompt_length=4, max_response_length=4)
    df = groups_df(rollouts, result, reward_fillna_value=0.0)
    assert df.data_id.tolist() == ["g1", "g2"]
    assert df.n_rollouts.tolist() == [2, 2]
    assert df.rewards.tolist() == [[1.0, 1.0], [0.0, 0.5]]  # c has no reward → fill value
    assert df.reward_mean.tolist() == [1.0, 0.25] and df.reward_std.tolist() == [0.0, 0.25]
    assert df.zero_adv.tolist() == [True, False]
    assert df.n_rows.tolist() == [4, 1]  # transition: one row per call; d has no calls
    assert groups_df(rollouts).n_rows.tolist() == [3, 1]  # planned at trajectory level
    pd.testing.assert_frame_equal(result.groups, df)


def test_lifecycle_df_spans_and_missing_timestamps(rollouts):
    df = lifecycle_df(rollouts).set_index("rollout_id")
    assert df.loc["a", ["queue_wait_s", "run_s", "total_s"]].tolist() == [1.5, 2.5, 4.0]
    assert math.isnan(df.loc["b", "queue_wait_s"]) and math.isnan(df.loc["b", "run_s"])
    assert df.loc["b", "total_s"] == 3.0 and df.loc["b", "state"] == "failed"
    assert df.loc["c", ["queue_wait_s", "run_s", "total_s"]].isna().all()


def test_groups_df_a_group_of_one_has_advantage_unless_its_reward_is_zero():
    """verl's GRPO gives a group of one mean 0, std 1: A = reward (#12)."""
    one = CompletedRollout(
        "s", "g1", step=0, sample_idx=0, final_reward=1.0, triplets=[Triplet([1], [2], [-0.1], reward=1.0)]
    )
    nil = CompletedRollout(
        "z", "g2", step=0, sample_idx=1, final_reward=0.0, triplets=[Triplet([1], [3], [-0.1], reward=0.0)]
    )
    assert groups_df([one, nil]).zero_adv.tolist() == [False, True]


def test_trainer_results_decode_the_text_of_every_call_and_row(tmp_path):
    from agl_lab.trainer import Trainer
    from tests.trainer_runs import SMALL

    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL, run_dir=tmp_path, console=False) as t:
        ro = t.rollout()
        b = t.build_batch(ro)
        tok = t.tokenizer
        first = ro.rollouts[0].triplets[0]
    tri = ro.triplets
    assert {"prompt_tail", "response_text"} <= set(tri.columns) and {"prompt_tail", "response_text"} <= set(
        b.rows.columns
    )
    row = tri[(tri.rollout_id == ro.rollouts[0].rollout_id) & (tri.call == 0)].iloc[0]
    assert row.response_text == tok.decode(first.response_ids, skip_special_tokens=False)
    assert tok.decode(first.prompt_ids, skip_special_tokens=False).endswith(row.prompt_tail)
    assert 0 < len(row.prompt_tail) <= 80
    assert b.rows.response_text.str.len().gt(0).all()
