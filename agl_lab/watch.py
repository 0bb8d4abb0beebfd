"""Runs that cannot learn, said early and with the fix (pure: no I/O beyond the warning).

Two ways a first run trains nothing while every line looks normal:

- **The tiny model was never warm-started for this agent.** A custom agent or dataset has no
  demonstrations, so the built-in tiny model (0.46 M parameters, random weights) answers in
  byte soup and no reply parses. `untrained_tiny_model_message` says so when the engine is built.
- **Every rollout gets the same reward, step after step** (all 0.000: nothing parsed, or every
  rollout FAILED, or none posted a reward; all 1: too easy). Every GRPO group then has advantage
  0 and the update has no signal. `FlatRewardWatch` warns once, after `FLAT_STEPS` such steps in
  a row, with the likely cause — failures, missing rewards and unparseable replies told apart.
  When an earlier step had a group whose rewards differed, the task *can* give signal: the
  warning says so (the policy collapsed onto one outcome) and, under `turn_credit` other than
  `rollout`, names credit assignment as a possible cause rather than the task.

Both go to this module's logger as warnings (a notebook shows them; `agl-lab train` prints them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

logger = logging.getLogger(__name__)

FLAT_STEPS = 3  # training steps in a row with one reward for every rollout before the warning

TINY_FIX = (
    "give the model demonstrations to warm-start on (register a Task with demonstrations= and set "
    "agl_lab.model.warm_start_steps; docs/your-agent.md 'A task: datasets, agent, reward and demonstrations'), "
    "or train a real model (agl_lab.model.preset=smollm2-135m, or agl_lab.model.path=DIR)"
)


def untrained_tiny_model_message(*, tiny: bool, warm_start_steps: int, has_demonstrations: bool) -> str | None:
    """The warning for a built-in tiny model that starts with random weights, else None."""
    if not tiny or (warm_start_steps > 0 and has_demonstrations):
        return None
    why = "agl_lab.model.warm_start_steps=0" if has_demonstrations else "the agent/dataset comes without demonstrations"
    return (
        "the built-in tiny model gets no warm start (" + why + "): it starts from random weights, so its "
        "replies will not parse for your agent and every reward is likely the same. Fix: " + TINY_FIX
    )


def for_run(cfg, task, *, engine_given: bool) -> FlatRewardWatch:
    """The watch of a Trainer on `cfg`; warns now when its engine will be an untrained tiny model."""
    lab = cfg.agl_lab
    tiny = not engine_given and lab.model.path is None and lab.model.get("preset") is None
    message = untrained_tiny_model_message(
        tiny=tiny,
        warm_start_steps=int(lab.model.warm_start_steps) if task is not None else 0,
        has_demonstrations=task is not None and task.demonstrations is not None,
    )
    if message:
        logger.warning(message)
    return FlatRewardWatch(
        untrained_tiny=message is not None,
        fillna=float(cfg.agentlightning.reward_fillna_value),
        turn_credit=str(lab.algorithm.get("turn_credit", "rollout")),
    )


class FlatRewardWatch:
    """`observe(step, rewards)` once per training step; warns once when the last `steps` steps
    each gave every rollout one and the same reward (returns the message, else None)."""

    def __init__(
        self,
        steps: int = FLAT_STEPS,
        *,
        untrained_tiny: bool = False,
        fillna: float = 0.0,
        turn_credit: str = "rollout",
    ):
        self.steps, self.fillna = steps, fillna
        self.untrained_tiny, self.turn_credit = untrained_tiny, turn_credit
        self.last_signal_step: int | None = None  # the last step with a group whose rewards differ
        self.flat: list[tuple[int, float]] = []  # (step, the one reward) of the current flat streak
        self.warned = False
        self._kinds: dict[int, tuple[int, int, int]] = {}  # step → (rollouts, FAILED, without a reward)
        self._first_error: str | None = None

    def observe_rollouts(self, step: int, rollouts: Sequence) -> str | None:
        """`observe` on CompletedRollouts (a missing reward counts as reward_fillna_value, as in training);
        the warning then tells FAILED rollouts and rollouts without a reward from replies that do not parse."""
        failed = [r for r in rollouts if r.state == "failed"]
        missing = sum(r.state != "failed" and r.final_reward is None for r in rollouts)
        self._kinds[step] = (len(rollouts), len(failed), missing)
        if failed and self._first_error is None:
            self._first_error = (failed[0].error_message or "no error message").strip()[:500]
        rewards = [self.fillna if r.final_reward is None else r.final_reward for r in rollouts]
        return self.observe(step, rewards, groups=[r.data_id for r in rollouts])

    def _cause_of_fill(self) -> str | None:
        """Over the flat streak: the rollouts that got the fill value without earning a reward."""
        kinds = [self._kinds[s] for s, _ in self.flat if s in self._kinds]
        total, failed, missing = (sum(k[i] for k in kinds) for i in range(3))
        if not kinds or not (failed or missing):
            return None
        parts = []
        if failed:
            parts.append(
                f"{failed} of {total} rollouts FAILED (first error: {self._first_error}) and were "
                f"trained with agentlightning.reward_fillna_value={self.fillna:g} — fix the agent, or set "
                "agl_lab.algorithm.exclude_failed_rollouts=true"
            )
        if missing:
            parts.append(
                f"{missing} of {total} rollouts ended without a reward (the agent returned None and posted "
                f"no reward event) and got reward_fillna_value={self.fillna:g} — return the reward"
            )
        if failed + missing < total:
            parts.append(f"the other {total - failed - missing} earned that reward themselves")
        return "; ".join(parts) + ". These are not replies that do not parse"

    def observe(self, step: int, rewards: Sequence[float], groups: Sequence | None = None) -> str | None:
        """`groups` [n_rollouts]: each rollout's GRPO group key (None: one group), to tell whether the
        step had a learning signal (a group whose rewards differ) for a later warning."""
        if _any_group_varies(rewards, groups):
            self.last_signal_step = step
        values = [float(r) for r in rewards if r is not None and math.isfinite(float(r))]
        if not values or max(values) - min(values) > 1e-9 or (self.flat and abs(self.flat[-1][1] - values[0]) > 1e-9):
            self.flat = []
        if values and max(values) - min(values) <= 1e-9:
            self.flat.append((step, values[0]))
        if self.warned or len(self.flat) < self.steps:
            return None
        self.warned = True
        first, value = self.flat[0]
        fill = self._cause_of_fill()
        if fill is not None:
            cause = fill
        elif self.untrained_tiny or value == 0:
            cause = "no reply earned any reward: the agent's replies most likely do not parse. " + (
                "The built-in tiny model had no warm start for this agent. Fix: " + TINY_FIX
                if self.untrained_tiny
                else "Look at one rollout call by call (trainer.dry_run()) and at ro.triplets; "
                "a model that cannot produce the format needs demonstrations or a bigger model"
            )
        elif self.last_signal_step is not None:
            cause = "look at the last steps' rollouts (trainer.dry_run(), the recordings) for what they all do"
        else:
            cause = (
                "the task gives every rollout the same score: make rewards vary within a group (a harder "
                "or easier task, partial credit) and check the reward with trainer.dry_run()"
            )
        if self.last_signal_step is not None:
            cause = self._collapse_note() + cause
        message = (
            f"steps {first}–{step}: every rollout got reward {value:.3f}, {len(self.flat)} steps in a row, "
            f"so every GRPO group has advantage 0 and the policy cannot learn; {cause}"
        )
        logger.warning(message)
        return message

    def _collapse_note(self) -> str:
        """The lead of the cause when an earlier step had signal: the task is not (only) to blame."""
        note = (
            f"the task gave different rewards within a group up to step {self.last_signal_step}, so it can give "
            "a signal: the policy has collapsed onto one outcome"
        )
        if self.turn_credit != "rollout":
            note += (
                f". A possible cause is credit assignment (agl_lab.algorithm.turn_credit={self.turn_credit} "
                "credits each row with its return of turn rewards; compare a run with turn_credit=rollout)"
            )
        return note + ". Otherwise: "


def _any_group_varies(rewards: Sequence[float], groups: Sequence | None) -> bool:
    """True when some group (all rollouts when `groups` is None) holds two finite rewards that differ."""
    by_group: dict = {}
    for i, r in enumerate(rewards):
        if r is not None and math.isfinite(float(r)):
            by_group.setdefault(None if groups is None else groups[i], []).append(float(r))
    return any(max(v) - min(v) > 1e-9 for v in by_group.values())
