"""Batch building: completed rollouts → training rows → a verl `DataProto` (or agl_lab's
`BatchData`, `container="agl"`), metrics and tables.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agl_lab import padding
from agl_lab.algorithms.credit import transition_rewards
from agl_lab.batch_data import BatchData
from agl_lab.diagnose import KINDS, MergeBreak, common_prefix_len, decode_ids, diagnose_break
from agl_lab.padding import pad_rows  # noqa: F401  (part of this module's API: rows -> arrays)
from agl_lab.protocol import is_number
from agl_lab.records import CompletedRollout, Triplet, sort_rollouts
from agl_lab.rules import LEVELS, TURN_CREDITS, check_level, check_turn_credit  # noqa: F401 (re-export)

#: what `build_batch` can emit: verl's `DataProto` (the engines') or agl_lab's verl-free `BatchData`
CONTAINERS = ("verl", "agl")

MISMATCH_TABLE_ROWS = 100  # merge breaks AGL v1 puts in its W&B table per batch (a metric counts them)
TRACE_TEXT_LIMIT = 4000  # characters of a decoded trace kept per merge break


# =========================================================================== records


@dataclass(eq=False)
class Row:
    """One training row after limits. The id lists are built on access (read them, do not
    mutate them): a row's full context is its last call's prompt + response, so the row keeps
    that pair (the triplets' own lists, never copied) plus the spans of its model tokens.

    | attribute        | meaning                                                            |
    |------------------|--------------------------------------------------------------------|
    | prompt_ids       | the first call's prompt, cut to max_prompt_length (unpadded)       |
    | response_ids     | observations + responses after it, cut to max_response_length      |
    | response_mask    | 1 = model token (loss), 0 = observation                            |
    | logprobs         | sampling logprobs, 0.0 on observations; None if a call had none    |
    | spans            | (start, length) runs of model tokens in response_ids               |
    """

    rollout_id: str
    data_id: str
    calls: list[int]  # the calls (triplet indices in the rollout) merged into this row
    reward: float
    context: tuple[list[int], list[int]] = field(repr=False)  # (last call's prompt, its response)
    first_prompt_tokens: int  # the uncut prompt length (the first call's prompt)
    spans: list[tuple[int, int]] = field(repr=False)
    span_logprobs: list[list[float]] | None = field(repr=False)  # one list per span (uncut)
    prompt_tokens: int = 0  # after limits
    response_tokens: int = 0
    is_drop: bool = False
    truncated: bool = False
    tokens_cut: int = 0
    skipped_empty: bool = False
    batch_index: int = -1  # position in the batch; -1 when skipped
    span_versions: list[int] = field(default_factory=list, repr=False)  # policy version per span (-1: unknown)

    @property
    def prompt_ids(self) -> list[int]:
        return self.context[0][: self.prompt_tokens]

    @property
    def response_ids(self) -> list[int]:
        prompt, response = self.context
        if len(prompt) == self.first_prompt_tokens:  # a single call
            return response[: self.response_tokens]
        return (prompt[self.first_prompt_tokens :] + response)[: self.response_tokens]

    @property
    def response_mask(self) -> list[int]:
        return padding.spans_to_list(self.spans, 1, None, self.response_tokens)

    @property
    def logprobs(self) -> list[float] | None:
        if self.span_logprobs is None:
            return None
        return padding.spans_to_list(self.spans, 0, self.span_logprobs, self.response_tokens)


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


def rollout_reward(rollout: CompletedRollout, reward_fillna_value: float) -> float:
    """The rollout's final reward, or the fill value when the agent reported none."""
    return float(reward_fillna_value if rollout.final_reward is None else rollout.final_reward)


def _ids(seq: Sequence[int]) -> list[int]:
    """`seq` itself when it is a list (never copied: read-only here), else a list of it."""
    return seq if type(seq) is list else list(seq)  # list == list below: a tuple never equals a list


class _Segment:
    """A row under construction. Each merged call extends the previous context, so the context
    is always the last call's prompt + response: nothing is rebuilt call by call. The model
    tokens are recorded as spans (start in the row's response, length) with their logprobs."""

    __slots__ = ("prompt", "last_prompt", "last_response", "spans", "span_logprobs", "calls", "n")

    def __init__(self, call: int, t: Triplet):
        self.prompt = self.last_prompt = _ids(t.prompt_ids)
        self.last_response = _ids(t.response_ids)
        self.n = len(self.prompt) + len(self.last_response)  # context length
        self.spans = [(0, len(self.last_response))]
        lp = t.logprobs
        self.span_logprobs = [lp] if lp is not None and len(lp) == len(self.last_response) else None
        self.calls = [call]

    def context_len(self) -> int:
        return self.n

    def is_extended_by(self, prompt: list[int]) -> bool:
        """Exact token-prefix test: prompt[:len(context)] == context."""
        k = len(self.last_prompt)
        return len(prompt) >= self.n and prompt[:k] == self.last_prompt and prompt[k : self.n] == self.last_response

    def extend(self, call: int, t: Triplet) -> None:
        """Append call `t`: the observation prompt[n:] (attended, loss-masked), then its response."""
        prompt, response = _ids(t.prompt_ids), _ids(t.response_ids)
        self.spans.append((len(prompt) - len(self.prompt), len(response)))
        lp = t.logprobs
        if self.span_logprobs is not None and lp is not None and len(lp) == len(response):
            self.span_logprobs.append(lp)
        else:
            self.span_logprobs = None  # one call without (matching) logprobs → the row has none
        self.last_prompt, self.last_response = prompt, response
        self.n = len(prompt) + len(response)
        self.calls.append(call)

    def context(self) -> list[int]:
        return self.last_prompt + self.last_response

    def model_mask(self) -> list[int]:
        return [0] * len(self.prompt) + padding.spans_to_list(self.spans, 1, None, self.n - len(self.prompt))


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
        prompt = _ids(t.prompt_ids)
        extending = [s for s in open_ if s.is_extended_by(prompt)]
        if extending:
            max(extending, key=_Segment.context_len).extend(i, t)
            continue
        if open_:
            against = max(open_, key=lambda s: common_prefix_len(s.context(), prompt))
            breaks.append((i, against.calls[-1], against.context(), against.model_mask()))
        segment = _Segment(i, t)
        open_ = open_ + [segment] if multi_segment else [segment]
        segments.append(segment)
    return segments, breaks


def call_version(t: Triplet) -> int:
    """The policy version that served call `t` (the gateway's `server.version`), -1 when unknown."""
    version = (t.metadata.get("server") or {}).get("version")
    return int(version) if is_number(version) else -1


def _limit_row(
    segment: _Segment,
    rollout: CompletedRollout,
    reward: float,
    max_prompt_length: int | None,
    max_response_length: int | None,
) -> Row:
    """Apply the prompt/response limits and the empty-row rule to one segment."""
    p, r = len(segment.prompt), segment.n - len(segment.prompt)
    row = Row(
        rollout.rollout_id,
        rollout.data_id,
        list(segment.calls),
        reward,
        (segment.last_prompt, segment.last_response),
        p,
        segment.spans,
        segment.span_logprobs,
        prompt_tokens=p,
        response_tokens=r,
    )
    if max_prompt_length is not None and p > max_prompt_length:
        row.tokens_cut += p - max_prompt_length
        row.prompt_tokens, row.is_drop = max_prompt_length, True  # marked, dropped later
    if max_response_length is not None and r > max_response_length:
        row.tokens_cut += r - max_response_length
        row.response_tokens, row.truncated = max_response_length, True
        row.spans = [(s, min(n, max_response_length - s)) for s, n in segment.spans if s < max_response_length]
        if row.span_logprobs is not None:
            row.span_logprobs = row.span_logprobs[: len(row.spans)]
    row.span_versions = [call_version(rollout.triplets[c]) for c in segment.calls][: len(row.spans)]
    row.skipped_empty = not any(n for _, n in row.spans)
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
    turn_credit: str = "rollout",
    turn_gamma: float = 1.0,
) -> BuiltBatch:
    """Rows and merge breaks of the sorted rollouts (no padding, no tensors, no metrics).

    `turn_credit="return"` (transition level only): the row of call t carries its discounted
    return of turn rewards G_t (`algorithms.credit`); a rollout without turn rewards keeps its
    reward on every row (counted: `training/turn_credit/n_rollouts_without_turn_rewards`).
    """
    check_turn_credit(turn_credit, turn_gamma, check_level(level))
    rollouts = sort_rollouts(completed)
    rows: list[Row] = []
    breaks: list[BreakRecord] = []
    without_turn_rewards = 0
    for rollout in rollouts:
        reward = rollout_reward(rollout, reward_fillna_value)
        triplets = rollout.triplets or []
        credited = None
        if turn_credit == "return" and triplets:
            credited = transition_rewards([t.turn_reward for t in triplets], turn_gamma)
            without_turn_rewards += credited is None
        if level == "transition":
            segments = [_Segment(i, t) for i, t in enumerate(triplets)]
        else:
            segments, raw_breaks = merge_triplets(triplets, multi_segment)
            breaks += [_break_record(rollout, b, tokenizer, diagnose) for b in raw_breaks]
        rows += [
            _limit_row(
                s, rollout, reward if credited is None else credited[s.calls[0]], max_prompt_length, max_response_length
            )
            for s in segments
        ]
    kept = [r for r in rows if not r.skipped_empty]
    for index, row in enumerate(kept):
        row.batch_index = index
    plan = BuiltBatch(rollouts, rows, breaks, level)
    if turn_credit == "return":
        plan.metrics["training/turn_credit/n_rollouts_without_turn_rewards"] = without_turn_rewards
    return plan


def _break_record(rollout: CompletedRollout, raw: tuple, tokenizer: Any, diagnose: bool) -> BreakRecord:
    call, against, context, model_mask = raw
    t = rollout.triplets[call]
    current = list(t.prompt_ids) + list(t.response_ids)
    diagnosis = diagnose_break(context, t.prompt_ids, tokenizer, model_mask=model_mask) if diagnose else None
    return BreakRecord(
        rollout.rollout_id,
        rollout.data_id,
        call,
        against,
        prompt_tokens=len(t.prompt_ids),
        response_tokens=len(t.response_ids),
        previous_trace_tokens=len(context),
        current_trace_tokens=len(current),
        previous_trace=_trace_text(context, tokenizer),
        current_trace=_trace_text(current, tokenizer),
        diagnosis=diagnosis,
    )


def _trace_text(ids: Sequence[int], tokenizer: Any) -> str:
    text = decode_ids(ids, tokenizer)
    if len(text) <= TRACE_TEXT_LIMIT:
        return text
    return text[:TRACE_TEXT_LIMIT] + f"\n...[truncated {len(text) - TRACE_TEXT_LIMIT} chars]"


# =========================================================================== tensors (padding: agl_lab.padding)


def to_dataproto(rows: Sequence[Row], arrays: dict[str, np.ndarray], *, container: str = "verl") -> tuple[Any, int]:
    """Build the verl DataProto (`container="agl"`: a `BatchData`, no verl import); returns it and
    the number of rows lacking logprobs.

    Tensors ([N, P+R] for the full sequence): input_ids, attention_mask, position_ids =
    clamp(cumsum(attention_mask) − 1, 0), prompts, responses, response_mask (transition: the
    response attention mask; trajectory: 1 on model tokens only), is_drop_mask [N] bool,
    token_level_scores [N, R] float32 with the reward on the last attended position,
    rollout_log_probs [N, R] float32 only when every row has logprobs. Non-tensors:
    data_id_list, rollout_id_list, turn_index_list (first call of the row), uid (= data_id).
    """
    if container not in CONTAINERS:
        raise ValueError(f"build_batch: container={container!r} is not one of {list(CONTAINERS)}")
    n = len(rows)
    attention = np.concatenate([arrays["prompt_mask"], arrays["response_attention"]], axis=1)
    p, r = arrays["prompts"].shape[1], arrays["responses"].shape[1]
    lengths = arrays["prompt_lengths"] if "prompt_lengths" in arrays else arrays["prompt_mask"].sum(axis=1)
    position = padding.positions(lengths, arrays["response_lengths"], p, r)  # clamp(cumsum(mask) - 1, 0)
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
    tensors["rollout_versions"] = padding.span_values([r.spans for r in rows], [r.span_versions for r in rows], n, r)
    n_without = sum(r.span_logprobs is None for r in rows)
    if n_without == 0:
        tensors["rollout_log_probs"] = arrays["rollout_log_probs"]
    data_ids = np.array([r.data_id for r in rows], dtype=object)
    non_tensors = {
        "data_id_list": data_ids,
        "rollout_id_list": np.array([r.rollout_id for r in rows], dtype=object),
        "turn_index_list": np.array([r.calls[0] for r in rows], dtype=object),  # AGL's key name
        "uid": data_ids.copy(),
    }
    data = BatchData.from_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, non_tensors)
    return (data.to_dataproto() if container == "verl" else data), n_without


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
        "training/n_repeated_prompt_calls_dropped": sum(
            r.metadata.get("n_repeated_prompt_calls_dropped", 0) for r in rollouts
        ),
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
    turn_credit: str = "rollout",
    turn_gamma: float = 1.0,
    container: str = "verl",
) -> BuiltBatch:
    """Completed rollouts → `BuiltBatch(rollouts, rows, breaks, level, data, metrics)`.

    `tokenizer` (optional) only serves the diagnostics: merge-break classes and decoded texts.
    FAILED rollouts train with `reward_fillna_value` (AGL v1) unless `exclude_failed`, which
    leaves them out of the batch (`plan.rollouts` too); both are counted in the metrics.
    `container`: `"verl"` (a `DataProto`, what the engines take) or `"agl"` (an
    `agl_lab.batch_data.BatchData`: the same tensors without importing verl or Ray; replay's).
    Raises RuntimeError when no row has a trainable token.
    """
    n_failed = sum(r.state == "failed" for r in completed)
    if exclude_failed:
        completed = [r for r in completed if r.state != "failed"]
    for key, value in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"build_batch: {key} must be a positive int, got {value!r}.")
    plan = plan_rows(
        completed,
        level,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        reward_fillna_value=reward_fillna_value,
        multi_segment=multi_segment,
        tokenizer=tokenizer,
        diagnose=diagnose,
        turn_credit=turn_credit,
        turn_gamma=turn_gamma,
    )
    kept = [r for r in plan.rows if not r.skipped_empty]
    if not kept:
        n_traced = sum(bool(r.triplets) for r in plan.rollouts)
        failed = [r for r in plan.rollouts if r.state == "failed"]
        if failed and len(failed) == len(plan.rollouts):
            raise RuntimeError(
                f"all {len(failed)} rollouts failed, so there is nothing to train on. First error "
                f"(rollout {failed[0].rollout_id}):\n{failed[0].error_message or 'no error message'}\n"
                "Every error: RolloutResult.lifecycle[['rollout_id', 'state', 'error_message']]."
            )
        raise RuntimeError(
            f"zero training rows: {len(plan.rollouts)} rollouts ({n_failed if exclude_failed else 0} FAILED ones "
            f"excluded), {n_traced} with model calls, "
            f"{len(plan.rows)} rows without a trainable token. Likely causes: the agents do not call "
            "the model through the gateway (use the base_url their rollout gives them), or every "
            "call returned an empty response (check the agent's max_tokens and the response limits)."
        )
    arrays = pad_rows(kept, max_prompt_length, max_response_length, pad_token_id)
    plan.data, n_without = to_dataproto(kept, arrays, container=container)
    plan.metrics = {**train_metrics(plan, reward_fillna_value, n_without), **plan.metrics}
    plan.metrics["training/n_failed_rollouts_excluded"] = n_failed if exclude_failed else 0
    return plan
