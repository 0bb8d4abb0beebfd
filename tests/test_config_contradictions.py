"""Settings that contradict each other fail at load naming the keys, or warn where both can be meant."""

from __future__ import annotations

import warnings

import pytest

from agl_lab.config import ConfigError, ConfigWarning, load_config
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


def _warnings_of(overrides: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("configs/cpu_tiny.yaml", overrides)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_runner_off_with_the_embedded_server_warns_naming_both_keys():
    (message,) = [m for m in _warnings_of(["agl_lab.runner.enabled=false"]) if "agl_lab.runner.enabled" in m]
    assert "agl_lab.server.embedded=true" in message and "nothing runs the agents" in message
    assert not [
        m
        for m in _warnings_of(["agl_lab.runner.enabled=false", "agl_lab.server.embedded=false"])
        if "nothing runs the agents" in m
    ]


def test_excluded_failed_rollouts_with_a_fill_value_warns_naming_both_keys():
    found = _warnings_of(["agl_lab.algorithm.exclude_failed_rollouts=true", "agentlightning.reward_fillna_value=-1"])
    (message,) = [m for m in found if "reward_fillna_value" in m]
    assert "agl_lab.algorithm.exclude_failed_rollouts=true" in message
    assert not [m for m in _warnings_of(["agl_lab.algorithm.exclude_failed_rollouts=true"]) if "fillna" in m]


def test_validation_without_validation_tasks_fails_or_warns(tmp_path):
    with pytest.raises(
        ConfigError, match=r"trainer.val_only=true but there are no validation tasks.*agl_lab.task.n_val"
    ):
        Trainer.from_config(
            "configs/cpu_tiny.yaml",
            [*SMALL, "agl_lab.task.n_val=0", "trainer.val_only=true"],
            run_dir=tmp_path / "a",
            console=False,
        )
    with pytest.warns(ConfigWarning, match=r"trainer.val_before_train=true and trainer.test_freq=2 validate nothing"):
        trainer = Trainer.from_config(
            "configs/cpu_tiny.yaml",
            [*SMALL, "agl_lab.task.n_val=0", "trainer.val_before_train=true", "trainer.test_freq=2"],
            run_dir=tmp_path / "b",
            console=False,
        )
    trainer.close()


def test_a_mini_batch_larger_than_a_step_warns_with_the_numbers_and_the_value_to_set():
    # issue 36's study: n=8 × 4 tasks keeps cpu_tiny's ppo_mini_batch_size=8 (tasks) — it is clamped
    found = _warnings_of(["actor_rollout_ref.rollout.n=8", "data.train_batch_size=4"])
    (message,) = [m for m in found if "ppo_mini_batch_size=8" in m]
    assert "counts tasks" in message and "8 × 8 = 64 rollouts is asked for but a step has 4 × 8 = 32" in message
    assert "set actor_rollout_ref.actor.ppo_mini_batch_size=4" in message.lower()
    assert not [
        m
        for m in _warnings_of(
            [
                "actor_rollout_ref.rollout.n=8",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            ]
        )
        if "counts tasks" in m
    ]
    # what the warning says happens: the step's 32 rows are one mini-batch, not 64
    import agl_lab.algorithms as alg
    from tests.algo_batches import one_row_rollouts

    data = one_row_rollouts({f"t{k}": [0.0, 1.0] * 4 for k in range(4)})  # 4 tasks × n=8, trajectory level
    _, _, metrics = alg.prepare_update_batch(data, mini_batch_rows=8 * 8, loss_mode="vanilla")
    assert metrics["training/n_sample_trained"] == 32 and metrics["training/n_mini_batches"] == 1
