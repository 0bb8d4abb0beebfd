"""DataFrame views of a rollout phase and of a batch: one row per call, row, break, group, rollout.

Every view is a pure function of a list of `CompletedRollout` (and, where the batch matters,
an optional built batch: `agl_lab.batch.BuiltBatch` or the `BatchResult` holding it), so a notebook cell can show any stage without
re-running it:

| view           | one row per              | answers                                              |
|----------------|--------------------------|------------------------------------------------------|
| `triplets_df`  | call (triplet)           | how long were prompts/responses, which policy served |
| `rows_df`      | training row             | which calls merged, what was cut, dropped or skipped |
| `breaks_df`    | merge break              | where and why a prompt did not extend its context    |
| `groups_df`    | group (task in a step)   | reward spread, zero-advantage groups, rows per group |
| `lifecycle_df` | rollout                  | state and error, queue wait, run time, total time    |

`agl_lab.results.BatchResult` builds its `.rows` and `.breaks` with `rows_frame` /
`breaks_frame` below from the batch's records, so the views and the batch never disagree.
Without a built batch, `rows_df` / `breaks_df` plan the rows with the same code
(`agl_lab.batch.plan_rows`), minus the tensors. This module imports `batch`; `batch` never
imports it (it returns records, not frames).

Columns use the project's nouns (docs/architecture.md, the glossary): `call` is the index of a triplet in its
rollout, token counts are `*_tokens`, a group whose rewards are all equal is `zero_adv`.
Metric names stay Agent Lightning's, whose nouns differ:

| AGL metric name                       | counts / means                          |
|---------------------------------------|-----------------------------------------|
| `training/n_sample*`                  | rows                                    |
| `training/n_turns`, `*_by_turn`       | calls                                   |
| `*trace_merge_mismatch*`              | merge breaks (W&B table: first 100)     |
| `critic/n_transition_after_dropping`  | rows                                    |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from agl_lab.batch import BreakRecord, BuiltBatch, Row, plan_rows, rollout_reward
from agl_lab.records import CompletedRollout, sort_rollouts

ROW_COLUMNS = [
    "batch_index",
    "rollout_id",
    "data_id",
    "first_call",
    "last_call",
    "n_calls",
    "prompt_tokens",
    "response_tokens",
    "loss_tokens",
    "observation_tokens",
    "has_logprobs",
    "is_drop",
    "truncated",
    "tokens_cut",
    "skipped_empty",
    "reward",
]
BREAK_COLUMNS = [
    "rollout_id",
    "data_id",
    "call",
    "against_call",
    "kind",
    "reason",
    "first_divergent_token",
    "first_divergent_char",
    "prev_ids_window",
    "prompt_ids_window",
    "prev_pieces",
    "prompt_pieces",
    "removed_text",
    "inserted_text",
    "removed_model_chars",
    "removed_context_chars",
    "prompt_tokens",
    "response_tokens",
    "previous_trace_tokens",
    "current_trace_tokens",
    "previous_trace",
    "current_trace",
]
TRIPLET_COLUMNS = [
    "rollout_id",
    "data_id",
    "call",
    "prompt_tokens",
    "response_tokens",
    "reward",
    "has_logprobs",
    "server_version",
    "repeats_dropped",
]
TEXT_COLUMNS = ["prompt_tail", "response_text"]  # with a tokenizer (a Trainer's results have one)
LIFECYCLE_COLUMNS = [
    "rollout_id",
    "data_id",
    "step",
    "state",
    "error_message",
    "enqueued_at_s",
    "running_at_s",
    "finished_at_s",
    "queue_wait_s",
    "run_s",
    "total_s",
]
GROUP_COLUMNS = ["data_id", "n_rollouts", "rewards", "reward_mean", "reward_std", "zero_adv", "n_rows"]


# =========================================================================== frames of records


def rows_frame(rows: Sequence[Row], tokenizer: Any = None) -> pd.DataFrame:
    """One line per row (skipped rows included, `batch_index` -1). Counts are after limits. With a
    `tokenizer`, `prompt_tail` and `response_text` (the row's response: replies and observations)."""
    records = []
    for r in rows:
        loss = int(sum(r.response_mask))
        records.append(
            [
                r.batch_index,
                r.rollout_id,
                r.data_id,
                r.calls[0],
                r.calls[-1],
                len(r.calls),
                len(r.prompt_ids),
                len(r.response_ids),
                loss,
                len(r.response_ids) - loss,
                r.logprobs is not None,
                r.is_drop,
                r.truncated,
                r.tokens_cut,
                r.skipped_empty,
                r.reward,
                *(_text_columns(tokenizer, r.prompt_ids, r.response_ids) if tokenizer is not None else []),
            ]
        )
    return pd.DataFrame(records, columns=ROW_COLUMNS + (TEXT_COLUMNS if tokenizer is not None else []))


def breaks_frame(breaks: Sequence[BreakRecord]) -> pd.DataFrame:
    """One line per merge break with its diagnosis (None columns when not diagnosed)."""
    records = []
    for b in breaks:
        d = b.diagnosis
        diag = (
            [None] * 12
            if d is None
            else [
                d.kind,
                d.reason,
                d.first_divergent_token,
                d.first_divergent_char,
                d.prev_ids,
                d.prompt_ids,
                d.prev_pieces,
                d.prompt_pieces,
                d.removed_text,
                d.inserted_text,
                d.removed_model_chars,
                d.removed_context_chars,
            ]
        )
        records.append(
            [
                b.rollout_id,
                b.data_id,
                b.call,
                b.against_call,
                *diag,
                b.prompt_tokens,
                b.response_tokens,
                b.previous_trace_tokens,
                b.current_trace_tokens,
                b.previous_trace,
                b.current_trace,
            ]
        )
    return pd.DataFrame(records, columns=BREAK_COLUMNS)


# =========================================================================== views


TEXT_TAIL_CHARS = 80  # `prompt_tail`: the last characters of a decoded prompt


def _text_columns(tokenizer: Any, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[str]:
    """`[prompt_tail, response_text]` decoded (special tokens kept: the chat template shows)."""
    prompt = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return [prompt[-TEXT_TAIL_CHARS:], tokenizer.decode(list(response_ids), skip_special_tokens=False)]


def triplets_df(completed: Sequence[CompletedRollout], tokenizer: Any = None) -> pd.DataFrame:
    """One line per call: token counts, reward (set on the last call), logprobs, serving version, and
    `repeats_dropped`: earlier calls with this very prompt that the triplet reduction dropped.
    With a `tokenizer`, `prompt_tail` (its last 80 characters) and `response_text`, decoded."""
    records = []
    for r in sort_rollouts(completed):
        for call, t in enumerate(r.triplets or []):
            server = (t.metadata or {}).get("server") or {}
            records.append(
                [
                    r.rollout_id,
                    r.data_id,
                    call,
                    len(t.prompt_ids),
                    len(t.response_ids),
                    t.reward,
                    t.logprobs is not None and len(t.logprobs) == len(t.response_ids),
                    server.get("version"),
                    int((t.metadata or {}).get("repeats_dropped", 0)),
                    *(_text_columns(tokenizer, t.prompt_ids, t.response_ids) if tokenizer is not None else []),
                ]
            )
    return pd.DataFrame(records, columns=TRIPLET_COLUMNS + (TEXT_COLUMNS if tokenizer is not None else []))


def _record(batch: Any) -> BuiltBatch | None:
    """The `BuiltBatch` of a batch argument: the record itself, or a `BatchResult`'s `.built`."""
    return getattr(batch, "built", batch)


def rows_df(
    completed: Sequence[CompletedRollout],
    batch: Any = None,
    *,
    level: str = "trajectory",
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    reward_fillna_value: float = 0.0,
    multi_segment: bool = False,
) -> pd.DataFrame:
    """Training rows: those of `batch` (a `BuiltBatch` or `BatchResult`) when given, else
    planned from `completed` (no limits by default)."""
    built = _record(batch)
    if built is None:
        built = plan_rows(
            completed,
            level,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            reward_fillna_value=reward_fillna_value,
            multi_segment=multi_segment,
            diagnose=False,
        )
    return rows_frame(built.rows)


def breaks_df(
    completed: Sequence[CompletedRollout], batch: Any = None, *, tokenizer: Any = None, multi_segment: bool = False
) -> pd.DataFrame:
    """Merge breaks with diagnosis: those of `batch` when given, else of a trajectory-level plan."""
    built = _record(batch)
    if built is None:
        built = plan_rows(completed, "trajectory", multi_segment=multi_segment, tokenizer=tokenizer)
    return breaks_frame(built.breaks)


def groups_df(
    completed: Sequence[CompletedRollout],
    batch: Any = None,
    *,
    reward_fillna_value: float = 0.0,
    level: str = "trajectory",
    multi_segment: bool = False,
) -> pd.DataFrame:
    """Per group (`data_id`): rollouts, rewards, mean/std (ddof 0), `zero_adv` flag, rows.

    A group is `zero_adv` when GRPO gives every token of it advantage 0: two or more rollouts
    with equal rewards (max − min == 0), or a single rollout with reward 0 (verl's GRPO uses
    mean 0, std 1 for a group of one, so its advantage is its reward). `n_rows` counts the group's rows in `batch`, or in a plan at
    `level` when no batch is given.
    """
    rows = rows_df(completed, batch, level=level, reward_fillna_value=reward_fillna_value, multi_segment=multi_segment)
    in_batch = rows[~rows["skipped_empty"]].groupby("data_id").size()
    groups: dict[str, list[float]] = {}
    for r in sort_rollouts(completed):
        groups.setdefault(r.data_id, []).append(rollout_reward(r, reward_fillna_value))
    records = []
    for data_id, rewards in groups.items():
        values = np.asarray(rewards, dtype=np.float64)
        records.append(
            [
                data_id,
                len(rewards),
                rewards,
                float(values.mean()),
                float(values.std()),
                bool(values.max() - values.min() == 0 and (len(values) > 1 or values[0] == 0)),
                int(in_batch.get(data_id, 0)),
            ]
        )
    return pd.DataFrame(records, columns=GROUP_COLUMNS)


def lifecycle_df(completed: Sequence[CompletedRollout], start: float | None = None) -> pd.DataFrame:
    """Per rollout: state, error_message, when it was enqueued / started / finished and the spans.

    `enqueued_at_s`, `running_at_s`, `finished_at_s` are seconds since `start` (a wall-clock
    time: `RolloutResult` passes the step's start; default: the earliest enqueue time, so a
    carried-over rollout of an async step can be negative). `queue_wait_s`, `run_s`,
    `total_s` are the spans between them; NaN where a timestamp is missing. `error_message`
    is the runner's reason for a failed rollout (None when it succeeded).
    Enqueue time is the trainer's clock, running/finished the server's (same host assumed).
    """
    ordered = sort_rollouts(completed)
    if start is None:
        enqueued = [r.enqueue_time for r in ordered if r.enqueue_time is not None]
        start = min(enqueued) if enqueued else 0.0

    def span(a: float | None, b: float | None) -> float:
        return float("nan") if a is None or b is None else b - a

    records = [
        [
            r.rollout_id,
            r.data_id,
            r.step,
            r.state,
            r.error_message,
            span(start, r.enqueue_time),
            span(start, r.running_at),
            span(start, r.finished_at),
            span(r.enqueue_time, r.running_at),
            span(r.running_at, r.finished_at),
            span(r.enqueue_time, r.finished_at),
        ]
        for r in ordered
    ]
    return pd.DataFrame(records, columns=LIFECYCLE_COLUMNS)
