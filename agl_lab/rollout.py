"""Rollout phase: the data that comes back from agents, and the managers that collect it.

A `Triplet` is one LLM call of a rollout reduced to token ids; a `CompletedRollout` is one
terminal rollout with its triplets, final reward and lifecycle timestamps. The batch builder
(`agl_lab.batch`) turns a list of completed rollouts into training rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None = None
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletedRollout:
    """A terminal rollout as the learning side sees it.

    `step` is the trainer step at which the rollout was enqueued and `sample_idx` its task's
    position in that step's batch; the batch builder sorts by `(step, sample_idx)` so the
    order of completion never changes the batch.
    """

    rollout_id: str
    data_id: str
    step: int
    sample_idx: int
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
