"""agl_lab.evaluation / eval_stats: the pass@k estimator on golden numbers, per-task tables on
hand-built rollouts, a tiny-model run's checkpoints evaluated ≡ the run's own validations, the
CLI's one-line errors, and `compare` reading two evaluations paired by task."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from agl_lab import eval_stats
from agl_lab.cli import main
from agl_lab.comparison import compare, plot_compare
from agl_lab.evaluation import Evaluation, EvaluationCurve, evaluate, load_evaluation, write
from agl_lab.logger import read_metrics
from agl_lab.recording import load_validation
from agl_lab.records import CompletedRollout
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

# ---------------------------------------------------------------- the estimator (golden numbers)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),  # no success: nothing to find
        (5, 0, 5, 0.0),
        (5, 5, 3, 1.0),  # c = n
        (5, 2, 1, 2 / 5),  # pass@1 = c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 − C(3,2)/C(5,2)
        (10, 3, 4, 1 - 35 / 210),  # 1 − C(7,4)/C(10,4) = 5/6
        (4, 1, 4, 1.0),  # n − c = 3 < k = 4: every 4-subset holds the success
        (8, 1, 4, 1 - 35 / 70),  # 1 − C(7,4)/C(8,4) = 1/2
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert eval_stats.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(2, 1, 3), (4, 5, 1), (4, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        eval_stats.pass_at_k(n, c, k)


def _rollout(sample_idx: int, reward: float | None, answer: str | None = None) -> CompletedRollout:
    events = [] if answer is None else [{"event_type": "task_result", "data": {"answer": f" {answer} "}}]
    return CompletedRollout(
        f"ro-{sample_idx}", f"task-{sample_idx // 3}", 0, sample_idx, final_reward=reward, events=events
    )


def test_task_table_on_hand_built_rollouts():
    # two tasks × n = 3, listed out of order: task 0 rewards (1, 0, 1), task 1 (0.2, None → 0, 1)
    rollouts = [
        _rollout(4, None, "7"),
        _rollout(0, 1.0, "42"),
        _rollout(2, 1.0, "42"),
        _rollout(1, 0.0, "41"),
        _rollout(3, 0.2, "7"),
        _rollout(5, 1.0, "8"),
    ]
    table = eval_stats.task_table(rollouts, n=3, k=2)
    assert table["rewards"].tolist() == [[1.0, 0.0, 1.0], [0.2, 0.0, 1.0]]
    assert table["c"].tolist() == [2, 1]
    assert table["pass@1"].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert table["pass@2"].tolist() == pytest.approx([1.0, 1 - 1 / 3])  # 1 − C(2,2)/C(3,2)
    assert table["mean@2"].tolist() == pytest.approx([2 / 3, 1.2 / 3])
    # maj@2 over the first two answers: ("42", "41") → a tie, the earliest "42" (a success);
    # ("7", "7") → "7", whose samples failed
    assert table["maj@2"].tolist() == [True, False]
    summary = eval_stats.summarize(table, seed=0)
    assert summary["pass@2"] == pytest.approx((1 + 2 / 3) / 2)
    lo, hi = summary["pass@2 ci"]
    assert lo <= summary["pass@2"] <= hi
    assert summary == eval_stats.summarize(table, seed=0)  # seeded: the same interval again


def test_maj_at_k_is_omitted_with_a_note_when_no_answer_is_recorded():
    table = eval_stats.task_table([_rollout(i, 1.0) for i in range(3)], n=3, k=3)
    summary = eval_stats.summarize(table, seed=0)
    assert summary["maj@3"] is None and summary["pass@3"] == 1.0
    assert any("maj@3 omitted" in note for note in summary["notes"])


def test_a_copy_dropped_unfinished_counts_as_missing_and_unsuccessful():
    # copy 1 of task 0 never finished (the rollout phase's wait timed out): scored at the fill value
    table = eval_stats.task_table([_rollout(0, 1.0), _rollout(2, 1.0)], n=3, k=1, reward_fillna_value=0.0)
    assert table["rewards"].tolist() == [[1.0, 0.0, 1.0]] and table["missing"].tolist() == [1]
    assert table["pass@1"].tolist() == pytest.approx([2 / 3])
    assert eval_stats.summarize(table, seed=0)["missing_rollouts"] == 1


def test_a_success_is_a_reward_at_the_threshold():
    rollouts = [_rollout(0, 0.8), _rollout(1, 0.5), _rollout(2, 0.2)]
    assert eval_stats.task_table(rollouts, n=3, k=1)["c"].tolist() == [0]  # default: reward ≥ 1.0
    assert eval_stats.task_table(rollouts, n=3, k=1, threshold=0.5)["c"].tolist() == [2]


# ---------------------------------------------------------------- a checkpoint ≡ the run's validation


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny model trained 2 steps: validated before training and at step 2, saved at step 2."""
    run = tmp_path_factory.mktemp("run")
    overrides = [
        *SMALL,
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=true",
        f"trainer.default_local_dir={run / 'checkpoints'}",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides, run_dir=run, console=False) as trainer:
        trainer.fit(progress=False)
    return run


@pytest.mark.timeout(600)
def test_evaluating_a_run_with_k_1_is_its_own_validation(tiny_run, tmp_path):
    result = evaluate(tiny_run, k=1, out=tmp_path / "eval", progress=False)
    assert isinstance(result, EvaluationCurve)
    assert result.curve["step"].tolist() == [0, 2] and result.curve["kind"].tolist() == ["base", "checkpoint"]
    logged = {r["step"]: r["val/reward"] for r in read_metrics(tiny_run / "metrics.jsonl") if "val/reward" in r}
    for ev in result.evaluations:
        step = ev.summary["step"]
        recorded = [r.final_reward or 0.0 for r in load_validation(tiny_run, step)]
        assert [rewards[0] for rewards in ev.tasks["rewards"]] == recorded  # rollout by rollout
        assert ev.summary["val/reward"] == pytest.approx(logged[step])
        assert ev.summary["mean@1"] == pytest.approx(logged[step])
        assert ev.summary["n_tasks"] == 4 and ev.summary["k"] == 1
        doc = json.loads(ev.json.read_text())  # the files: summary + one row per task, and the CSV
        assert doc["summary"]["pass@1"] == ev.summary["pass@1"] and len(doc["tasks"]) == 4
        assert pd.read_csv(ev.csv)["reward_0"].tolist() == pytest.approx(recorded)
    assert ev.json.parent == tmp_path / "eval" / "global_step_2"
    assert result.csv.exists() and result.png.exists()


@pytest.mark.timeout(600)
def test_a_checkpoint_with_n_samples_is_deterministic_and_written_beside_it(tiny_run):
    checkpoint = tiny_run / "checkpoints" / "global_step_2"
    first = evaluate(checkpoint, k=2, n=3, seed=5, progress=False)
    assert isinstance(first, Evaluation) and first.json.parent == checkpoint
    assert first.summary["n"] == 3 and first.summary["seed"] == 5
    assert all(len(r) == 3 for r in first.tasks["rewards"])
    again = load_evaluation(checkpoint)  # read back from the directory it was written to
    assert again.tasks["rewards"].tolist() == first.tasks["rewards"].tolist()
    second = evaluate(checkpoint, k=2, n=3, seed=5, progress=False)
    assert second.tasks["rewards"].tolist() == first.tasks["rewards"].tolist()
    assert second.summary["pass@2 ci"] == first.summary["pass@2 ci"]


# ---------------------------------------------------------------- the CLI's errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/no/such/checkpoint"], "is not a checkpoint"),
        (["cpu_tiny", "--k", "4", "--n", "2"], "need 1 ≤ k ≤ n"),
        (["cpu_tiny", "--split", "test"], "--split 'test'"),
        (["cpu_tiny", "--k", "1", "agl_lab.task.n_val=0"], "no val tasks"),  # an override after an option
        (["cpu_tiny", "--task", "nosuch"], "unknown task 'nosuch'"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path):
    assert main(["eval", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()  # progress lines of a model built before the error may precede it
    assert message in err.splitlines()[-1] and "Traceback" not in err, err


def test_cli_refuses_a_lora_adapter_without_a_lora_model(capsys, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    assert main(["eval", str(tmp_path)]) == 2  # no config to build its base from
    assert "name the config of its base model with --config" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--config", "cpu_tiny"]) == 2  # cpu_tiny builds no LoRA layers
    assert "set actor_rollout_ref.model.lora_rank" in capsys.readouterr().err.splitlines()[-1]


def test_cli_names_a_run_without_checkpoints(capsys, tmp_path):
    (tmp_path / "global_step_x").mkdir()
    assert main(["eval", str(tmp_path)]) == 2
    assert "no checkpoints in" in capsys.readouterr().err


# ---------------------------------------------------------------- compare reads evaluations


def _evaluation(rewards: list[list[float]], step: int, kind: str) -> Evaluation:
    rollouts = [_rollout(3 * t + j, r) for t, row in enumerate(rewards) for j, r in enumerate(row)]
    table = eval_stats.task_table(rollouts, n=3, k=1)
    summary = {"model": kind, "kind": kind, "step": step, "task": "lookup", "split": "val", "k": 1}
    return Evaluation(table, {**summary, **eval_stats.summarize(table, seed=0)})


def test_compare_pairs_two_evaluations_by_task(tmp_path):
    write(_evaluation([[0, 0, 1], [0, 0, 0], [1, 1, 1]], 0, "base"), tmp_path / "base")
    trained = write(_evaluation([[1, 1, 1], [0, 1, 0], [1, 1, 1]], 4, "checkpoint"), tmp_path / "trained")
    table = compare([tmp_path / "base", trained.json])
    assert table["step"].tolist() == [0, 4] and table["n_tasks"].tolist() == [3, 3]
    assert table["pass@1 mean"].tolist() == pytest.approx([4 / 9, 7 / 9])
    # per task, trained − base: 2/3, 1/3, 0 → mean 1/3, s.e. = std(ddof 1)/√3 = (1/3)/√3
    assert table["pass@1 diff"].iloc[1] == pytest.approx(1 / 3)
    assert table["pass@1 diff se"].iloc[1] == pytest.approx(1 / 3 / math.sqrt(3))
    assert table["n_pairs"].tolist() == [0, 3]
    assert plot_compare([tmp_path / "base", tmp_path / "trained"], path=tmp_path / "c.png").exists()
