"""The rollout stage's passes over what it collected (`rollout.finish_collected`), on hand-built
rollouts: no server needed (the managers that collect them: test_rollout.py)."""

from __future__ import annotations

import pytest

from agl_lab.records import CompletedRollout, Triplet
from agl_lab.rollout import finish_collected


def _rollouts() -> list[CompletedRollout]:
    """Two rollouts of one task; "b" sampled token 99, outside a vocabulary of 10."""
    times = dict(enqueue_time=0.0, finished_at=3.0)
    return [
        CompletedRollout("a", "d", 0, 0, triplets=[Triplet([1, 2], [3], [-0.1])], running_at=1.0, **times),
        CompletedRollout("b", "d", 0, 0, copy_idx=1, triplets=[Triplet([1, 2], [99], [-0.1])], running_at=2.0, **times),
    ]


def test_an_unlearnable_rollout_is_failed_before_the_failures_are_counted():
    a, b = rollouts = _rollouts()
    metrics = finish_collected(rollouts, vocab_size=10, max_abs_reward=1e6, step=3, is_train=True)
    assert (a.state, b.state) == ("succeeded", "failed") and b.triplets == []
    assert "outside the vocabulary" in b.metadata["learning_error"]
    assert metrics["training/n_unlearnable_rollouts"] == 1
    assert metrics["training/n_failed_rollouts"] == 1  # pass 3 sees what pass 1 failed
    assert metrics["training/n_rerun_rollouts"] == 0
    # pass 2, training only: queue wait 1 and 2 s, run 2 and 1 s, total 3 s each
    assert metrics["timing/rollout_queue_wait_s/max"] == pytest.approx(2.0)
    assert metrics["timing/rollout_total_s/max"] == pytest.approx(3.0)


def test_validation_gets_no_lifecycle_times_and_val_keys():
    metrics = finish_collected(_rollouts(), vocab_size=None, max_abs_reward=1e6, step=3, is_train=False)
    assert metrics == {"val/n_unlearnable_rollouts": 0, "val/n_failed_rollouts": 0, "val/n_rerun_rollouts": 0}
