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

Pure: lists of floats in, lists of floats out.
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
