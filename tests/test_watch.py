"""agl_lab.watch: a run that cannot learn says so early, with the fix.

The Trainer-level path (an agent + dataset on the untrained tiny model warns at build time and
after 3 flat steps) runs for real in tests/test_readme.py; here the streak rules, exactly.
"""

from __future__ import annotations

import logging

from agl_lab.watch import FlatRewardWatch, untrained_tiny_model_message


def test_flat_rewards_warn_once_after_three_steps_in_a_row(caplog):
    watch = FlatRewardWatch(3)
    with caplog.at_level(logging.WARNING, logger="agl_lab.watch"):
        assert watch.observe(1, [0.0, 0.0, 0.0, 0.0]) is None
        assert watch.observe(2, [0.0, 0.5, 0.0, 0.0]) is None  # rewards vary: the streak restarts
        assert watch.observe(3, [0.0] * 4) is None
        assert watch.observe(4, [0.0] * 4) is None
        message = watch.observe(5, [0.0] * 4)
        assert watch.observe(6, [0.0] * 4) is None  # once
    assert message.startswith("steps 3–5: every rollout got reward 0.000, 3 steps in a row")
    assert "dry_run" in message and "advantage 0" in message
    assert [r.getMessage() for r in caplog.records] == [message]


def test_a_streak_needs_the_same_reward_every_step():
    watch = FlatRewardWatch(3)
    for step, value in enumerate([1.0, 0.0, 1.0, 0.0], start=1):
        assert watch.observe(step, [value] * 4) is None  # each step flat, but not the same reward
    assert watch.observe(5, [0.0] * 4) is None and watch.observe(6, [0.0] * 4) is not None


def test_flat_nonzero_reward_names_the_reward_and_the_untrained_tiny_model_names_the_warm_start():
    watch = FlatRewardWatch(2)
    watch.observe(1, [1.0, 1.0])
    assert "same score" in watch.observe(2, [1.0, 1.0])
    tiny = FlatRewardWatch(2, untrained_tiny=True)
    tiny.observe(1, [0.0, 0.0])
    assert "no warm start" in tiny.observe(2, [0.0, 0.0])


def test_untrained_tiny_model_message_only_without_a_warm_start():
    assert untrained_tiny_model_message(tiny=True, warm_start_steps=200, has_demonstrations=True) is None
    assert untrained_tiny_model_message(tiny=False, warm_start_steps=0, has_demonstrations=False) is None
    assert "warm_start_steps=0" in untrained_tiny_model_message(tiny=True, warm_start_steps=0, has_demonstrations=True)
    msg = untrained_tiny_model_message(tiny=True, warm_start_steps=200, has_demonstrations=False)
    assert "without demonstrations" in msg and "agl_lab.model.preset=smollm2-135m" in msg


def _rollouts(kind: str, n: int = 4):
    from agl_lab.records import CompletedRollout

    make = {
        "failed": dict(state="failed", final_reward=None, error_message="ValueError: reward 'ok' is not a number"),
        "missing": dict(state="succeeded", final_reward=None),
        "zero": dict(state="succeeded", final_reward=0.0),
    }
    return [
        CompletedRollout(rollout_id=f"{kind}{k}", data_id="d", step=0, sample_idx=k, **make[kind]) for k in range(n)
    ]


def test_the_flat_reward_warning_tells_failures_missing_rewards_and_unparseable_replies_apart():
    messages = {}
    for kind in ("failed", "missing", "zero"):
        watch = FlatRewardWatch(3)
        for step in (1, 2, 3):
            message = watch.observe_rollouts(step, _rollouts(kind))
        messages[kind] = message
    assert "12 of 12 rollouts FAILED (first error: ValueError: reward 'ok' is not a number)" in messages["failed"]
    assert "exclude_failed_rollouts=true" in messages["failed"] and "do not parse" in messages["failed"]
    assert "not replies that do not parse" in messages["failed"]
    assert "12 of 12 rollouts ended without a reward" in messages["missing"]
    assert "FAILED" not in messages["missing"]
    assert "most likely do not parse" in messages["zero"] and "FAILED" not in messages["zero"]
    mixed = FlatRewardWatch(1)
    message = mixed.observe_rollouts(1, _rollouts("failed", 1) + _rollouts("missing", 1) + _rollouts("zero", 2))
    assert "1 of 4 rollouts FAILED" in message and "1 of 4 rollouts ended without a reward" in message
    assert "the other 2 earned that reward themselves" in message
