"""The validation stage's `val/*` metrics (AGL v1's `get_test_metrics`) on hand-built rollouts."""

from __future__ import annotations

import pytest

from agl_lab.validation import build_validation, validation_metrics
from tests.hand_built import R, SpaceTokenizer, T


def test_validation_metrics_names_and_values():
    rollouts = [
        R(
            f"vr{i}",
            [T([i], [i + 10]), T([i, i + 10, i + 20], [i + 30])],
            reward=float(i),
            data_id=f"d{i}",
            step=31,
            sample_idx=i - 1,
        )
        for i in range(1, 8)
    ]
    val = build_validation(rollouts, 0.0, SpaceTokenizer())
    assert val.metrics == {
        "val/reward": 4.0,
        "val/n_rollouts": 7,
        "val/n_rollouts_w_trace": 7,
        "val/n_rollouts_w_reward": 7,
        "val/mean_response_length_per_turn": 1.0,
        "val/mean_total_response_length_per_rollout": 2.0,
        "val/turn_count": 2.0,
    }
    assert validation_metrics(rollouts, 0.0) == val.metrics
    assert len(val.trajectories) == 7
    assert val.trajectories[0] == {"rollout_id": "vr1", "reward": 1.0, "prompt": "1 11 21", "response": "31"}


def test_validation_without_trace_raises_and_fills_missing_rewards():
    with pytest.raises(RuntimeError, match="zero validation rollouts with model calls"):
        validation_metrics([R("a", [])], 0.0)
    m = validation_metrics([R("a", [T([1], [2, 3])], reward=None), R("b", [], reward=1.0, sample_idx=1)], -1.0)
    assert m["val/reward"] == 0.0 and m["val/n_rollouts_w_trace"] == 1 and m["val/n_rollouts_w_reward"] == 1
    assert m["val/mean_total_response_length_per_rollout"] == 2.0
