"""Task feeding: an endless, seeded walk over a dataset, one epoch after another.

Sync mode takes `train_batch_size` tasks per step; async mode tops up only the groups that
finished (`take(k)` with any k), which AGL implements with a leftover buffer of split
batches. A cursor (epoch, position) over a per-epoch permutation gives the same sequence of
tasks with far less state, and it is what a checkpoint saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class TaskFeeder:
    """Yields tasks in a per-epoch shuffled order; `state_dict()` resumes the same sequence."""

    def __init__(self, dataset: Sequence[dict[str, Any]], *, seed: int = 0, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("train dataset is empty: give at least one task")
        self.dataset = list(dataset)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def take(self, k: int) -> list[dict[str, Any]]:
        """The next `k` tasks (crossing epoch boundaries as needed)."""
        if k <= 0:
            raise ValueError(f"size must be > 0, got {k}")
        out: list[dict[str, Any]] = []
        while len(out) < k:
            order = self._order(self.epoch)
            room = min(k - len(out), len(order) - self.position)
            out.extend(dict(self.dataset[i]) for i in order[self.position : self.position + room])
            self.position += room
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


# ---------------------------------------------------------------------------------------------
# Task files: `data.train_files` / `data.val_files`
# ---------------------------------------------------------------------------------------------


def _native(value: Any) -> Any:
    """JSON-native Python values (numpy arrays/scalars → lists/scalars), as AGL sends a row."""
    if isinstance(value, np.ndarray):
        return [_native(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _native(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_native(v) for v in value]
    return value


def load_task_files(files: Any, key: str, required_columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Tasks from parquet (verl/AGL examples) or JSONL files: one dict per row, files in order.

    `files` is one path or a list; `key` is the config key they came from (named in errors);
    every row must have the `required_columns` (e.g. the `input.X` fields an env_map reads).
    """
    import json
    from pathlib import Path

    paths = [files] if isinstance(files, (str, Path)) else list(files)
    rows: list[dict[str, Any]] = []
    for p in paths:
        path = Path(str(p)).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{key}: task file {str(p)!r} does not exist")
        if path.suffix == ".parquet":
            import pandas as pd

            rows += [_native(r) for r in pd.read_parquet(path).to_dict("records")]
        elif path.suffix in (".jsonl", ".json"):
            with path.open() as f:
                rows += [json.loads(line) for line in f if line.strip()]
        else:
            raise ValueError(f"{key}: {str(p)!r} is neither .parquet nor .jsonl (one JSON object per line)")
    if not rows:
        raise ValueError(f"{key}: {paths} hold no rows")
    for column in required_columns:
        missing = [i for i, r in enumerate(rows) if column not in r]
        if missing:
            raise KeyError(
                f"{key}: row {missing[0]} (of {len(missing)} rows) has no column {column!r}; "
                f"columns: {sorted(rows[missing[0]])}"
            )
    return rows


def resolve_datasets(
    cfg: Any, task: Any, train: Sequence[dict] | None, val: Sequence[dict] | None, train_files: Any, val_files: Any
) -> tuple[list[dict], list[dict]]:
    """Explicit datasets, else `data.train_files` / `data.val_files`, else the task's generators
    (`agl_lab.task.n_train` / `n_val` tasks, seeded by `agl_lab.seed`)."""
    from agl_lab import config as config_mod

    lab, columns = cfg.agl_lab, config_mod.env_map_columns(cfg)
    if train is None and train_files is not None:
        train = load_task_files(train_files, "data.train_files", columns)
    if val is None and val_files is not None:
        val = load_task_files(val_files, "data.val_files", columns)
    if train is None and task is None:
        raise config_mod.ConfigError(
            "agentlightning.local.agent_class is set but there are no tasks to run it on: set "
            "data.train_files (parquet or JSONL) or pass Trainer(..., train_dataset=[{...}, ...])"
        )
    if train is None:
        train = task.train_tasks(int(lab.task.n_train), seed=int(lab.seed))
    if val is None:
        val = task.val_tasks(int(lab.task.n_val), seed=int(lab.seed) + 1) if task else []
    return list(train), list(val)
