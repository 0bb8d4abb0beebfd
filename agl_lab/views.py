"""DataFrame views of a rollout phase and of a batch: one row per call, row, break, group, rollout.

Every view is a pure function of a list of `CompletedRollout` (and, where the batch matters,
an optional `BatchResult`), so a notebook cell can show any stage without re-running it:

| view           | one row per              | answers                                              |
|----------------|--------------------------|------------------------------------------------------|
| `triplets_df`  | LLM call (triplet)       | how long were prompts/responses, which policy served |
| `rows_df`      | training row             | which calls merged, what was cut, dropped or skipped |
| `merges_df`    | merge break              | where and why a prompt did not extend its context    |
| `groups_df`    | group (task in a step)   | reward spread, zero-advantage groups, rows per group |
| `lifecycle_df` | rollout                  | queue wait, run time, total time                     |

`build_batch` builds its `.rows` and `.merges` with `rows_frame` / `merges_frame` below, so
the views and the batch can never disagree. Without a `BatchResult`, `rows_df` / `merges_df`
plan the rows with the same code (`agl_lab.batch.plan_rows`), minus the tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from agl_lab.rollout import CompletedRollout

if TYPE_CHECKING:  # batch imports this module; import it lazily at run time
    from agl_lab.batch import BatchResult, BreakRecord, Row

ROW_COLUMNS = [
    "batch_index", "rollout_id", "data_id", "first_turn", "last_turn", "n_turns",
    "prompt_tokens", "response_tokens", "loss_tokens", "observation_tokens",
    "has_logprobs", "is_drop", "truncated", "tokens_cut", "skipped_empty", "reward",
]
MERGE_COLUMNS = [
    "rollout_id", "data_id", "turn_index", "against_turn", "kind", "reason",
    "first_divergent_token", "first_divergent_char", "prev_ids_window", "prompt_ids_window",
    "prev_pieces", "prompt_pieces", "removed_text", "inserted_text", "removed_model_chars",
    "removed_context_chars", "prompt_length", "response_length", "previous_trace_length",
    "current_trace_length", "previous_trace", "current_trace",
]


# =========================================================================== frames of records


def rows_frame(rows: Sequence["Row"]) -> pd.DataFrame:
    """One line per row (skipped rows included, `batch_index` -1). Counts are after limits."""
    records = []
    for r in rows:
        loss = int(sum(r.response_mask))
        records.append([
            r.batch_index, r.rollout_id, r.data_id, r.turns[0], r.turns[-1], len(r.turns),
            len(r.prompt_ids), len(r.response_ids), loss, len(r.response_ids) - loss,
            r.logprobs is not None, r.is_drop, r.truncated, r.tokens_cut, r.skipped_empty, r.reward,
        ])
    return pd.DataFrame(records, columns=ROW_COLUMNS)


def merges_frame(breaks: Sequence["BreakRecord"]) -> pd.DataFrame:
    """One line per merge break with its diagnosis (None columns when not diagnosed)."""
    records = []
    for b in breaks:
        d = b.diagnosis
        diag = [None] * 12 if d is None else [
            d.kind, d.reason, d.first_divergent_token, d.first_divergent_char, d.prev_ids,
            d.prompt_ids, d.prev_pieces, d.prompt_pieces, d.removed_text, d.inserted_text,
            d.removed_model_chars, d.removed_context_chars,
        ]
        records.append([
            b.rollout_id, b.data_id, b.turn_index, b.against_turn, *diag,
            b.prompt_length, b.response_length, b.previous_trace_length, b.current_trace_length,
            b.previous_trace, b.current_trace,
        ])
    return pd.DataFrame(records, columns=MERGE_COLUMNS)


# =========================================================================== views


def triplets_df(completed: Sequence[CompletedRollout]) -> pd.DataFrame:
    """One line per LLM call: lengths, reward (set on the last call), logprobs, serving version."""
    from agl_lab.batch import sort_rollouts

    records = []
    for r in sort_rollouts(completed):
        for turn, t in enumerate(r.triplets or []):
            server = (t.metadata or {}).get("server") or {}
            records.append([
                r.rollout_id, r.data_id, turn, len(t.prompt_ids), len(t.response_ids), t.reward,
                t.logprobs is not None and len(t.logprobs) == len(t.response_ids), server.get("version"),
            ])
    columns = ["rollout_id", "data_id", "turn", "prompt_len", "response_len", "reward",
               "has_logprobs", "server_version"]
    return pd.DataFrame(records, columns=columns)


def rows_df(completed: Sequence[CompletedRollout], result: "BatchResult | None" = None, *,
            level: str = "trajectory", max_prompt_length: int | None = None,
            max_response_length: int | None = None, reward_fillna_value: float = 0.0,
            multi_segment: bool = False) -> pd.DataFrame:
    """Training rows: `result.rows` when given, else planned from `completed` (no limits by default)."""
    if result is not None:
        return result.rows
    from agl_lab.batch import plan_rows

    plan = plan_rows(completed, level, max_prompt_length=max_prompt_length,
                     max_response_length=max_response_length, reward_fillna_value=reward_fillna_value,
                     multi_segment=multi_segment, diagnose=False)
    return rows_frame(plan.rows)


def merges_df(completed: Sequence[CompletedRollout], result: "BatchResult | None" = None, *,
              tokenizer: Any = None, multi_segment: bool = False) -> pd.DataFrame:
    """Merge breaks with diagnosis: `result.merges` when given, else a trajectory-level plan."""
    if result is not None:
        return result.merges
    from agl_lab.batch import plan_rows

    plan = plan_rows(completed, "trajectory", multi_segment=multi_segment, tokenizer=tokenizer)
    return merges_frame(plan.breaks)


def groups_df(completed: Sequence[CompletedRollout], result: "BatchResult | None" = None, *,
              reward_fillna_value: float = 0.0, level: str = "trajectory",
              multi_segment: bool = False) -> pd.DataFrame:
    """Per group (`data_id`): rollouts, rewards, mean/std (ddof 0), zero-advantage flag, rows.

    A group has zero advantage when all its rewards are equal (max − min == 0): GRPO gives
    every token of it advantage 0. `n_rows` counts the group's rows in the batch (`result`),
    or in a plan at `level` when no result is given.
    """
    from agl_lab.batch import rollout_reward, sort_rollouts

    rows = rows_df(completed, result, level=level, reward_fillna_value=reward_fillna_value,
                   multi_segment=multi_segment)
    in_batch = rows[~rows["skipped_empty"]].groupby("data_id").size()
    groups: dict[str, list[float]] = {}
    for r in sort_rollouts(completed):
        groups.setdefault(r.data_id, []).append(rollout_reward(r, reward_fillna_value))
    records = []
    for data_id, rewards in groups.items():
        values = np.asarray(rewards, dtype=np.float64)
        records.append([data_id, len(rewards), rewards, float(values.mean()), float(values.std()),
                        bool(values.max() - values.min() == 0), int(in_batch.get(data_id, 0))])
    columns = ["data_id", "n_rollouts", "rewards", "reward_mean", "reward_std", "zero_advantage", "n_rows"]
    return pd.DataFrame(records, columns=columns)


def lifecycle_df(completed: Sequence[CompletedRollout]) -> pd.DataFrame:
    """Per rollout: enqueue/running/finished times and queue_wait_s, run_s, total_s (NaN if missing).

    Enqueue time is the trainer's clock, running/finished the server's (same host assumed).
    """
    from agl_lab.batch import sort_rollouts

    def span(start: float | None, end: float | None) -> float:
        return float("nan") if start is None or end is None else end - start

    records = [
        [r.rollout_id, r.data_id, r.step, r.state, r.enqueue_time, r.running_at, r.finished_at,
         span(r.enqueue_time, r.running_at), span(r.running_at, r.finished_at),
         span(r.enqueue_time, r.finished_at)]
        for r in sort_rollouts(completed)
    ]
    columns = ["rollout_id", "data_id", "step", "state", "enqueue_time", "running_at", "finished_at",
               "queue_wait_s", "run_s", "total_s"]
    return pd.DataFrame(records, columns=columns)
