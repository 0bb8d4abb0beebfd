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
break is diagnosed (`agl_lab.diagnose`) and listed in `BuiltBatch.breaks`.

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

`build_batch` returns a plain record, `BuiltBatch(rollouts, rows, breaks, level, data,
metrics)`: no DataFrames (`agl_lab.views` builds those from `Row`/`BreakRecord`; the
notebook-facing `agl_lab.results.BatchResult` caches them) and no W&B (the metrics logger
uploads AGL's side tables from the result). The core does no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Sequence

import numpy as np
import torch

from agl_lab.diagnose import KINDS, MergeBreak, common_prefix_len, decode_ids, diagnose_break
from agl_lab.records import CompletedRollout, Triplet, sort_rollouts

LEVELS = ("transition", "trajectory")
MISMATCH_TABLE_ROWS = 100  # merge breaks AGL v1 puts in its W&B table per batch (a metric counts them)
TRACE_TEXT_LIMIT = 4000  # characters of a decoded trace kept per merge break


# =========================================================================== records


@dataclass
class Row:
    """One training row after limits. Lists are unpadded; `response_mask` 1 = model token."""

    rollout_id: str
    data_id: str
    calls: list[int]  # the calls (triplet indices in the rollout) merged into this row
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
    """One merge break: call `call` did not extend the row ending at call `against_call`."""

    rollout_id: str
    data_id: str
    call: int
    against_call: int
    prompt_tokens: int
    response_tokens: int
    previous_trace_tokens: int
    current_trace_tokens: int
    previous_trace: str
    current_trace: str
    diagnosis: MergeBreak | None


@dataclass
class BuiltBatch:
    """What `build_batch` returns: the DataProto of the kept rows and the records behind it.

    `plan_rows` returns the same record without tensors (`data` None, `metrics` empty).
    """

    rollouts: list[CompletedRollout]  # sorted, as the rows were built
    rows: list[Row]  # every row, skipped ones included (batch_index -1)
    breaks: list[BreakRecord]
    level: str
    data: Any = None  # verl.DataProto of the N kept rows
    metrics: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        n = len(self.data) if self.data is not None else 0
        return f"BuiltBatch(level={self.level!r}, rows={n}, breaks={len(self.breaks)})"


# =========================================================================== rows per rollout


def check_level(level: str) -> str:
    """`level` if it is one of `LEVELS`; else ValueError naming the config key (config.py calls this too)."""
    if level not in LEVELS:
        raise ValueError(f"Unknown trace_aggregator_level: {level!r}; set agentlightning.trace_aggregator.level "
                         f"to one of {list(LEVELS)}.")
    return level


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
    calls: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, call: int, t: Triplet) -> "_Segment":
        r = list(t.response_ids)
        lp = list(t.logprobs) if t.logprobs is not None and len(t.logprobs) == len(r) else None
        return cls(list(t.prompt_ids), r, [1] * len(r), lp, [call])

    def context_len(self) -> int:
        return len(self.prompt) + len(self.response)

    def is_extended_by(self, prompt: list[int]) -> bool:
        """Exact token-prefix test: prompt[:len(context)] == context."""
        n, k = self.context_len(), len(self.prompt)
        return len(prompt) >= n and prompt[:k] == self.prompt and prompt[k:n] == self.response

    def extend(self, call: int, t: Triplet) -> None:
        obs = t.prompt_ids[self.context_len() :]  # observation: attended, loss-masked
        r = t.response_ids
        self.response += list(obs) + list(r)
        self.mask += [0] * len(obs) + [1] * len(r)
        if self.logprobs is not None and t.logprobs is not None and len(t.logprobs) == len(r):
            self.logprobs += [0.0] * len(obs) + list(t.logprobs)
        else:
            self.logprobs = None  # one call without (matching) logprobs → the row has none
        self.calls.append(call)

    def context(self) -> list[int]:
        return self.prompt + self.response

    def model_mask(self) -> list[int]:
        return [0] * len(self.prompt) + self.mask


def merge_triplets(
    triplets: Sequence[Triplet], multi_segment: bool = False
) -> tuple[list[_Segment], list[tuple[int, int, list[int], list[int]]]]:
    """Trajectory merge of one rollout's calls.

    Returns the segments (rows, ordered by first call) and the merge breaks as
    ``(call, against_call, previous context ids, its model mask)``; the break is
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
            breaks.append((i, against.calls[-1], against.context(), against.model_mask()))
        segment = _Segment.start(i, t)
        open_ = open_ + [segment] if multi_segment else [segment]
        segments.append(segment)
    return segments, breaks


def _limit_row(segment: _Segment, rollout: CompletedRollout, reward: float,
               max_prompt_length: int | None, max_response_length: int | None) -> Row:
    """Apply the prompt/response limits and the empty-row rule to one segment."""
    prompt, response, mask, lp = segment.prompt, segment.response, segment.mask, segment.logprobs
    row = Row(rollout.rollout_id, rollout.data_id, list(segment.calls), prompt, response, mask, lp, reward)
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
) -> BuiltBatch:
    """Rows and merge breaks of the sorted rollouts (no padding, no tensors, no metrics)."""
    check_level(level)
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
    return BuiltBatch(rollouts, rows, breaks, level)


def _break_record(rollout: CompletedRollout, raw: tuple, tokenizer: Any, diagnose: bool) -> BreakRecord:
    call, against, context, model_mask = raw
    t = rollout.triplets[call]
    current = list(t.prompt_ids) + list(t.response_ids)
    diagnosis = diagnose_break(context, t.prompt_ids, tokenizer, model_mask=model_mask) if diagnose else None
    return BreakRecord(
        rollout.rollout_id, rollout.data_id, call, against,
        prompt_tokens=len(t.prompt_ids), response_tokens=len(t.response_ids),
        previous_trace_tokens=len(context), current_trace_tokens=len(current),
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
        "turn_index_list": np.array([r.calls[0] for r in rows], dtype=object),  # AGL's key name
        "uid": data_ids.copy(),
    }
    data = DataProto.from_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors)
    return data, n_without


# =========================================================================== metrics


def train_metrics(plan: BuiltBatch, reward_fillna_value: float, n_without_logprobs: int) -> dict[str, float]:
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
        rows_per_rollout = Counter(r.rollout_id for r in plan.rows)
        metrics["training/n_unmerged_rollouts"] = sum(n > 1 for n in rows_per_rollout.values())
        metrics["training/n_trace_merge_mismatch_rows"] = min(len(plan.breaks), MISMATCH_TABLE_ROWS)
        metrics["training/n_merge_breaks"] = len(plan.breaks)
        kinds = [b.diagnosis.kind for b in plan.breaks if b.diagnosis is not None]
        for kind in KINDS:
            metrics[f"training/merge_breaks/{kind}"] = kinds.count(kind)
    return metrics


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
    exclude_failed: bool = False,
) -> BuiltBatch:
    """Completed rollouts → `BuiltBatch(rollouts, rows, breaks, level, data, metrics)`.

    `tokenizer` (optional) only serves the diagnostics: merge-break classes and decoded texts.
    FAILED rollouts train with `reward_fillna_value` (AGL v1) unless `exclude_failed`, which
    leaves them out of the batch (`plan.rollouts` too); both are counted in the metrics.
    Raises RuntimeError when no row has a trainable token.
    """
    n_failed = sum(r.state == "failed" for r in completed)
    if exclude_failed:
        completed = [r for r in completed if r.state != "failed"]
    for key, value in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"build_batch: {key} must be a positive int, got {value!r}.")
    plan = plan_rows(completed, level, max_prompt_length=max_prompt_length,
                     max_response_length=max_response_length, reward_fillna_value=reward_fillna_value,
                     multi_segment=multi_segment, tokenizer=tokenizer, diagnose=diagnose)
    kept = [r for r in plan.rows if not r.skipped_empty]
    if not kept:
        n_traced = sum(bool(r.triplets) for r in plan.rollouts)
        raise RuntimeError(
            f"zero training rows: {len(plan.rollouts)} rollouts ({n_failed if exclude_failed else 0} FAILED ones "
            f"excluded), {n_traced} with model calls, "
            f"{len(plan.rows)} rows without a trainable token. Likely causes: the agents do not call "
            "the model through the gateway (use the base_url their rollout gives them), or every "
            "call returned an empty response (check the agent's max_tokens and the response limits)."
        )
    arrays = pad_rows(kept, max_prompt_length, max_response_length, pad_token_id)
    plan.data, n_without = to_dataproto(kept, arrays)
    plan.metrics = train_metrics(plan, reward_fillna_value, n_without)
    plan.metrics["training/n_failed_rollouts"] = n_failed
    plan.metrics["training/n_failed_rollouts_excluded"] = n_failed if exclude_failed else 0
    return plan
