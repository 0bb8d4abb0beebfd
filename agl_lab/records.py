"""Records: what a finished rollout becomes before the learning side touches it (pure leaf).

A `Triplet` is one LLM call of a rollout reduced to token ids; a `CompletedRollout` is one
terminal rollout with its triplets, final reward and lifecycle timestamps. This module
imports only `agl_lab.protocol` (plus numpy), so both sides of the wire share it: the server
serves the triplet view, the rollout managers build completed rollouts, and the pure core
(batch, views, diagnose) reads them without pulling in HTTP.

The path of one rollout's events, top to bottom:

1. **Triplet view** (server side, `GET .../events?format=triplet`): each `model_request`
   is trimmed to `{prompt_token_ids, response_token_ids, response_log_probs, server, ...}`,
   each `reward` to `{value, [source], [reason]}`; only the last call per distinct prompt
   survives (AGL v1: retries keep their final answer); the dropped calls are counted
   (`agl_lab.rollout.count_repeated_prompts`), `agl_lab.rollout.keep_repeated_prompts=true` keeps them.
2. **Events -> CompletedRollout** (learning side, AGL v1 parity): error calls and calls
   without response tokens are skipped, the last reward event wins and lands on the last
   triplet, malformed logprobs become None, `policy_version` is the oldest `model_version`
   the rollout's calls were served with.
3. **Lifecycle metrics**: queue wait, run duration and total time per rollout.
4. **Order**: `sort_rollouts` — the one key every batch and view sorts by.

Logprobs are validated in one place (`clean_logprobs`): the triplet view and the
completed-rollout builder both call it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agl_lab.protocol import Event, Rollout, is_number, reward_problem

LIFECYCLE_PREFIXES = ("timing/rollout_queue_wait_s", "timing/rollout_run_duration_s", "timing/rollout_total_s")


@dataclass
class Triplet:
    """One model call: prompt ids, sampled response ids (+ their logprobs), reward.

    | field        | type              | meaning                                              |
    |--------------|-------------------|------------------------------------------------------|
    | prompt_ids   | list[int] (P,)    | the ids the server saw as the prompt                 |
    | response_ids | list[int] (R,)    | the ids the server sampled                           |
    | logprobs     | list[float] (R,)  | sampling logprobs of `response_ids`, or None         |
    | reward       | float | None      | set on the last triplet of a rollout (final reward)  |
    | metadata     | dict              | `{"server": {"model", "version"}}` from the gateway  |
    | turn_reward  | float | None      | the `turn_reward` events after this call, summed     |
    | timeout_extensions | int         | times the gateway waited past `upstream_timeout_seconds` on this call because the engine was still working on it (`upstream_timeout_extensions`) |
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None = None
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    turn_reward: float | None = None
    timeout_extensions: int = 0


@dataclass
class CompletedRollout:
    """A terminal rollout as the learning side sees it.

    `step` is the trainer step at which the rollout was enqueued, `sample_idx` its task's
    position in that step's batch and `copy_idx` which of the task's `n` copies it is; the
    batch builder sorts by `(step, sample_idx, copy_idx)` so the order of completion never
    changes the batch. `copy_idx` is keyword-only (positional construction stays as it was).
    """

    rollout_id: str
    data_id: str
    step: int
    sample_idx: int
    copy_idx: int = field(default=0, kw_only=True)
    triplets: list[Triplet] = field(default_factory=list)
    final_reward: float | None = None
    state: str = "succeeded"
    error_message: str | None = None
    input: Any = None
    enqueue_time: float | None = None
    running_at: float | None = None
    finished_at: float | None = None
    policy_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    triplet_events: list[dict[str, Any]] = field(default_factory=list)
    enqueue_policy_version: int | None = None


# =============================================================================================
# The one logprob validator
# =============================================================================================


def _finite_float(value: Any) -> float | None:
    """`value` as a finite float (numbers and numeric strings, not bools), else None."""
    if not (is_number(value) or isinstance(value, str)):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def clean_logprobs(value: Any, n_tokens: int | None = None) -> list[float] | None:
    """`value` as a list of finite floats (of length `n_tokens` if given), or None.

    Any element that is not a finite number (NaN, inf, bool, None, text) makes the whole
    list None: a partial logprob list would misalign with the response tokens.
    """
    if not isinstance(value, (list, tuple)) or (n_tokens is not None and len(value) != n_tokens):
        return None
    out = []
    for v in value:
        if (f := _finite_float(v)) is None:
            return None
        out.append(f)
    return out


# =============================================================================================
# Stage 1 — the triplet view the store serves (GET /api/rollouts/{id}/events?format=triplet)
# =============================================================================================


def triplet_events(events: Sequence[Event], *, keep_repeated_prompts: bool = False) -> list[Event]:
    """Trim events for the learning side, then keep the last model_request per prompt.

    model_request -> {prompt_token_ids, response_token_ids, response_log_probs,
                      server: {model, version}, [http_status], [status], [error]}
    reward        -> {value, [source], [reason]}
    other types   -> unchanged
    Among model_requests only the last event per distinct prompt_token_ids survives (an agent
    retrying a prompt keeps its final answer); other events are never removed.
    `keep_repeated_prompts=True` keeps every model_request.
    """
    trimmed = [_trim_event(e) for e in events]
    if keep_repeated_prompts:
        return trimmed
    last_by_prompt: dict[tuple[Any, ...], int] = {}
    for i, event in enumerate(trimmed):
        if event.event_type == "model_request":
            prompt = event.data.get("prompt_token_ids")
            last_by_prompt[tuple(prompt) if isinstance(prompt, list) else ()] = i
    keep = set(last_by_prompt.values())
    return [e for i, e in enumerate(trimmed) if e.event_type != "model_request" or i in keep]


def _trim_event(event: Event) -> Event:
    if event.event_type == "model_request":
        return event.model_copy(update={"data": _trim_model_request(event.data)})
    if event.event_type == "reward":
        data = {"value": event.data.get("value")}
        data.update({k: event.data[k] for k in ("source", "reason") if k in event.data})
        return event.model_copy(update={"data": data})
    return event


def _ids_from_chunks(chunks: list[Any]) -> tuple[Any, list[Any]]:
    """(prompt ids, response ids) of a legacy response stored as raw stream chunks."""
    prompt_ids: Any = []
    response_ids: list[Any] = []
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        if not prompt_ids and chunk.get("prompt_token_ids"):
            prompt_ids = chunk["prompt_token_ids"]
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            response_ids.extend(choices[0].get("token_ids") or [])
    return prompt_ids, response_ids


def _trim_model_request(data: dict[str, Any]) -> dict[str, Any]:
    response = data.get("response")
    prompt_ids: Any = []
    response_ids: Any = []
    log_probs: list[float] | None = None
    if isinstance(response, dict):
        prompt_ids = response.get("prompt_token_ids") or []  # chat: top level
        choices = response.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(first, dict):  # only the first choice is captured (n > 1 unsupported)
            prompt_ids = prompt_ids or first.get("prompt_token_ids") or []  # completions
            response_ids = first.get("token_ids") or []
            log_probs = extract_log_probs(first)
    elif isinstance(response, list):  # legacy: raw stream chunks
        prompt_ids, response_ids = _ids_from_chunks(response)
    server = data.get("server") if isinstance(data.get("server"), dict) else {}
    bad = [
        name
        for name, ids in (("prompt_token_ids", prompt_ids), ("response_token_ids", response_ids))
        if not _are_token_ids(ids)
    ]
    if bad:  # kept with a reason and no tokens: the builder skips calls without response tokens
        prompt_ids, response_ids, log_probs = [], [], None
    out: dict[str, Any] = {
        "prompt_token_ids": prompt_ids,
        "response_token_ids": response_ids,
        "response_log_probs": log_probs,
        "server": {"model": server.get("model"), "version": server.get("version")},
    }
    out.update({k: data[k] for k in ("http_status", "status", "overridden", "timeout_extensions") if k in data})
    if isinstance(response, dict) and "error" in response:
        out["error"] = response["error"]
    if bad:
        out["skipped"] = f"{' and '.join(bad)} must be lists of non-negative integers; call not usable for training"
    return out


def _are_token_ids(ids: Any) -> bool:
    """True for a list of non-negative ints (bools are not token ids)."""
    return isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)


def extract_log_probs(choice: dict[str, Any]) -> list[float] | None:
    """Chosen-token logprobs of one choice, or None if missing/odd. Never raises.

    chat schema:        choice.logprobs.content = [{"logprob": float, ...}, ...]
    completions schema: choice.logprobs.token_logprobs = [float, ...]
    The values go through `clean_logprobs` (one bad value makes the whole list None).
    """
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("content"), list):
        items = lp["content"]
        if not all(isinstance(it, dict) and "logprob" in it for it in items):
            return None
        return clean_logprobs([it["logprob"] for it in items])
    return clean_logprobs(lp.get("token_logprobs"))


# =============================================================================================
# Stage 2 — events -> CompletedRollout
# =============================================================================================


def _is_error_call(data: Mapping[str, Any]) -> bool:
    status = data.get("http_status")
    return data.get("status") == "error" or (is_number(status) and int(status) >= 400)


def triplets_from_events(triplet_events: Sequence[Mapping[str, Any]]) -> list[Triplet]:
    """The rollout's usable model calls, in order (events in the server's `format=triplet`).

    Skipped: `status == "error"` or `http_status >= 400` (e.g. context overflow), and calls
    without response tokens. The final reward is not set here; a `turn_reward` event
    (`{"reward": float, ...}`, as agl_lab/tasks/gem_games.py emits one per environment step) is
    added to the `turn_reward` of the last kept call before it (one before any call is ignored).
    """
    triplets: list[Triplet] = []
    for event in triplet_events:
        data = event.get("data") or {}
        if event.get("event_type") == "turn_reward":
            value = data.get("reward")
            if triplets and is_number(value) and math.isfinite(float(value)):
                triplets[-1].turn_reward = (triplets[-1].turn_reward or 0.0) + float(value)
            continue
        if event.get("event_type") != "model_request" or _is_error_call(data):
            continue
        response_ids = [int(t) for t in data.get("response_token_ids") or []]
        if not response_ids:
            continue
        triplets.append(
            Triplet(
                prompt_ids=[int(t) for t in data.get("prompt_token_ids") or []],
                response_ids=response_ids,
                logprobs=clean_logprobs(data.get("response_log_probs"), len(response_ids)),
                metadata={
                    "server": data.get("server"),
                    **({"overridden": data["overridden"]} if data.get("overridden") else {}),
                },
                timeout_extensions=int(extended) if is_number(extended := data.get("timeout_extensions")) else 0,
            )
        )
    return triplets


def reward_from_events(events: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
    """(value of the **last** `reward` event, None) or (None, why it is unusable); (None, None) without one."""
    rewards = [e for e in events if e.get("event_type") == "reward"]
    if not rewards:
        return None, None
    value = (rewards[-1].get("data") or {}).get("value")
    problem = reward_problem(value)
    return (None, problem) if problem else (float(value), None)


def final_reward_from_events(events: Sequence[Mapping[str, Any]]) -> float | None:
    """Value of the **last** `reward` event if it is a finite float32 (not a bool), else None."""
    return reward_from_events(events)[0]


def policy_version_from_events(raw_events: Sequence[Mapping[str, Any]]) -> int | None:
    """Oldest `model_version` among the rollout's model calls (None if no call carries one)."""
    versions = [
        int(v)
        for e in raw_events
        if e.get("event_type") == "model_request" and is_number(v := (e.get("data") or {}).get("model_version"))
    ]
    return min(versions) if versions else None


def _copy_idx_of(rollout: Rollout) -> int:
    """The copy index the rollout managers write into `metadata.copy_idx` (0 if absent)."""
    value = getattr(rollout.metadata, "copy_idx", None)
    return int(value) if is_number(value) else 0


def events_to_completed_rollout(
    rollout: Rollout,
    raw_events: Sequence[Mapping[str, Any]],
    triplet_events: Sequence[Mapping[str, Any]],
    *,
    data_id: str,
    step: int,
    sample_idx: int,
    copy_idx: int | None = None,
    enqueue_time: float | None = None,
    running_at: float | None = None,
    finished_at: float | None = None,
    enqueue_policy_version: int | None = None,
) -> CompletedRollout:
    """Reduce a terminal rollout and its events to what the batch builder needs.

    The final reward goes on the last triplet (AGL v1); FAILED rollouts are built the same
    way — they are trained with the calls they made (`state` lets the trainer filter them).
    A last reward that is not a finite float32 (`reward_problem`) makes the rollout FAILED with
    the reason in `error_message` and `metadata["reward_error"]`, and no final reward.
    `copy_idx` defaults to the rollout's `metadata.copy_idx`.
    """
    triplets = triplets_from_events(triplet_events)
    final_reward, reward_error = reward_from_events(triplet_events)
    if triplets and final_reward is not None:
        triplets[-1].reward = final_reward
    state, error_message = str(rollout.status.state), rollout.status.error_message
    metadata = rollout.metadata.model_dump(mode="json")
    if reward_error is not None:
        state, metadata["reward_error"] = "failed", reward_error
        error_message = reward_error if not error_message else f"{error_message}; {reward_error}"
    return CompletedRollout(
        rollout_id=rollout.rollout_id,
        data_id=data_id,
        step=step,
        sample_idx=sample_idx,
        copy_idx=_copy_idx_of(rollout) if copy_idx is None else copy_idx,
        triplets=triplets,
        final_reward=final_reward,
        state=state,
        error_message=error_message,
        input=rollout.input,
        enqueue_time=enqueue_time,
        running_at=running_at,
        finished_at=finished_at if finished_at is not None else rollout.status.updated_at,
        policy_version=policy_version_from_events(raw_events),
        metadata=metadata,
        events=[dict(e) for e in raw_events],
        triplet_events=[dict(e) for e in triplet_events],
        enqueue_policy_version=enqueue_policy_version,
    )


def completed_rollout_to_dict(completed: CompletedRollout) -> dict[str, Any]:
    """JSON-ready dict of a completed rollout (for checkpoints)."""
    return dataclasses.asdict(completed)


def completed_rollout_from_dict(data: Mapping[str, Any]) -> CompletedRollout:
    """Inverse of `completed_rollout_to_dict`."""
    fields = dict(data)
    fields["triplets"] = [Triplet(**t) for t in fields.get("triplets") or []]
    return CompletedRollout(**fields)


# =============================================================================================
# Stage 3 — lifecycle metrics
# =============================================================================================


def _summary(prefix: str, values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    return {
        f"{prefix}/mean": float(arr.mean()),
        f"{prefix}/p50": float(np.percentile(arr, 50)),
        f"{prefix}/p90": float(np.percentile(arr, 90)),
        f"{prefix}/max": float(arr.max()),
    }


def lifecycle_metrics(completed: Sequence[CompletedRollout]) -> dict[str, float]:
    """Queue wait (`running_at - enqueue_time`), run (`finished_at - running_at`) and total.

    `enqueue_time` is the trainer's clock, `running_at`/`finished_at` the server's (same
    host assumed). A summary is emitted only for non-empty lists, as in AGL v1.
    """
    spans: dict[str, list[float]] = {p: [] for p in LIFECYCLE_PREFIXES}
    n_missing_running = 0
    for c in completed:
        n_missing_running += c.running_at is None
        pairs = ((c.enqueue_time, c.running_at), (c.running_at, c.finished_at), (c.enqueue_time, c.finished_at))
        for prefix, (start, end) in zip(LIFECYCLE_PREFIXES, pairs):
            if start is not None and end is not None:
                spans[prefix].append(end - start)
    metrics: dict[str, float] = {"timing/rollout_n_missing_running_ts": float(n_missing_running)}
    for prefix, values in spans.items():
        if values:
            metrics.update(_summary(prefix, values))
    return metrics


def critical_path_metrics(completed: Sequence[CompletedRollout]) -> dict[str, float]:
    """The phase's serial tail, from the recorded calls (#51): a rollout's calls run in series, each
    a prefill (which samples its first token) then one decode step per further completion token, so
    the phase lasts at least its slowest rollout's

        rollout/critical_path_decode_steps = max over rollouts of Σ (len(response_ids) − 1) of its calls

    decode steps, plus `rollout/critical_path_calls` prefills (that rollout's calls);
    `rollout/mean_decode_steps` is the mean over rollouts. Comparable with the engine's own
    `rollout/decode_steps`, which the critical path never exceeds. Rollouts without calls count 0;
    nothing without rollouts."""
    if not completed:
        return {}
    steps = [sum(max(len(t.response_ids) - 1, 0) for t in c.triplets) for c in completed]
    slowest = max(range(len(completed)), key=steps.__getitem__)
    return {
        "rollout/critical_path_decode_steps": float(steps[slowest]),
        "rollout/critical_path_calls": float(len(completed[slowest].triplets)),
        "rollout/mean_decode_steps": float(np.mean(steps)),
    }


# =============================================================================================
# Stage 4 — the rollout order
# =============================================================================================


def sort_rollouts(completed: Sequence[CompletedRollout]) -> list[CompletedRollout]:
    """Order by (step, sample_idx, copy_idx, rollout_id): carry-overs first, completion order
    ignored, and (with the copy index the rollout managers record) independent of the random
    rollout ids, so a seeded run builds the same batch every time."""
    return sorted(completed, key=lambda r: (r.step, r.sample_idx, r.copy_idx, r.rollout_id))
