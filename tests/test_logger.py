"""The metrics logger: console line, metrics.jsonl, and AGL v1's W&B side tables.

The W&B tables (AGL v1's tests/verl/test_rollout_adapter.py) run against a
fake W&B module and run (`FakeWandb`, `FakeRun`: tests/fake_wandb.py); one test
checks that the real `wandb.Table` / `wandb.Artifact` accept what we pass.
"""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from agl_lab.batch import build_batch
from agl_lab.logger import MISMATCH_COLUMNS, MetricsLogger, log_batch_tables, read_metrics
from agl_lab.results import BatchResult
from agl_lab.validation import build_validation
from tests.fake_wandb import FakeArtifact, FakeRun, FakeTable, FakeWandb
from tests.hand_built import R, SpaceTokenizer, T


def _adapter(rollouts) -> BatchResult:
    return BatchResult(
        build_batch(
            rollouts,
            "trajectory",
            max_prompt_length=4,
            max_response_length=3,
            pad_token_id=0,
            tokenizer=SpaceTokenizer(),
        )
    )


def _log(run, result, step, split, wandb_module=FakeWandb):
    log_batch_tables(run, result, step, split, tokenizer=SpaceTokenizer(), wandb_module=wandb_module)


# =========================================================================== console and jsonl


def test_log_writes_one_json_line_and_no_tables_without_wandb(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, console=True)
    logger.log(3, {"training/reward": 0.5, "actor/pg_loss": float("nan")})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "training/reward": 0.5, "actor/pg_loss": None}]
    assert "step    3 | reward 0.500" in capsys.readouterr().out
    logger.log_tables(3, _adapter([R("r1", [T([1], [2]), T([9], [10])])]))  # W&B off: nothing to do
    assert logger.wandb_run is None


def test_console_line_shows_the_logprob_gap_not_the_probability_gap():
    from agl_lab.logger import format_console_line

    line = format_console_line(1, {"training/rollout_logprobs_diff_max": 0.25, "training/rollout_probs_diff_max": 0.75})
    assert "lp_diff_max 0.250" in line and "0.750" not in line


def test_console_line_keeps_the_magnitude_of_small_numbers():
    from agl_lab.logger import format_console_line

    line = format_console_line(
        2,
        {
            "training/rollout_logprobs_diff_max": 4e-5,
            "actor/pg_loss": -1.234e-6,
            "actor/entropy": 0.0,
            "training/reward": 0.338,
            "training/n_sample_dropped/alignment": 4,
        },
    )
    assert "lp_diff_max 4.0e-05" in line and "pg_loss -1.2e-06" in line
    assert "entropy 0 " in line + " " and "reward 0.338" in line and "dropped_rows 4" in line


# =========================================================================== AGL v1's W&B side tables


def test_trajectory_prefix_mismatch_uploads_trace_merge_table_to_wandb():
    r = R("r1", [T([1], [2]), T([9], [10])], reward=0.5, data_id="data-1", step=17)
    res = _adapter([r])
    assert res.metrics["training/n_unmerged_rollouts"] == 1
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 1
    assert res.data.batch["prompts"].tolist() == [[0, 0, 0, 1], [0, 0, 0, 9]]
    assert res.data.batch["responses"].tolist() == [[2, 0, 0], [10, 0, 0]]
    assert res.data.batch["response_mask"].tolist() == [[1, 0, 0], [1, 0, 0]]
    run = FakeRun()
    _log(run, res, 17, "train")
    [(step, table)] = run.tables("training/trace_merge_mismatches")
    assert step == 17 and table.columns == MISMATCH_COLUMNS
    assert table.columns[0] == "global_steps" and table.columns[-2:] == ["previous_trace", "current_trace"]
    assert table.data == [[17, "r1", "data-1", 1, False, False, True, 1, 1, 2, 2, "1 2", "9 10"]]


def test_trajectory_prefix_mismatch_table_is_capped_at_100():
    r = R("r1", [T([10 * i + 1], [10 * i + 2]) for i in range(103)], data_id="data-1", step=3)
    res = _adapter([r])
    run = FakeRun()
    _log(run, res, 3, "train")
    [(_, table)] = run.tables("training/trace_merge_mismatches")
    assert len(table.data) == 100 and len(res.breaks) == 102  # the DataFrame keeps every break
    assert table.data[0][3] == 1 and table.data[-1][3] == 100
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 100
    assert res.metrics["training/n_merge_breaks"] == 102


def _read_zip(blob):
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        names = zf.namelist()
        assert all(info.compress_type == zipfile.ZIP_DEFLATED for info in zf.infolist())
        return names, [json.loads(line) for line in zf.read(names[0]).decode().splitlines()]


def test_training_step_uploads_24_compact_rollout_trajectories_to_wandb_zip():
    rollouts = [
        R(
            f"r{i}",
            [T([i], [i + 100]), T([i, i + 100, i + 200], [i + 300])],
            reward=float(i),
            data_id=f"d{i}",
            step=23,
            sample_idx=i - 1,
        )
        for i in range(1, 27)
    ]
    res = _adapter(rollouts)
    run = FakeRun()
    _log(run, res, 23, "train")
    [(step, table)] = run.tables("training/rollout_trajectories")
    assert step == 23
    assert table.columns == ["global_steps", "trajectory_artifact", "trajectory_artifact_path", "row_count"]
    assert table.data == [[23, "train-trajectories-fake-run-step-23", "step_23/train_trajectories.jsonl.zip", 24]]
    [artifact] = run.artifacts
    assert (artifact.name, artifact.type) == ("train-trajectories-fake-run-step-23", "train_trajectories")
    assert artifact.metadata == {"global_steps": 23, "row_count": 24, "format": "jsonl.zip"}
    assert list(artifact.files) == ["step_23/train_trajectories.jsonl.zip"]
    names, records = _read_zip(artifact.files["step_23/train_trajectories.jsonl.zip"])
    assert names == ["train_trajectories.jsonl"]
    assert [r["rollout_id"] for r in records] == [f"r{i}" for i in range(1, 25)]
    assert all(set(r) == {"rollout_id", "reward", "prompt", "response"} for r in records)
    assert records[0] == {"rollout_id": "r1", "reward": 1.0, "prompt": "1 101 201", "response": "301"}
    assert records[-1] == {"rollout_id": "r24", "reward": 24.0, "prompt": "24 124 224", "response": "324"}


def test_validation_uploads_all_compact_rollout_trajectories_to_wandb_zip():
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
    run = FakeRun()
    _log(run, val, 31, "validation")
    assert run.tables("training/trace_merge_mismatches") == []
    [(step, table)] = run.tables("val/rollout_trajectories")
    assert table.data == [
        [31, "validation-trajectories-fake-run-step-31", "step_31/validation_trajectories.jsonl.zip", 7]
    ]
    [artifact] = run.artifacts
    assert artifact.type == "validation_trajectories" and artifact.metadata["row_count"] == 7
    names, records = _read_zip(artifact.files["step_31/validation_trajectories.jsonl.zip"])
    assert names == ["validation_trajectories.jsonl"] and len(records) == 7
    assert records[0] == {"rollout_id": "vr1", "reward": 1.0, "prompt": "1 11 21", "response": "31"}
    assert records[-1] == {"rollout_id": "vr7", "reward": 7.0, "prompt": "7 17 27", "response": "37"}


def test_log_batch_tables_with_real_wandb_objects(tmp_path, monkeypatch):
    """The real `wandb.Table` / `wandb.Artifact` accept what we pass (no run, no network)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path))
    wandb = pytest.importorskip("wandb")
    r = R("r1", [T([1], [2]), T([9], [10])], reward=0.5, data_id="data-1", step=5)
    run = FakeRun()
    run.id = "odd/id:1"
    _log(run, _adapter([r]), 5, "train", wandb_module=wandb)
    [(_, table)] = run.tables("training/trace_merge_mismatches")
    assert isinstance(table, wandb.Table) and table.data[0][:4] == [5, "r1", "data-1", 1]
    [artifact] = run.artifacts
    assert artifact.name == "train-trajectories-odd_id_1-step-5"
    assert list(artifact.manifest.entries) == ["step_5/train_trajectories.jsonl.zip"]
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        _log(run, _adapter([r]), 5, "val", wandb_module=wandb)


def test_log_batch_tables_failure_warns_and_continues():
    class BrokenRun(FakeRun):
        def log_artifact(self, artifact):
            raise ConnectionError("wandb unreachable")

    run = BrokenRun()
    res = _adapter([R("r1", [T([1], [2])])])
    with pytest.warns(UserWarning, match="W&B upload for step 4 failed: ConnectionError"):
        _log(run, res, 4, "train")
    assert len(run.tables("training/trace_merge_mismatches")) == 1  # the table went out first
    with pytest.raises(TypeError, match="needs the BatchResult"):
        _log(run, build_validation([R("r1", [T([1], [2])])]), 4, "train")


def test_logger_with_wandb_on_uploads_the_tables_to_its_run(tmp_path, monkeypatch):
    """`MetricsLogger.log_tables` sends a result to the logger's own W&B run."""
    import sys
    import types

    fake = types.SimpleNamespace(Table=FakeTable, Artifact=FakeArtifact, init=lambda **kwargs: FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, console=False, wandb_mode="offline")
    run = logger.wandb_run
    logger.log_tables(2, _adapter([R("r1", [T([1], [2]), T([9], [10])])]), tokenizer=SpaceTokenizer())
    logger.log(2, {"training/reward": 1.0})
    assert [step for step, _ in run.tables("training/trace_merge_mismatches")] == [2]
    assert run.tables("training/rollout_trajectories")[0][1].data[0][-1] == 1
    assert run.logged[-1] == (2, {"training/reward": 1.0})
    logger.close()
    assert run.finished
