"""Turn credit: each transition's own discounted return instead of the rollout's one reward.

An environment that rewards each turn (a GEM game: `turn_reward` events, attached by
`records.triplets_from_events` to the call before them) gives a rollout of T calls the turn
rewards r_0 … r_{T-1} (0 for a call without one). With `agl_lab.algorithm.turn_credit: return`
the transition of call t is credited with its discounted return

    G_t = r_t + γ G_{t+1},  G_T = 0      (γ = agl_lab.algorithm.turn_gamma, in [0, 1])

so a turn is credited for what happened from it on, not for the turns before it. Each call is
its own row (trace_aggregator.level=transition) carrying G_t on its last token, and the outcome
estimator (GRPO) runs per row over the rows of a task's group
(`algorithm.enable_rollout_level_advantage=false`): A_t = (G_t − mean_g G) / (std_g G + ε)
over every transition of every rollout of group g. `turn_credit: rollout` (the default) keeps
today's behaviour: every row of a rollout carries the rollout's reward.

A task whose agent emits no turn reward makes `return` equal `rollout`: the Trainer says so at
load time for the built-in tasks known to emit none (`unused_turn_credit_at_load`) and at the
first step whose rollouts carry none (`unused_turn_credit_at_step`).

Pure: lists of floats in, lists of floats out; strings in, warning lines out.
"""

from __future__ import annotations

from collections.abc import Sequence


def discounted_returns(rewards: Sequence[float | None], gamma: float) -> list[float]:
    """G_t = Σ_{k≥t} γ^{k−t} r_k for each t (None counts as 0); [T] → [T]."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t] or 0.0) + gamma * running
        out[t] = running
    return out


def transition_rewards(turn_rewards: Sequence[float | None], gamma: float) -> list[float] | None:
    """The credited reward of each call of a rollout: its discounted return; None when the
    rollout recorded no turn reward at all (the caller then credits the rollout's reward)."""
    if all(r is None for r in turn_rewards):
        return None
    return discounted_returns(turn_rewards, gamma)


# ---------------------------------------------------------------------------------------------
# Saying when `turn_credit: return` does nothing
# ---------------------------------------------------------------------------------------------

#: Built-in tasks whose agents emit no `turn_reward` event (docs/environments.md's table): under
#: `turn_credit: return` each of their rows carries the rollout's reward, as under `rollout`.
TASKS_WITHOUT_TURN_REWARDS = ("lookup", "calc", "calc_chain", "reasoning_gym:<dataset>")


def task_emits_no_turn_rewards(task_name: str) -> bool:
    """True for a built-in task whose own agents never emit a `turn_reward` event."""
    return task_name in TASKS_WITHOUT_TURN_REWARDS or task_name.startswith("reasoning_gym:")


def unused_turn_credit_at_load(turn_credit: str, task_name: str, own_agent: bool) -> str | None:
    """The load-time warning: `turn_credit: return` on a built-in task whose own agent (`own_agent`:
    the agent is one of the task's) emits no turn rewards; None when nothing is wrong."""
    if turn_credit != "return" or not own_agent or not task_emits_no_turn_rewards(task_name):
        return None
    return (
        f"agl_lab.algorithm.turn_credit=return does nothing on task {task_name!r}: its agent emits no "
        "turn_reward event, so every row carries the rollout's reward, as under turn_credit=rollout "
        "(docs/environments.md lists the tasks that emit turn rewards)"
    )


def unused_turn_credit_at_step(task_name: str, step: int, n_without: int, n_rollouts: int) -> str | None:
    """The warning of the first step in which `n_without` of `n_rollouts` rollouts recorded no
    turn reward (`training/turn_credit/n_rollouts_without_turn_rewards`); None when all did."""
    if n_without <= 0:
        return None
    return (
        f"agl_lab.algorithm.turn_credit=return: step {step}: {n_without} of {n_rollouts} rollouts of task "
        f"{task_name!r} recorded no turn_reward event, so their rows carry the rollout's reward, as under "
        "turn_credit=rollout; emit turn_reward events from the agent or pick a task that does "
        "(docs/environments.md). Warned once; training/turn_credit/n_rollouts_without_turn_rewards counts them"
    )
