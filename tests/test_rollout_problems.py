"""Rollouts that train on a reward they never earned are loud (issue 36): a FAILED rollout (the
default trains it with agentlightning.reward_fillna_value, as Agent Lightning does) and a rollout
that ends without a reward each get a warning per step, a metric and a console mark — on the
real Trainer with the tiny model and the lookup agent."""

from __future__ import annotations

import itertools
import logging
import threading

from agl_lab.logger import format_console_line
from agl_lab.tasks.lookup import lookup_agent
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


def _agent(mode: str):
    """The lookup agent; after its model calls, every other rollout raises or returns None."""
    counter, lock = itertools.count(), threading.Lock()

    def agent(task, ctx):
        reward = lookup_agent(task, ctx)
        with lock:
            k = next(counter)
        if k % 2:
            return reward
        if mode == "raise":
            raise RuntimeError("the tool server went away after the model call")
        return None  # no reward, no reward event

    return agent


def _step(tmp_path, mode, caplog, *overrides):
    with caplog.at_level(logging.WARNING, logger="agl_lab.rollout_problems"):
        with Trainer.from_config(
            "configs/cpu_tiny.yaml",
            overrides=[*SMALL, *overrides],
            agent=_agent(mode),
            run_dir=tmp_path / mode,
            console=False,
        ) as tr:
            metrics = tr.step()
            batch = tr._last_batch
    return metrics, batch, [r.getMessage() for r in caplog.records if r.name == "agl_lab.rollout_problems"]


def test_failed_rollouts_that_train_are_said_every_step(tmp_path, caplog):
    metrics, batch, messages = _step(tmp_path, "raise", caplog)
    assert metrics["training/n_failed_rollouts"] == 4 and metrics["training/n_failed_rollouts_trained"] == 4
    assert len(messages) == 1
    assert messages[0].startswith(
        "step 1: 4 of 8 rollouts FAILED and are trained with reward 0 (agentlightning.reward_fillna_value"
    )
    assert "the tool server went away" in messages[0]
    assert "agl_lab.algorithm.exclude_failed_rollouts=true" in messages[0]
    assert "failed_trained 4" in format_console_line(1, metrics)
    assert "failed_trained" not in format_console_line(1, {**metrics, "training/n_failed_rollouts_trained": 0})


def test_excluded_failures_are_not_said_to_train(tmp_path, caplog):
    metrics, batch, messages = _step(tmp_path, "raise", caplog, "agl_lab.algorithm.exclude_failed_rollouts=true")
    assert metrics["training/n_failed_rollouts_excluded"] == 4 and metrics["training/n_failed_rollouts_trained"] == 0
    assert messages == []


def test_a_rollout_without_a_reward_warns_and_is_counted(tmp_path, caplog):
    metrics, batch, messages = _step(tmp_path, "none", caplog)
    assert metrics["training/n_missing_reward_rollouts"] == 4 and metrics["training/n_failed_rollouts"] == 0
    assert len(messages) == 1 and "4 of 8 rollouts ended without a reward" in messages[0]
    assert "trained with reward 0 (agentlightning.reward_fillna_value)" in messages[0]
    assert "no_reward 4" in format_console_line(1, metrics)
