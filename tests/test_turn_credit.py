"""Turn credit (`agl_lab.algorithm.turn_credit: return`): each transition its discounted return.

A hand-made group of two two-turn rollouts with known turn rewards goes events → triplets →
transition rows → verl's own GRPO estimator (row level); the advantages are checked exactly.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import agl_lab.algorithms as alg
from agl_lab import config as config_mod
from agl_lab.algorithms.credit import (
    discounted_returns,
    task_emits_no_turn_rewards,
    unused_turn_credit_at_load,
    unused_turn_credit_at_step,
)
from agl_lab.batch import build_batch
from agl_lab.records import CompletedRollout, triplets_from_events
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

GAMMA = 0.5


def _call(prompt: list[int], response: list[int]) -> dict:
    return {
        "event_type": "model_request",
        "data": {"prompt_token_ids": prompt, "response_token_ids": response, "response_log_probs": None},
    }


def _turn(reward: float) -> dict:
    return {"event_type": "turn_reward", "data": {"turn": 0, "reward": reward}}


def _two_turn_rollout(rollout_id: str, copy_idx: int, r0: float, r1: float) -> CompletedRollout:
    """system+obs0 → reply [7, 8]; obs1 [9]; → reply [10]: two calls, a turn reward after each."""
    events = [_call([1, 2, 3], [7, 8]), _turn(r0), _call([1, 2, 3, 7, 8, 9], [10]), _turn(r1)]
    triplets = triplets_from_events(events)
    return CompletedRollout(
        rollout_id, "task-0", 0, 0, copy_idx=copy_idx, triplets=triplets, final_reward=r0 + r1, input={}
    )


def test_discounted_returns():
    assert discounted_returns([0.0, 1.0], 0.5) == [0.5, 1.0]
    assert discounted_returns([1.0, None, 2.0], 1.0) == [3.0, 2.0, 2.0]
    assert discounted_returns([], 0.9) == []


def test_turn_reward_events_land_on_the_call_before_them_and_earlier_ones_are_ignored():
    events = [_turn(5.0), _call([1], [2]), _turn(0.25), _turn(0.5), _call([1, 2, 3], [4])]
    first, second = triplets_from_events(events)
    assert first.turn_reward == 0.75 and second.turn_reward is None


def test_a_two_turn_group_gets_each_transitions_return_and_verls_grpo_advantages_exactly():
    a = _two_turn_rollout("a", 0, 0.0, 1.0)  # G = [0.0 + 0.5·1.0, 1.0] = [0.5, 1.0]
    b = _two_turn_rollout("b", 1, 0.5, 0.0)  # G = [0.5, 0.0]
    built = build_batch(
        [a, b],
        "transition",
        max_prompt_length=8,
        max_response_length=4,
        turn_credit="return",
        turn_gamma=GAMMA,
    )
    assert [r.reward for r in built.rows] == [0.5, 1.0, 0.5, 0.0]
    assert built.metrics["training/turn_credit/n_rollouts_without_turn_rewards"] == 0

    alg.fill_reward_defaults(built.data)  # no KL in the reward: token_level_rewards = the scores
    out, _ = alg.compute_advantages(built.data, rollout_level=False, adv_estimator="grpo", num_repeat=2)
    returns = torch.tensor([0.5, 1.0, 0.5, 0.0], dtype=torch.float64)
    mean, std = returns.mean(), returns.std()  # verl: torch.std (unbiased) over the group's rows
    expected = (returns - mean) / (std + 1e-6)
    assert math.isclose(float(std), math.sqrt(1 / 6), rel_tol=1e-12)
    mask = out.batch["response_mask"].bool()
    adv = out.batch["advantages"]
    for i in range(4):
        values = adv[i][mask[i]]
        assert values.numel() > 0
        assert torch.allclose(values.double(), expected[i].expand(values.numel()), rtol=0, atol=1e-6)
        assert bool((adv[i][~mask[i]] == 0).all())  # nothing outside the row's own tokens
    assert float(adv[0][mask[0]][0]) == 0.0 and float(adv[2][mask[2]][0]) == 0.0  # G = the mean: exactly 0


def test_the_default_credits_every_row_with_the_rollouts_reward():
    a, b = _two_turn_rollout("a", 0, 0.0, 1.0), _two_turn_rollout("b", 1, 0.5, 0.0)
    built = build_batch([a, b], "transition", max_prompt_length=8, max_response_length=4)
    assert [r.reward for r in built.rows] == [1.0, 1.0, 0.5, 0.5]
    assert "training/turn_credit/n_rollouts_without_turn_rewards" not in built.metrics


def test_a_rollout_without_turn_rewards_keeps_its_reward_and_is_counted():
    triplets = triplets_from_events([_call([1], [2]), _call([1, 2, 3], [4])])
    plain = CompletedRollout("c", "task-0", 0, 0, triplets=triplets, final_reward=0.75, input={})
    built = build_batch([plain], "transition", max_prompt_length=8, max_response_length=4, turn_credit="return")
    assert [r.reward for r in built.rows] == [0.75, 0.75]
    assert built.metrics["training/turn_credit/n_rollouts_without_turn_rewards"] == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agl_lab.algorithm.turn_credit=return"], "trace_aggregator.level=transition"),
        (
            ["agl_lab.algorithm.turn_credit=return", "agentlightning.trace_aggregator.level=transition"],
            "enable_rollout_level_advantage=false",
        ),
        (["agl_lab.algorithm.turn_credit=steps"], "turn_credit"),
        (["agl_lab.algorithm.turn_gamma=1.5"], "turn_gamma"),
    ],
)
def test_the_config_says_what_turn_credit_return_needs(overrides, message):
    with pytest.raises(config_mod.ConfigError, match=message):
        config_mod.load_config("configs/cpu_tiny.yaml", overrides)


def test_a_valid_turn_credit_config_reaches_the_batch_options():
    cfg = config_mod.load_config(
        "configs/cpu_tiny.yaml",
        [
            "agl_lab.algorithm.turn_credit=return",
            "agl_lab.algorithm.turn_gamma=0.9",
            "agentlightning.trace_aggregator.level=transition",
            "algorithm.enable_rollout_level_advantage=false",
        ],
    )
    options = config_mod.batch_options(cfg)
    assert options["turn_credit"] == "return" and options["turn_gamma"] == 0.9


RETURN_CREDIT = [
    "agl_lab.algorithm.turn_credit=return",
    "agentlightning.trace_aggregator.level=transition",
    "algorithm.enable_rollout_level_advantage=false",
]


def test_which_built_in_tasks_are_known_to_emit_no_turn_rewards():
    assert task_emits_no_turn_rewards("lookup") and task_emits_no_turn_rewards("calc_chain")
    assert task_emits_no_turn_rewards("reasoning_gym:chain_sum")
    assert not task_emits_no_turn_rewards("gem:game:GuessTheNumber-v0-easy")
    assert not task_emits_no_turn_rewards("my_tasks:echo")  # a task of yours: only the step can tell
    assert unused_turn_credit_at_load("rollout", "lookup", own_agent=True) is None
    assert unused_turn_credit_at_load("return", "lookup", own_agent=False) is None  # your agent may emit them
    assert "task 'lookup'" in unused_turn_credit_at_load("return", "lookup", own_agent=True)
    assert unused_turn_credit_at_step("lookup", 1, 0, 8) is None
    assert "step 3: 2 of 8 rollouts of task 'x'" in unused_turn_credit_at_step("x", 3, 2, 8)


def test_turn_credit_return_on_lookup_warns_at_load_and_once_at_the_first_step(tmp_path, caplog):
    """The README demo's task emits no turn rewards: `return` would silently equal `rollout`."""
    with caplog.at_level(logging.WARNING, logger="agl_lab.trainer"):
        with Trainer.from_config(
            "configs/cpu_tiny.yaml", overrides=[*SMALL, *RETURN_CREDIT], run_dir=tmp_path / "run", console=False
        ) as trainer:
            at_load = [r.getMessage() for r in caplog.records if "turn_credit=return" in r.getMessage()]
            assert at_load == [
                "agl_lab.algorithm.turn_credit=return does nothing on task 'lookup': its agent emits no "
                "turn_reward event, so every row carries the rollout's reward, as under turn_credit=rollout "
                "(docs/environments.md lists the tasks that emit turn rewards)"
            ]
            first = trainer.step()
            second = trainer.step()
    lines = [r.getMessage() for r in caplog.records if "turn_credit=return: step" in r.getMessage()]
    assert len(lines) == 1  # once, at the first step that shows it
    assert lines[0].startswith("agl_lab.algorithm.turn_credit=return: step 1: 8 of 8 rollouts of task 'lookup'")
    for metrics in (first, second):
        assert metrics["training/turn_credit/n_rollouts_without_turn_rewards"] == 8
