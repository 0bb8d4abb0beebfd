"""agl_lab.update.run_update: the update stage as one straight line over the Engine contract.

A recording engine (a real `Engine` subclass with no model) logs every call: a training
step is pause → prepare → update → sync_weights, selection runs once, and a skipped step
makes no engine call and is reported once (a metric and one log line, no print).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import agl_lab.algorithms
import agl_lab.algorithms.selection
from agl_lab.config import load_config
from agl_lab.engines.base import Engine
from agl_lab.update import run_update
from tests.algo_batches import make_batch, one_row_rollouts


class RecordingEngine(Engine):
    """Implements the Engine contract; records `(method, args)` and trains nothing."""

    model_name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.version = 0
        self.updated: Any = None

    @property
    def policy_version(self) -> int:
        return self.version

    def endpoints(self) -> list[str]:
        self.calls.append(("endpoints", None))
        return []

    def pause(self, timeout: float | None = None) -> None:
        self.calls.append(("pause", timeout))

    def resume(self) -> None:
        self.calls.append(("resume", None))

    def abort(self) -> int:
        self.calls.append(("abort", None))
        return 0

    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        self.calls.append(("prepare", len(data)))
        return super().prepare(data)  # the contract's default: old logprobs via compute_log_probs

    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> Any:
        self.calls.append(("compute_log_probs", temperature))
        return torch.zeros_like(data.batch["response_mask"])

    def update(self, data: Any) -> dict[str, float]:
        self.calls.append(("update", len(data)))
        self.updated = data
        return {"actor/pg_loss": 0.0}

    def sync_weights(self) -> None:
        self.calls.append(("sync_weights", None))
        self.version += 1

    def save(self, path: str) -> None:
        self.calls.append(("save", path))

    def load(self, path: str) -> None:
        self.calls.append(("load", path))


def config(**overrides: Any):
    base = {
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.rollout.temperature": 0.7,
        "agl_lab.rollout.drain_timeout_seconds": 12,
    }
    return load_config("configs/cpu_tiny.yaml", [f"{k}={v}" for k, v in {**base, **overrides}.items()])


def names(engine: RecordingEngine) -> list[str]:
    return [name for name, _ in engine.calls]


@pytest.fixture
def selections(monkeypatch) -> list[int]:
    """Counts calls of `select_for_update`, wherever the update stage reaches it from."""
    calls: list[int] = []
    original = agl_lab.algorithms.selection.select_for_update

    def counted(data, **kwargs):
        calls.append(len(data))
        return original(data, **kwargs)

    monkeypatch.setattr(agl_lab.algorithms, "select_for_update", counted)
    monkeypatch.setattr(agl_lab.algorithms.pipeline, "select_for_update", counted)
    monkeypatch.setattr(agl_lab.algorithms.selection, "select_for_update", counted)
    return calls


def test_a_training_step_is_one_straight_line(selections):
    # 12 one-row rollouts in 3 groups, mini-batch 2 tasks × n=4 = 8 rows: group z goes first
    data = one_row_rollouts({"z": [1, 1, 1, 1], "a": [1, 0, 0, 1], "b": [0, 1, 1, 1]})
    engine = RecordingEngine()
    result = run_update(config(), engine, SimpleNamespace(data=data, step=3), step=3)
    assert names(engine) == ["pause", "prepare", "compute_log_probs", "update", "sync_weights", "resume"]
    assert engine.calls[0] == ("pause", 12.0)  # bounded by agl_lab.rollout.drain_timeout_seconds
    assert engine.calls[1] == ("prepare", 12) and engine.calls[2] == ("compute_log_probs", 0.7)
    assert engine.calls[3] == ("update", 8)
    assert selections == [12]  # selection ran once, on the whole prepared batch
    assert not result.skipped and result.policy_version == 1
    assert result.metrics["training/policy_version"] == 1 and result.metrics["training/skipped_steps"] == 0
    assert {f"timing_s/{k}" for k in ("old_log_prob", "adv", "update_actor", "update_weights")} <= set(result.metrics)
    assert len(result.weights) == 8 and set(result.dropped.reason) == {"zero_adv_group"}
    assert "old_log_probs" in engine.updated.batch.keys() and "rollout_advantages" in engine.updated.batch.keys()
    assert "old_log_probs" not in data.batch.keys()  # the caller's batch is not mutated


@pytest.mark.parametrize(
    "overrides, setting",
    [
        ({"agl_lab.algorithm.small_batch": "skip"}, "agl_lab.algorithm.small_batch='skip'"),
        ({"agl_lab.parity.drop_order": "agl"}, "agl_lab.parity.drop_order='agl'"),  # small_batch stays 'train'
    ],
)
def test_a_small_batch_skip_names_the_setting_that_made_it(overrides, setting, selections, caplog):
    # 3 rows < one mini-batch of 8: the warning names the key the user set, not the rule's internal value
    data = one_row_rollouts({"a": [1, 0, 1]})
    with caplog.at_level(logging.WARNING):
        result = run_update(config(**overrides), RecordingEngine(), SimpleNamespace(data=data, step=2), step=2)
    assert result.skipped
    (line,) = [r.getMessage() for r in caplog.records if "is skipped" in r.getMessage()]
    assert setting in line and ("small_batch='skip'" in line) == ("small_batch" in setting)
    assert line.startswith("step 3 is skipped")  # the batch of 0-based step 2 is the console's step 3


@pytest.mark.parametrize("case", ["small_batch_skip", "all_marked"])
def test_a_skipped_step_makes_no_training_call_and_is_reported_once(case, selections, caplog, capsys):
    if case == "small_batch_skip":  # 3 rows < one mini-batch of 8 rows, small_batch=skip
        data, cfg = one_row_rollouts({"a": [1, 0, 1]}), config(**{"agl_lab.algorithm.small_batch": "skip"})
    else:  # every row marked by the batch builder: skipped whatever small_batch says
        data, cfg = make_batch([[1, 1]] * 2, [1, 0], ["r0", "r1"], ["g", "g"], is_drop=[True, True]), config()
    engine = RecordingEngine()
    with caplog.at_level(logging.INFO):
        result = run_update(cfg, engine, SimpleNamespace(data=data, step=5), step=5)
    assert names(engine) == ["resume"] and selections == []  # only: serve again
    assert result.skipped and result.metrics["training/skipped_steps"] == 1 and result.weights.empty
    assert result.metrics["training/n_sample_trained"] == 0
    expected = {"small_batch_skip": ["small_batch_skip"] * 3, "all_marked": ["marked", "marked"]}[case]
    assert list(result.dropped.reason) == expected
    skip_lines = [r for r in caplog.records if "skipped" in r.getMessage() or "skipping" in r.getMessage()]
    assert len(skip_lines) == 1 and skip_lines[0].name == "agl_lab.update"
    assert skip_lines[0].levelno == logging.WARNING and "step 6 is" in skip_lines[0].getMessage()  # console: 1-based
    assert capsys.readouterr().out == ""  # no print


def test_a_batch_off_the_schema_is_refused_before_any_engine_call(selections):
    from agl_lab.engines.base import BATCH_SCHEMA

    engine = RecordingEngine()
    data = one_row_rollouts({"a": [1, 0, 1, 0], "b": [0, 1, 1, 1]})
    data.batch.pop("response_mask")
    with pytest.raises(ValueError, match=r"'response_mask' is missing \(written by batch.build_batch"):
        run_update(config(), engine, SimpleNamespace(data=data, step=0), step=0)
    data = one_row_rollouts({"a": [1, 0, 1, 0], "b": [0, 1, 1, 1]})
    data.batch["token_level_scores"] = data.batch["token_level_scores"].long()
    r = data.batch["response_mask"].shape[1]  # R: the response_mask's width
    data.batch["rollout_log_probs"] = torch.zeros(len(data), r + 1)
    with pytest.raises(ValueError) as err:
        run_update(config(), engine, SimpleNamespace(data=data, step=0), step=0)
    assert "'token_level_scores' has dtype int64, expected float32 or bfloat16" in str(err.value)
    assert f"'rollout_log_probs' has shape [8, {r + 1}], expected [N, R] = [8, {r}]" in str(err.value)
    assert engine.calls == [] and selections == []
    assert {k for k, spec in BATCH_SCHEMA.items() if spec.required} == {
        "response_mask",
        "token_level_scores",
        "rollout_id_list",
        "data_id_list",
    }


def test_an_engine_error_inside_the_update_still_resumes_the_engine(selections):
    class FailingEngine(RecordingEngine):
        def update(self, data: Any) -> dict[str, float]:
            super().update(data)
            raise RuntimeError("worker died")

    data = one_row_rollouts({"a": [1, 0, 1, 0], "b": [0, 1, 1, 1]})
    engine = FailingEngine()
    with pytest.raises(RuntimeError, match="worker died"):
        run_update(config(), engine, SimpleNamespace(data=data, step=0), step=0)
    assert names(engine) == ["pause", "prepare", "compute_log_probs", "update", "resume"]  # no sync, but serving


def test_bypass_mode_takes_the_sampling_logprobs_without_a_forward(selections):
    data = one_row_rollouts({"a": [1, 0, 1, 0], "b": [0, 1, 1, 1]})
    data.batch["rollout_log_probs"] = torch.full_like(data.batch["response_mask"], -0.5)
    engine = RecordingEngine()
    engine.bypass_mode = True
    run_update(config(), engine, SimpleNamespace(data=data, step=0), step=0)
    assert names(engine) == ["pause", "prepare", "update", "sync_weights", "resume"]
    assert torch.all(engine.updated.batch["old_log_probs"] == -0.5)
