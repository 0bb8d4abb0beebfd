"""Batch building: completed rollouts → training rows → a verl `DataProto`, metrics and tables.

One pass, as small pure steps:

    sort rollouts ─▶ rows per rollout ─▶ limits on each row ─▶ pad ─▶ tensors ─▶ metrics
                     (transition |        (is_drop, truncate,   (numpy,     (DataProto)
                      trajectory merge)    skip empty)           vectorised)

**Levels.** ``transition``: one row per triplet (LLM call). ``trajectory``: the calls of a
rollout are merged while each prompt starts, token for token, with the previous context
(prompt + response); the tokens between two calls that the model did not sample
(observations: tool results, user turns, template scaffolding) enter the response with
attention 1 and loss mask 0, logprob 0.0. A call whose prompt does not extend the context is a
**merge break**: the running row is emitted and a new one starts (AGL v1 behaviour). Each
break is diagnosed (`agl_lab.diagnose`) and listed in `BatchResult.merges`.

With ``multi_segment=True`` several rows stay open per rollout, so interleaved sub-agent
calls each continue their own prefix chain (rllm #773): a call extends the open row whose
context is the longest prefix of its prompt, otherwise opens a new row; rows come out in the
order of their first call.

**Limits** (per row). A prompt over ``max_prompt_length`` is cut to its first tokens and the
row is marked ``is_drop`` (the trainer removes it); a response over ``max_response_length``
keeps its first tokens and is counted in ``training/n_truncated_sample``; a row with no
trainable token is skipped (``training/n_skipped_empty_rows``).

**Deviations from AGL v1**, each deliberate: rewards stay float32 (AGL: bfloat16);
``response_mask`` and ``turn_index_list`` are emitted at both levels; rollouts are sorted by
(step, sample_idx, rollout_id) so completion order never changes the batch; input triplets
are never mutated (AGL extends the first triplet's logprob list in place); merge breaks are
classified instead of all being "others".

The core does no I/O; `log_batch_artifacts` uploads the W&B tables/artifacts of AGL v1 from a
finished result.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from agl_lab.diagnose import KINDS, MergeBreak, common_prefix_len, decode_ids, diagnose_break
from agl_lab.rollout import CompletedRollout, Triplet
from agl_lab.views import merges_frame, rows_frame

LEVELS = ("transition", "trajectory")
TRAIN_TRAJECTORY_RECORDS = 24  # compact train trajectories uploaded per step (AGL v1)
MISMATCH_TABLE_ROWS = 100  # merge-break rows in the W&B table per batch (AGL v1)
TRACE_TEXT_LIMIT = 4000  # characters of a decoded trace kept in the mismatch table


# =========================================================================== records


@dataclass
class Row:
    """One training row after limits. Lists are unpadded; `response_mask` 1 = model token."""

    rollout_id: str
    data_id: str
    turns: list[int]
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float] | None
    reward: float
    is_drop: bool = False
    truncated: bool = False
    tokens_cut: int = 0
    skipped_empty: bool = False
    batch_index: int = -1  # position in the batch; -1 when skipped


@dataclass
class BreakRecord:
    """One merge break: call `turn_index` did not extend the row ending at `against_turn`."""

    rollout_id: str
    data_id: str
    turn_index: int
    against_turn: int
    prompt_length: int
    response_length: int
    previous_trace_length: int
    current_trace_length: int
    previous_trace: str
    current_trace: str
    diagnosis: MergeBreak | None


@dataclass
class RowPlan:
    """Rows (incl. skipped ones) and merge breaks of a list of rollouts, before padding."""

    rollouts: list[CompletedRollout]  # sorted
    rows: list[Row]
    breaks: list[BreakRecord]
    level: str


@dataclass
class BatchResult:
    """What `build_batch` returns: the DataProto plus everything a notebook wants to look at."""

    data: Any  # verl.DataProto
    metrics: dict[str, float]
    rows: pd.DataFrame
    merges: pd.DataFrame
    trajectories: list[dict[str, Any]]
    level: str

    def __repr__(self) -> str:
        n = len(self.data) if self.data is not None else 0
        return f"BatchResult(level={self.level!r}, rows={n}, merge_breaks={len(self.merges)})"


@dataclass
class ValidationResult:
    """What `build_validation` returns: the `val/*` metrics and all compact trajectories."""

    metrics: dict[str, float]
    trajectories: list[dict[str, Any]]


# =========================================================================== rows per rollout


def sort_rollouts(completed: Sequence[CompletedRollout]) -> list[CompletedRollout]:
    """Order by (step, sample_idx, copy_idx, rollout_id): carry-overs first, completion order
    ignored, and (with the copy index the rollout managers record) independent of the random
    rollout ids, so a seeded run builds the same batch every time."""
    return sorted(completed, key=lambda r: (r.step, r.sample_idx, int(r.metadata.get("copy_idx") or 0),
                                            r.rollout_id))


def rollout_reward(rollout: CompletedRollout, reward_fillna_value: float) -> float:
    """The rollout's final reward, or the fill value when the agent reported none."""
    return float(reward_fillna_value if rollout.final_reward is None else rollout.final_reward)


@dataclass
class _Segment:
    """A row under construction; context = prompt + response at all times."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float] | None
    turns: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, turn: int, t: Triplet) -> "_Segment":
        r = list(t.response_ids)
        lp = list(t.logprobs) if t.logprobs is not None and len(t.logprobs) == len(r) else None
        return cls(list(t.prompt_ids), r, [1] * len(r), lp, [turn])

    def context_len(self) -> int:
        return len(self.prompt) + len(self.response)

    def is_extended_by(self, prompt: list[int]) -> bool:
        """Exact token-prefix test: prompt[:len(context)] == context."""
        n, k = self.context_len(), len(self.prompt)
        return len(prompt) >= n and prompt[:k] == self.prompt and prompt[k:n] == self.response

    def extend(self, turn: int, t: Triplet) -> None:
        obs = t.prompt_ids[self.context_len() :]  # observation: attended, loss-masked
        r = t.response_ids
        self.response += list(obs) + list(r)
        self.mask += [0] * len(obs) + [1] * len(r)
        if self.logprobs is not None and t.logprobs is not None and len(t.logprobs) == len(r):
            self.logprobs += [0.0] * len(obs) + list(t.logprobs)
        else:
            self.logprobs = None  # one turn without (matching) logprobs → the row has none
        self.turns.append(turn)

    def context(self) -> list[int]:
        return self.prompt + self.response

    def model_mask(self) -> list[int]:
        return [0] * len(self.prompt) + self.mask


def merge_triplets(
    triplets: Sequence[Triplet], multi_segment: bool = False
) -> tuple[list[_Segment], list[tuple[int, int, list[int], list[int]]]]:
    """Trajectory merge of one rollout's calls.

    Returns the segments (rows, ordered by first call) and the merge breaks as
    ``(turn_index, against_turn, previous context ids, its model mask)``; the break is
    measured against the open segment sharing the longest id prefix with the prompt.
    """
    segments: list[_Segment] = []
    open_: list[_Segment] = []
    breaks = []
    for i, t in enumerate(triplets):
        prompt = list(t.prompt_ids)  # list == list comparisons below (a tuple never equals a list)
        extending = [s for s in open_ if s.is_extended_by(prompt)]
        if extending:
            max(extending, key=_Segment.context_len).extend(i, t)
            continue
        if open_:
            against = max(open_, key=lambda s: common_prefix_len(s.context(), prompt))
            breaks.append((i, against.turns[-1], against.context(), against.model_mask()))
        segment = _Segment.start(i, t)
        open_ = open_ + [segment] if multi_segment else [segment]
        segments.append(segment)
    return segments, breaks


def _limit_row(segment: _Segment, rollout: CompletedRollout, reward: float,
               max_prompt_length: int | None, max_response_length: int | None) -> Row:
    """Apply the prompt/response limits and the empty-row rule to one segment."""
    prompt, response, mask, lp = segment.prompt, segment.response, segment.mask, segment.logprobs
    row = Row(rollout.rollout_id, rollout.data_id, list(segment.turns), prompt, response, mask, lp, reward)
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        row.tokens_cut += len(prompt) - max_prompt_length
        row.prompt_ids, row.is_drop = prompt[:max_prompt_length], True  # marked, dropped later
    if max_response_length is not None and len(response) > max_response_length:
        row.tokens_cut += len(response) - max_response_length
        row.response_ids, row.response_mask = response[:max_response_length], mask[:max_response_length]
        row.logprobs = lp[:max_response_length] if lp is not None else None
        row.truncated = True
    row.skipped_empty = sum(row.response_mask) == 0
    return row


def plan_rows(
    completed: Sequence[CompletedRollout],
    level: str = "trajectory",
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    reward_fillna_value: float = 0.0,
    multi_segment: bool = False,
    tokenizer: Any = None,
    diagnose: bool = True,
) -> RowPlan:
    """Rows and merge breaks of the sorted rollouts (no padding, no tensors)."""
    if level not in LEVELS:
        raise ValueError(
            f"Unknown trace_aggregator_level: {level!r}; set agentlightning.trace_aggregator.level "
            f"to one of {LEVELS}."
        )
    rollouts = sort_rollouts(completed)
    rows: list[Row] = []
    breaks: list[BreakRecord] = []
    for rollout in rollouts:
        reward = rollout_reward(rollout, reward_fillna_value)
        triplets = rollout.triplets or []
        if level == "transition":
            segments = [_Segment.start(i, t) for i, t in enumerate(triplets)]
        else:
            segments, raw_breaks = merge_triplets(triplets, multi_segment)
            breaks += [_break_record(rollout, b, tokenizer, diagnose) for b in raw_breaks]
        rows += [_limit_row(s, rollout, reward, max_prompt_length, max_response_length) for s in segments]
    kept = [r for r in rows if not r.skipped_empty]
    for index, row in enumerate(kept):
        row.batch_index = index
    return RowPlan(rollouts, rows, breaks, level)


def _break_record(rollout: CompletedRollout, raw: tuple, tokenizer: Any, diagnose: bool) -> BreakRecord:
    turn, against, context, model_mask = raw
    t = rollout.triplets[turn]
    current = list(t.prompt_ids) + list(t.response_ids)
    diagnosis = diagnose_break(context, t.prompt_ids, tokenizer, model_mask=model_mask) if diagnose else None
    return BreakRecord(
        rollout.rollout_id, rollout.data_id, turn, against,
        prompt_length=len(t.prompt_ids), response_length=len(t.response_ids),
        previous_trace_length=len(context), current_trace_length=len(current),
        previous_trace=_trace_text(context, tokenizer), current_trace=_trace_text(current, tokenizer),
        diagnosis=diagnosis,
    )


def _trace_text(ids: Sequence[int], tokenizer: Any) -> str:
    text = decode_ids(ids, tokenizer)
    if len(text) <= TRACE_TEXT_LIMIT:
        return text
    return text[:TRACE_TEXT_LIMIT] + f"\n...[truncated {len(text) - TRACE_TEXT_LIMIT} chars]"


# =========================================================================== padding


def pad_rows(rows: Sequence[Row], max_prompt_length: int, max_response_length: int,
             pad_token_id: int) -> dict[str, np.ndarray]:
    """Vectorised padding of N rows (P = max_prompt_length, R = max_response_length).

    | key                 | shape    | content                                               |
    |---------------------|----------|-------------------------------------------------------|
    | prompts             | [N, P]   | left padded with `pad_token_id`                       |
    | prompt_mask         | [N, P]   | 1 on prompt tokens                                    |
    | responses           | [N, R]   | right padded                                          |
    | response_attention  | [N, R]   | 1 on model and observation tokens                     |
    | response_mask       | [N, R]   | 1 on model tokens only                                |
    | rollout_log_probs   | [N, R]   | 0.0 on observations/padding (meaningful iff all rows) |
    | response_lengths    | [N]      | unpadded response lengths                             |
    """
    n = len(rows)
    prompt_lengths = np.fromiter((len(r.prompt_ids) for r in rows), np.int64, n)
    response_lengths = np.fromiter((len(r.response_ids) for r in rows), np.int64, n)
    prompt_slots = _slots(prompt_lengths, max_prompt_length, left=True)
    response_slots = _slots(response_lengths, max_response_length, left=False)
    logprobs = [r.logprobs if r.logprobs is not None else [0.0] * len(r.response_ids) for r in rows]
    return {
        "prompts": _fill([r.prompt_ids for r in rows], prompt_slots, pad_token_id, np.int64),
        "prompt_mask": prompt_slots.astype(np.int64),
        "responses": _fill([r.response_ids for r in rows], response_slots, pad_token_id, np.int64),
        "response_attention": response_slots.astype(np.int64),
        "response_mask": _fill([r.response_mask for r in rows], response_slots, 0, np.int64),
        "rollout_log_probs": _fill(logprobs, response_slots, 0.0, np.float32),
        "response_lengths": response_lengths,
    }


def _slots(lengths: np.ndarray, width: int, *, left: bool) -> np.ndarray:
    """[N, width] bool: where each row's tokens go (left padding: the last `len` columns)."""
    columns = np.arange(width)
    return columns >= width - lengths[:, None] if left else columns < lengths[:, None]


def _fill(seqs: Sequence[Sequence], slots: np.ndarray, fill: float, dtype: Any) -> np.ndarray:
    """Scatter ragged sequences into their slots. Boolean-mask assignment walks the slots in
    row-major order, which is exactly the order of the concatenated sequences."""
    out = np.full(slots.shape, fill, dtype=dtype)
    out[slots] = np.fromiter(chain.from_iterable(seqs), dtype, int(slots.sum()))
    return out


# =========================================================================== tensors


def to_dataproto(rows: Sequence[Row], arrays: dict[str, np.ndarray]) -> tuple[Any, int]:
    """Build the verl DataProto; returns it and the number of rows lacking logprobs.

    Tensors ([N, P+R] for the full sequence): input_ids, attention_mask, position_ids =
    clamp(cumsum(attention_mask) − 1, 0), prompts, responses, response_mask (transition: the
    response attention mask; trajectory: 1 on model tokens only), is_drop_mask [N] bool,
    token_level_scores [N, R] float32 with the reward on the last attended position,
    rollout_log_probs [N, R] float32 only when every row has logprobs. Non-tensors:
    data_id_list, rollout_id_list, turn_index_list (first call of the row), uid (= data_id).
    """
    from verl import DataProto  # lazy: importing verl costs seconds

    n = len(rows)
    attention = np.concatenate([arrays["prompt_mask"], arrays["response_attention"]], axis=1)
    position = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    scores = np.zeros(arrays["responses"].shape, dtype=np.float32)
    rewards = np.fromiter((r.reward for r in rows), np.float32, n)
    # The last attended position is the last response token (rows are never empty here).
    scores[np.arange(n), arrays["response_lengths"] - 1] = rewards
    tensors = {
        "input_ids": np.concatenate([arrays["prompts"], arrays["responses"]], axis=1),
        "attention_mask": attention,
        "position_ids": position,
        "prompts": arrays["prompts"],
        "responses": arrays["responses"],
        "response_mask": arrays["response_mask"],
        "is_drop_mask": np.fromiter((r.is_drop for r in rows), bool, n),
        "token_level_scores": scores,
    }
    n_without = sum(r.logprobs is None for r in rows)
    if n_without == 0:
        tensors["rollout_log_probs"] = arrays["rollout_log_probs"]
    data_ids = np.array([r.data_id for r in rows], dtype=object)
    non_tensors = {
        "data_id_list": data_ids,
        "rollout_id_list": np.array([r.rollout_id for r in rows], dtype=object),
        "turn_index_list": np.array([r.turns[0] for r in rows], dtype=object),
        "uid": data_ids.copy(),
    }
    data = DataProto.from_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors)
    return data, n_without


# =========================================================================== metrics


def train_metrics(plan: RowPlan, reward_fillna_value: float, n_without_logprobs: int) -> dict[str, float]:
    """The `training/*` metrics of AGL v1's rollout adapter plus agl_lab's merge-break counts."""
    rollouts, kept = plan.rollouts, [r for r in plan.rows if not r.skipped_empty]
    lengths = [len(t.response_ids) for r in rollouts for t in (r.triplets or [])]
    metrics = {
        "training/reward": float(np.mean([rollout_reward(r, reward_fillna_value) for r in rollouts])),
        "training/n_sample": len(kept),
        "training/n_rollouts": len(rollouts),
        "training/n_rollouts_w_trace": sum(bool(r.triplets) for r in rollouts),
        "training/n_rollouts_w_reward": sum(r.final_reward is not None for r in rollouts),
        "training/n_truncated_sample": sum(r.truncated for r in plan.rows),
        "training/n_skipped_empty_rows": sum(r.skipped_empty for r in plan.rows),
        "training/n_dropped_prompt_too_long": sum(r.is_drop for r in kept),
        "training/n_rows_without_logprobs": n_without_logprobs,
        "training/n_turns": len(lengths),
        "response_length/training/avg_by_turn": float(np.mean(lengths)),
        "response_length/training/max_by_turn": int(np.max(lengths)),
        "response_length/training/min_by_turn": int(np.min(lengths)),
    }
    if plan.level == "trajectory":
        rows_per_rollout = pd.Series([r.rollout_id for r in plan.rows]).value_counts()
        metrics["training/n_unmerged_rollouts"] = int((rows_per_rollout > 1).sum())
        metrics["training/n_trace_merge_mismatch_rows"] = min(len(plan.breaks), MISMATCH_TABLE_ROWS)
        metrics["training/n_merge_breaks"] = len(plan.breaks)
        kinds = [b.diagnosis.kind for b in plan.breaks if b.diagnosis is not None]
        for kind in KINDS:
            metrics[f"training/merge_breaks/{kind}"] = kinds.count(kind)
    return metrics


def compact_trajectories(rollouts: Sequence[CompletedRollout], reward_fillna_value: float,
                         tokenizer: Any = None, limit: int | None = None) -> list[dict[str, Any]]:
    """{rollout_id, reward, prompt, response} of each rollout's last call (sorted, with trace)."""
    records = []
    for r in sort_rollouts(rollouts):
        if not r.triplets:
            continue
        if limit is not None and len(records) >= limit:
            break
        last = r.triplets[-1]
        records.append({
            "rollout_id": r.rollout_id,
            "reward": rollout_reward(r, reward_fillna_value),
            "prompt": decode_ids(last.prompt_ids, tokenizer),
            "response": decode_ids(last.response_ids, tokenizer),
        })
    return records


# =========================================================================== entry points


def build_batch(
    completed: Sequence[CompletedRollout],
    level: str = "trajectory",
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int = 0,
    reward_fillna_value: float = 0.0,
    tokenizer: Any = None,
    multi_segment: bool = False,
    diagnose: bool = True,
) -> BatchResult:
    """Completed rollouts → `BatchResult(data, metrics, rows, merges, trajectories)`.

    `tokenizer` (optional) only serves the diagnostics: merge-break classes and decoded texts.
    Raises RuntimeError when no row has a trainable token.
    """
    for key, value in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"build_batch: {key} must be a positive int, got {value!r}.")
    plan = plan_rows(completed, level, max_prompt_length=max_prompt_length,
                     max_response_length=max_response_length, reward_fillna_value=reward_fillna_value,
                     multi_segment=multi_segment, tokenizer=tokenizer, diagnose=diagnose)
    kept = [r for r in plan.rows if not r.skipped_empty]
    if not kept:
        raise RuntimeError(
            "get_train_data_batch emitted zero training rows. "
            f"({len(plan.rollouts)} rollouts, {sum(bool(r.triplets) for r in plan.rollouts)} with calls, "
            f"{len(plan.rows)} rows all without a trainable token.)"
        )
    arrays = pad_rows(kept, max_prompt_length, max_response_length, pad_token_id)
    data, n_without = to_dataproto(kept, arrays)
    return BatchResult(
        data=data,
        metrics=train_metrics(plan, reward_fillna_value, n_without),
        rows=rows_frame(plan.rows),
        merges=merges_frame(plan.breaks),
        trajectories=compact_trajectories(plan.rollouts, reward_fillna_value, tokenizer, TRAIN_TRAJECTORY_RECORDS),
        level=level,
    )


def build_validation(completed: Sequence[CompletedRollout], reward_fillna_value: float = 0.0,
                     tokenizer: Any = None) -> ValidationResult:
    """`val/*` metrics of AGL v1 (`get_test_metrics`) and every compact trajectory."""
    rollouts = sort_rollouts(completed)
    traced = [r for r in rollouts if r.triplets]
    if not traced:
        raise RuntimeError("get_test_metrics received zero completed rollouts with trace.")
    totals = [sum(len(t.response_ids) for t in r.triplets) for r in traced]
    metrics = {
        "val/reward": float(np.mean([rollout_reward(r, reward_fillna_value) for r in rollouts])),
        "val/n_rollouts": len(rollouts),
        "val/n_rollouts_w_trace": len(traced),
        "val/n_rollouts_w_reward": sum(r.final_reward is not None for r in rollouts),
        "val/mean_response_length_per_turn": float(np.mean([t / len(r.triplets) for t, r in zip(totals, traced)])),
        "val/mean_total_response_length_per_rollout": float(np.mean(totals)),
        "val/turn_count": float(np.mean([len(r.triplets) for r in traced])),
    }
    return ValidationResult(metrics, compact_trajectories(rollouts, reward_fillna_value, tokenizer))


def validation_metrics(completed: Sequence[CompletedRollout], reward_fillna_value: float = 0.0) -> dict[str, float]:
    """The `val/*` metrics only (see `build_validation`)."""
    return build_validation(completed, reward_fillna_value).metrics


# =========================================================================== W&B side-uploads


MISMATCH_COLUMNS = [
    "global_steps", "rollout_id", "data_id", "turn_index", "template_mismatch", "retoken_mismatch",
    "others_mismatch", "prompt_length", "response_length", "previous_trace_length",
    "current_trace_length", "previous_trace", "current_trace",
]
TRAJECTORY_TABLE_COLUMNS = ["global_steps", "trajectory_artifact", "trajectory_artifact_path", "row_count"]


def mismatch_table_rows(merges: pd.DataFrame, step: int) -> list[list[Any]]:
    """AGL v1's `training/trace_merge_mismatches` rows (first 100 breaks), flags from the diagnosis."""
    out = []
    for b in merges.head(MISMATCH_TABLE_ROWS).itertuples(index=False):
        out.append([
            step, b.rollout_id, b.data_id, b.turn_index, b.kind == "template", b.kind == "retokenization",
            b.kind not in ("template", "retokenization"), b.prompt_length, b.response_length,
            b.previous_trace_length, b.current_trace_length, b.previous_trace, b.current_trace,
        ])
    return out


def trajectories_zip(records: Sequence[dict[str, Any]], member: str) -> bytes:
    """One JSONL member (compact separators, UTF-8) in a deflate zip."""
    lines = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in records)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, lines.encode("utf-8"))
    return buffer.getvalue()


def log_batch_artifacts(run: Any, result: BatchResult | ValidationResult, step: int, split: str = "train",
                        *, wandb_module: Any = None) -> None:
    """Upload AGL v1's side tables to a W&B run (`run.log`, `run.log_artifact`, `run.id`).

    train: `training/trace_merge_mismatches` (always, ≤100 rows) and the 24 compact
    trajectories; validation: all compact trajectories. `wandb_module` supplies `Table` and
    `Artifact` (default: `import wandb`). An upload failure warns and never stops training.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"log_batch_artifacts: split must be 'train' or 'validation', got {split!r}.")
    if split == "train" and not isinstance(result, BatchResult):
        raise TypeError("log_batch_artifacts: split 'train' needs the BatchResult of build_batch.")
    if wandb_module is None:
        import wandb as wandb_module
    try:
        if split == "train":
            rows = mismatch_table_rows(result.merges, step)
            table = wandb_module.Table(columns=list(MISMATCH_COLUMNS), data=rows)
            run.log({"training/trace_merge_mismatches": table}, step=step)
        _log_trajectories(run, result.trajectories, step, split, wandb_module)
    except Exception as exc:  # noqa: BLE001 - W&B side-uploads are best effort, like AGL v1
        warnings.warn(f"log_batch_artifacts: W&B upload for step {step} failed: {exc!r}", stacklevel=2)


def _log_trajectories(run: Any, records: list[dict[str, Any]], step: int, split: str, wandb_module: Any) -> None:
    """The jsonl.zip artifact of compact trajectories and its one-row pointer table."""
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", str(getattr(run, "id", None) or "run"))
    name = f"{split}-trajectories-{safe_id}-step-{step}"
    path = f"step_{step}/{split}_trajectories.jsonl.zip"
    artifact = wandb_module.Artifact(name=name, type=f"{split}_trajectories",
                                     metadata={"global_steps": step, "row_count": len(records), "format": "jsonl.zip"})
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        with open(local, "wb") as fh:
            fh.write(trajectories_zip(records, f"{split}_trajectories.jsonl"))
        artifact.add_file(local, name=path)  # wandb copies the file here (policy "mutable")
        run.log_artifact(artifact)
    key = "training/rollout_trajectories" if split == "train" else "val/rollout_trajectories"
    table = wandb_module.Table(columns=list(TRAJECTORY_TABLE_COLUMNS), data=[[step, name, path, len(records)]])
    run.log({key: table}, step=step)
