"""What the policy can learn from: one agent's bad events fail its rollout, never the step.

    learning_problem(rollout, vocab_size, max_abs_reward) -> str | None    why not (None: it can)
    fail_unlearnable(rollouts, vocab_size, max_abs_reward) -> [failed]     mark them FAILED, drop their calls

The store accepts any JSON an agent sends (`agl_lab.server.storable`) and `records` turns
it into triplets; what a triplet must also be for the update to run is checked here, once per
collected rollout (`rollout.fail_unlearnable_rollouts`, called by `Trainer.rollout`). Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from agl_lab.records import CompletedRollout

DEFAULT_MAX_ABS_REWARD = 1e6  # agl_lab.algorithm.max_abs_reward: beyond it, group statistics overflow float32


def learning_problem(
    completed: CompletedRollout, vocab_size: int | None, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
) -> str | None:
    """Why the policy cannot learn from `completed` (None when it can): what one agent's bad
    events would otherwise turn into an error that ends the whole step.

    - a call with an empty prompt (P = 0: no position to score its first response token from);
    - a prompt or response token id outside [0, vocab_size) (the embedding has no such row;
      `vocab_size` None skips this check);
    - a reward with |r| > max_abs_reward (finite, but its group's mean and std overflow float32).
    """
    for i, t in enumerate(completed.triplets or []):
        if not t.prompt_ids:
            return f"model call {i} has an empty prompt_token_ids (no prompt to score its response from)"
        if vocab_size is not None:
            for name, ids in (("prompt_token_ids", t.prompt_ids), ("response_token_ids", t.response_ids)):
                bad = [x for x in ids if not 0 <= x < vocab_size]
                if bad:
                    return (
                        f"model call {i}: {name} holds {len(bad)} id(s) outside the vocabulary "
                        f"[0, {vocab_size}), e.g. {bad[:3]}"
                    )
    rewards = [completed.final_reward] + [t.reward for t in completed.triplets or []]
    for r in rewards:
        if r is not None and not abs(r) <= max_abs_reward:
            return (
                f"reward {r!r} is beyond agl_lab.algorithm.max_abs_reward={max_abs_reward:g} "
                "(raise it if rewards this large are meant)"
            )
    return None


def fail_unlearnable(
    completed: Sequence[CompletedRollout], vocab_size: int | None, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
) -> list[CompletedRollout]:
    """Mark each rollout with a `learning_problem` FAILED, with the reason in `error_message` and
    `metadata["learning_error"]`, and drop its calls and reward (nothing of it trains); returns them."""
    failed = []
    for rollout in completed:
        problem = learning_problem(rollout, vocab_size, max_abs_reward)
        if problem is None:
            continue
        rollout.state, rollout.metadata["learning_error"] = "failed", problem
        rollout.error_message = problem if not rollout.error_message else f"{rollout.error_message}; {problem}"
        rollout.triplets, rollout.final_reward = [], None
        failed.append(rollout)
    return failed
