"""Evaluation statistics (pure): per-task pass@k, mean@k, maj@k and a bootstrap interval.

    table = task_table(rollouts, n=8, k=4)      # one row per task: its n rewards, c, pass@1, pass@4, ...
    summary = summarize(table, k=4, seed=0)     # means over tasks, each with a 95 % bootstrap interval

Symbols (per task):

| symbol | meaning                                                               |
|--------|-----------------------------------------------------------------------|
| n      | samples drawn (rollouts of the task), n ≥ k                           |
| c      | samples whose reward ≥ `threshold` (a *success*; default 1.0)          |
| k      | the budget the estimate is for                                        |

pass@k = 1 − C(n−c, k) / C(n, k): the chance that k samples drawn without replacement from the
n hold at least one success — the unbiased estimator of Chen et al. (2021), exact in integers
here. mean@k = the mean reward of all n samples (the expected mean of k of them). maj@k = whether
the most common final answer among the first k samples (the agent's `task_result` event's
`answer`, stripped; ties → the earliest) belongs to a success; a task with no recorded answer has
none, and the summary says so.

The interval: a percentile bootstrap over *tasks* (tasks resampled with replacement, 2000 times,
with `numpy.random.default_rng(seed)`), so it is deterministic given the seed. It measures how
much the score would move on another draw of tasks of the same kind, not the sampling noise of
the k samples within a task.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from agl_lab.batch import rollout_reward
from agl_lab.records import CompletedRollout, sort_rollouts

DEFAULT_THRESHOLD = 1.0  # a success: reward ≥ 1.0 (the built-in tasks' full marks)
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n−c, k)/C(n, k): the unbiased pass@k from n samples with c successes (1.0 when n − c < k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be between 0 and n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be between 1 and n={n} (draw n ≥ k samples per task)")
    if n - c < k:  # every k-subset holds a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # Critical: exact integers, no float factorials


def final_answer(rollout: CompletedRollout) -> str | None:
    """The answer of the rollout's last `task_result` event (stripped), or None when it recorded none."""
    for event in reversed(rollout.events):
        if event.get("event_type") == "task_result":
            answer = (event.get("data") or {}).get("answer")
            return None if answer is None else str(answer).strip()
    return None


def majority_success(answers: Sequence[str | None], successes: Sequence[bool]) -> bool | None:
    """Whether the most common answer (ties → the earliest) is a success; None without answers."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == top)  # the earliest of the tied
    return bool(successes[answers.index(winner)])


def task_table(
    rollouts: Sequence[CompletedRollout],
    n: int,
    k: int,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    reward_fillna_value: float = 0.0,
) -> pd.DataFrame:
    """One row per task from validation rollouts of `n` copies each (the task list repeated n times
    in a row, as `Trainer.validate` does): `task` (its index), `data_id`, `rewards` (the n, in copy
    order), `c`, `pass@1` … `pass@k`, `mean@k`, `maj@k` (None where no answer was recorded),
    `failed` (rollouts that ended in an error) and `missing` (copies the rollout phase dropped
    unfinished, at its wait timeout). Failed and missing samples score the fill value: they count
    as drawn and unsuccessful, so a slow or broken model is not scored on its lucky samples."""
    rows: dict[int, dict[str, Any]] = {}
    for r in sort_rollouts(rollouts):
        task = r.sample_idx // n  # Critical: the tasks were repeated n times in a row, so copy j of task i is i*n + j
        row = rows.setdefault(task, {"task": task, "data_id": r.data_id, "samples": {}, "failed": 0})
        row["samples"][r.sample_idx % n] = (rollout_reward(r, reward_fillna_value), final_answer(r))
        row["failed"] += r.state != "succeeded"
    records = []
    for task in sorted(rows):
        row = rows[task]
        samples = row.pop("samples")
        row["missing"] = n - len(samples)
        rewards = [samples.get(j, (reward_fillna_value, None))[0] for j in range(n)]
        answers = [samples.get(j, (reward_fillna_value, None))[1] for j in range(n)]
        successes = [reward >= threshold for reward in rewards]
        c = sum(successes)
        record = {**row, "rewards": rewards, "c": c}
        record.update({f"pass@{j}": pass_at_k(n, c, j) for j in sorted({1, k})})
        record[f"mean@{k}"] = float(np.mean(rewards))
        record[f"maj@{k}"] = majority_success(answers[:k], successes[:k])
        record["answers"] = answers
        records.append(record)
    return pd.DataFrame(records)


def bootstrap_interval(values: Sequence[float], seed: int, resamples: int = BOOTSTRAP_RESAMPLES) -> list[float]:
    """The percentile interval (`CONFIDENCE`) of the mean of `values`, resampled with replacement."""
    data = np.asarray(values, dtype=float)
    if len(data) == 0:
        return [math.nan, math.nan]
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    return [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]


def score_columns(table: pd.DataFrame) -> list[str]:
    """The per-task score columns of a task table (`pass@…`, `mean@…`, `maj@…`), in order."""
    return [c for c in table.columns if c.split("@")[0] in ("pass", "mean", "maj")]


def summarize(table: pd.DataFrame, *, seed: int) -> dict[str, Any]:
    """Per score column: its mean over tasks and `<score> ci` (the bootstrap interval, one seed
    per column so that adding a column moves no other). maj@k counts the tasks with answers only;
    with none it is None and `notes` says why."""
    summary: dict[str, Any] = {
        "n_tasks": len(table),
        "failed_rollouts": int(table["failed"].sum()) if len(table) else 0,
        "missing_rollouts": int(table["missing"].sum()) if len(table) else 0,
    }
    notes = []
    for i, column in enumerate(score_columns(table)):
        values = table[column].dropna().astype(float) if column in table else pd.Series(dtype=float)
        if column.startswith("maj@") and len(values) < len(table):
            notes.append(
                f"{column} over the {len(values)} of {len(table)} tasks whose agent recorded a final answer "
                "(a task_result event with 'answer')"
                if len(values)
                else f"{column} omitted: the agent recorded no final answers (a task_result event with 'answer')"
            )
        if not len(values):
            summary[column], summary[f"{column} ci"] = None, None
            continue
        summary[column] = float(values.mean())
        summary[f"{column} ci"] = bootstrap_interval(values.to_numpy(), seed + i)
    summary["ci"] = f"{CONFIDENCE:.0%} percentile bootstrap over tasks, {BOOTSTRAP_RESAMPLES} resamples, seed {seed}"
    summary["notes"] = notes
    return summary


def paired_difference(a: pd.DataFrame, b: pd.DataFrame, column: str) -> tuple[float, float, int]:
    """Mean and standard error over tasks of b − a in `column`, paired by `task` (the tasks both hold)."""
    joined = a[["task", column]].merge(b[["task", column]], on="task", suffixes=(" a", " b")).dropna()
    diff = joined[f"{column} b"].astype(float) - joined[f"{column} a"].astype(float)
    if not len(diff):
        return math.nan, math.nan, 0
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
    return float(diff.mean()), se, int(len(diff))
