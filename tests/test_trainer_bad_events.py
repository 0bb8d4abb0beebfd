"""One agent's bad events fail its rollout alone: the real Trainer's step goes on.

A token id outside the vocabulary, an empty `prompt_token_ids` and a finite but huge reward
(3.0e38) each used to escape `Trainer.step()` (IndexError, a size mismatch, a misleading
advantage error). Now the rollout is FAILED with the reason, counted in
`training/n_unlearnable_rollouts`, and the step trains on the others.
"""

from __future__ import annotations

import itertools
import threading

import httpx
import pytest
import torch

from agl_lab.tasks.lookup import lookup_agent
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

POISONS = ("token id outside the vocabulary", "empty prompt", "huge reward")


def _bad_call(ctx, prompt: list[int], response: list[int]) -> None:
    """A model_request event as the gateway records it, posted with the rollout's own token."""
    data = {
        "model": "m",
        "request": {"messages": []},
        "http_status": 200,
        "status": "ok",
        "response": {
            "prompt_token_ids": prompt,
            "choices": [{"token_ids": response, "logprobs": {"content": [{"logprob": -0.5} for _ in response]}}],
        },
    }
    r = httpx.post(
        ctx.event_url,
        json={"event_type": "model_request", "data": data},
        headers={"Authorization": f"Bearer {ctx.api_key}"},
        trust_env=False,
    )
    r.raise_for_status()


def poisoning_agent():
    """The lookup agent; its first three rollouts each also send one of POISONS."""
    counter, lock = itertools.count(), threading.Lock()
    poisoned: dict[str, str] = {}

    def agent(task, ctx):
        reward = lookup_agent(task, ctx)
        with lock:
            k = next(counter)
        if k >= len(POISONS):
            return reward
        poisoned[ctx.rollout_id] = POISONS[k]
        if k == 0:
            _bad_call(ctx, [1, 2, 3], [10**6])
        elif k == 1:
            _bad_call(ctx, [], [5, 6])
        else:
            return 3.0e38
        return reward

    agent.poisoned = poisoned
    return agent


@pytest.fixture
def trainer(tmp_path):
    agent = poisoning_agent()
    tr = Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=SMALL, agent=agent, run_dir=tmp_path / "run", console=False
    )
    tr.poisoned = agent.poisoned
    yield tr
    tr.close()


def test_bad_events_fail_their_rollout_alone_and_the_step_trains(trainer):
    before = {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}
    metrics = trainer.step()
    assert trainer.global_step == 1 and metrics["training/n_unlearnable_rollouts"] == 3
    assert metrics["training/n_failed_rollouts"] >= 3
    by_id = {r.rollout_id: r for r in trainer._last_rollout.rollouts}
    why = {
        "token id outside the vocabulary": "outside the vocabulary [0, ",
        "empty prompt": "empty prompt_token_ids",
        "huge reward": "agl_lab.algorithm.max_abs_reward",
    }
    assert sorted(trainer.poisoned.values()) == sorted(POISONS)
    for rid, poison in trainer.poisoned.items():
        rollout = by_id[rid]
        assert rollout.state == "failed" and why[poison] in rollout.error_message, (poison, rollout.error_message)
        assert why[poison] in rollout.metadata["learning_error"] and rollout.triplets == []
    healthy = [r for r in by_id.values() if r.rollout_id not in trainer.poisoned]
    assert len(healthy) == 5 and all("learning_error" not in r.metadata for r in healthy)
    after = trainer.engine.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the others trained
    trainer.step()  # and the run goes on
    assert trainer.global_step == 2


def test_max_abs_reward_is_a_checked_config_key(tmp_path):
    from agl_lab.config import ConfigError, load_config

    assert load_config("configs/cpu_tiny.yaml").agl_lab.algorithm.max_abs_reward == 1e6
    with pytest.raises(ConfigError, match="agl_lab.algorithm.max_abs_reward must be > 0"):
        load_config("configs/cpu_tiny.yaml", ["agl_lab.algorithm.max_abs_reward=0"])
