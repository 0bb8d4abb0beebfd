"""What the Trainer-level tests share: the small settings and the task files of a run.

Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL, ...)   # 4 tasks × n=2, no warm start
write_parquet(tmp_path / "train.parquet", lookup_tasks(16))          # data.train_files
read_recording(run_dir)                                              # {step: recording/step_N.json.gz}
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd

from agl_lab.tasks import get_task

# The small, warm-start-free Trainer settings (on configs/cpu_tiny.yaml): 4 tasks a step, 2 rollouts each
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


def read_recording(run_dir: Path) -> dict[int, dict]:
    """{step: the step's recording} of `run_dir/recording/step_N.json.gz`."""
    out = {}
    for path in sorted((run_dir / "recording").glob("step_*.json.gz")):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        out[doc["step"]] = doc
    return out
