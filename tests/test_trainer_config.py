"""Issue #12: AGL/verl config keys the Trainer honours on the local engine, end to end on CPU.

Real tiny model, real gateway, real agents; tasks written to parquet/JSONL files in the test.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from agl_lab.config import ConfigError
from agl_lab.data import load_task_files
from agl_lab.engines.tiny import tiny_model_dir
from agl_lab.tasks import get_task
from agl_lab.trainer import Trainer

SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "agl_lab.task.n_train=16",
    "agl_lab.task.n_val=4",
    "agl_lab.runner.concurrency=8",
    "agl_lab.model.warm_start_steps=0",
]


def lookup_tasks(n: int, seed: int = 0) -> list[dict]:
    # each task carries its own `data_id` (a dataset row id), which must reach the agent intact
    return [{**t, "data_id": f"row-{i}"} for i, t in enumerate(get_task("lookup").train_tasks(n, seed=seed))]


def write_parquet(path, rows) -> str:
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------------------------------------
# data.train_files / val_files
# ---------------------------------------------------------------------------------------------


def test_task_files_load_one_dict_per_row_from_parquet_and_jsonl(tmp_path):
    rows = lookup_tasks(3)
    from_parquet = load_task_files(write_parquet(tmp_path / "t.parquet", rows), "data.train_files")
    from_jsonl = load_task_files([write_jsonl(tmp_path / "t.jsonl", rows)], "data.train_files")
    assert from_parquet == rows == from_jsonl
    assert all(type(r["table"]) is dict for r in from_parquet)  # JSON-native values, as AGL sends them


def test_task_file_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.val_files: task file .*nope\.parquet"):
        load_task_files(str(tmp_path / "nope.parquet"), "data.val_files")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1"}, {"q": "2+2"}])
    with pytest.raises(KeyError, match=r"data\.train_files: row 1 .* has no column 'question'"):
        load_task_files(path, "data.train_files", ["question"])


def test_env_map_columns_are_required_of_every_task_file_row(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1"}])  # no `result` column
    with pytest.raises(KeyError, match=r"data\.train_files: row 0 .* has no column 'result'"):
        Trainer.from_config("tests/fixtures/agl_calc_x.yaml", [f"data.train_files={path}"], console=False,
                            run_dir=tmp_path / "run")


def test_agent_class_without_tasks_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"agent_class is set but there are no tasks.*data\.train_files"):
        Trainer.from_config("configs/cpu_tiny.yaml", [*SMALL, "agentlightning.local.agent_class=pkg.mod:Agent"],
                            run_dir=tmp_path / "run", console=False)


def test_a_hub_id_as_model_path_is_a_clear_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path='Qwen/Qwen2\.5-1\.5B-Instruct' is not a "
                                          r"local Hugging Face model directory"):
        Trainer.from_config("configs/cpu_tiny.yaml", [*SMALL, "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct"],
                            run_dir=tmp_path / "run", console=False)


def test_files_model_path_and_unbounded_wait_train_one_step(tmp_path):
    """data.train_files (parquet) + val_files (JSONL) + actor_rollout_ref.model.path (a local HF
    directory) + agl_lab.rollout.wait_timeout_seconds=null, one real step on the local engine."""
    train = write_parquet(tmp_path / "train.parquet", lookup_tasks(8))
    val = write_jsonl(tmp_path / "val.jsonl", lookup_tasks(2, seed=1))
    model_dir = tiny_model_dir(seed=0)
    overrides = [*SMALL, f"data.train_files={train}", f"data.val_files={val}",
                 f"actor_rollout_ref.model.path={model_dir}", "agl_lab.rollout.wait_timeout_seconds=null"]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides, run_dir=tmp_path / "run", console=False) as tr:
        assert len(tr.train_dataset) == 8 and len(tr.val_dataset) == 2
        assert tr.engine.model_name == model_dir.name  # the configured model, not the built-in default
        ro = tr.rollout()
        assert {r.input["data_id"] for r in ro.rollouts} <= {f"row-{i}" for i in range(8)}  # kept intact
        assert len({r.data_id for r in ro.rollouts}) == 4  # one fresh group per task
        u = tr.update(tr.build_batch(ro))
        assert not u.skipped
        assert not [k for k in u.metrics if "*" in k]
