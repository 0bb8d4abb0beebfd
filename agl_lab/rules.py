"""The learning keys' accepted values, their checks and the defaults several modules share.

Pure Python (no torch, numpy or verl), so `agl_lab.config` can check a config without loading
a tensor library, and each value has one owner: the modules that apply a rule (batch,
algorithms, the engines) import it from here, and `config.validate` calls the same check, so
every rule has one error message naming its config key.
"""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------------------------------------
# Shared defaults (each defined here only)
# ---------------------------------------------------------------------------------------------

#: the policy loss agl_lab registers in verl's POLICY_LOSS_REGISTRY (actor.policy_loss.loss_mode)
LOSS_NAME = "per_rollout_mean"
#: policy losses under which a zero-advantage row adds exactly 0 (row-separable, a multiple of the
#: advantage): agl_lab.algorithm.skip_zero_advantage applies only with these (engines/zero_skip.py)
ZERO_SKIP_LOSSES = (LOSS_NAME, "vanilla")
#: tokens of prompt + response a served model accepts (agl_lab.model.max_model_len)
MAX_MODEL_LEN = 1024
#: the serving scheduler: how long a first request waits for company, and the most it decodes at once
#: (agl_lab.engine_options.batch_window_ms / max_batch_size)
BATCH_WINDOW_MS = 3.0
MAX_BATCH_SIZE = 64

# ---------------------------------------------------------------------------------------------
# Accepted values
# ---------------------------------------------------------------------------------------------

#: agentlightning.trace_aggregator.level
LEVELS = ("transition", "trajectory")
#: agl_lab.algorithm.normalize_by: what D counts in the per-rollout loss weight 1/D
DIVISORS = ("rollouts", "rows")
#: agl_lab.parity.drop_order: after_advantage (agl_lab) | agl (AGL v1: before advantages, by row)
DROP_ORDERS = ("after_advantage", "agl")
#: agl_lab.algorithm.small_batch: train a batch smaller than one mini-batch, or skip the step
SMALL_BATCH_CHOICES = ("train", "skip")
#: agl_lab.algorithm.turn_credit: every row carries the rollout's reward, or each transition its
#: own discounted return of turn rewards (agl_lab/algorithms/credit.py)
TURN_CREDITS = ("rollout", "return")
#: the order selection drops whole rollouts in
SELECTION_POLICIES = ("zero_adv_first", "random")
#: estimators whose advantages vary along the tokens of a row: nothing scalar to broadcast
TOKEN_LEVEL_ESTIMATORS = ("gae", "optimal_token_baseline", "tir_optimal_token_baseline")
OUTCOME_HINT = "grpo, rloo, grpo_passk, reinforce_plus_plus_baseline, opo or gpg"


# ---------------------------------------------------------------------------------------------
# Checks (ValueError naming the config key)
# ---------------------------------------------------------------------------------------------


def check_level(level: str) -> str:
    """`level` if it is one of `LEVELS`."""
    if level not in LEVELS:
        raise ValueError(
            f"Unknown trace_aggregator_level: {level!r}; set agentlightning.trace_aggregator.level "
            f"to one of {list(LEVELS)}."
        )
    return level


def check_divisor(divisor: str) -> str:
    """`divisor` if it is one of `DIVISORS`."""
    if divisor not in DIVISORS:
        raise ValueError(
            f"agl_lab.algorithm.normalize_by={divisor!r} is not one of {list(DIVISORS)}: "
            "'rollouts' follows the tech report (Eq. 16), 'rows' reproduces AGL v1"
        )
    return divisor


def check_turn_credit(turn_credit: str, turn_gamma: float, level: str, rollout_level: bool = False) -> str:
    """`turn_credit` if it is one of `TURN_CREDITS` and the rest of the config can apply it.

    `rollout_level` is `algorithm.enable_rollout_level_advantage`: `config.validate` passes it; the
    batch builder, which does not know it, checks the rest."""
    if turn_credit not in TURN_CREDITS:
        raise ValueError(f"agl_lab.algorithm.turn_credit={turn_credit!r} is not one of {list(TURN_CREDITS)}")
    if not 0.0 <= float(turn_gamma) <= 1.0:
        raise ValueError(f"agl_lab.algorithm.turn_gamma must be in [0, 1], got {turn_gamma!r}")
    if turn_credit == "return" and level != "transition":
        raise ValueError(
            "agl_lab.algorithm.turn_credit=return credits each transition with its own return: set "
            f"agentlightning.trace_aggregator.level=transition (it is {level!r})"
        )
    if turn_credit == "return" and rollout_level:
        raise ValueError(
            "agl_lab.algorithm.turn_credit=return gives the rows of one rollout different rewards, which "
            "rollout-level advantage cannot broadcast: set algorithm.enable_rollout_level_advantage=false"
        )
    return turn_credit


def check_drop_order(drop_order: str) -> str:
    """`drop_order` if it is one of `DROP_ORDERS`."""
    if drop_order not in DROP_ORDERS:
        raise ValueError(
            f"agl_lab.parity.drop_order={drop_order!r} is not one of {list(DROP_ORDERS)}: 'after_advantage' "
            "drops whole rollouts after the advantages (agl_lab), 'agl' drops rows before them (AGL v1)"
        )
    return drop_order


def check_async_sizes(train_batch_size: int, async_train_batch_size: int | None, max_staleness: int = 0) -> None:
    """The async size rule (config validation and `rollout.AsyncRolloutManager` both call it):
    more groups in flight than a step trains on, or nothing is ever carried over — under overlap
    (`max_staleness` > 0) one batch is enough: the next batch generates while this one trains."""
    if not isinstance(train_batch_size, int) or train_batch_size < 1:
        raise ValueError(f"data.train_batch_size must be an int >= 1, got {train_batch_size!r}")
    least = train_batch_size if max_staleness else train_batch_size + 1
    if (
        not isinstance(async_train_batch_size, int)
        or isinstance(async_train_batch_size, bool)
        or async_train_batch_size < least
    ):
        if max_staleness:
            raise ValueError(
                f"agentlightning.async_rollout.async_train_batch_size ({async_train_batch_size!r}) must be an int >= "
                f"data.train_batch_size ({train_batch_size}) under overlap (agl_lab.rollout.max_staleness="
                f"{max_staleness}); set it to {max_staleness * train_batch_size} (max_staleness × train_batch_size)"
            )
        raise ValueError(
            f"agentlightning.async_rollout.async_train_batch_size ({async_train_batch_size!r}) must be an int > "
            f"data.train_batch_size ({train_batch_size}) when async rollout is on; set it to e.g. "
            f"{2 * train_batch_size} (2 × train_batch_size, as AGL recommends)"
        )


def overlap_buffer_excess(train_batch_size: int, async_train_batch_size: int, max_staleness: int) -> str | None:
    """Why a carry-over buffer too deep for the staleness bound wastes generation (None: it fits).

    Groups leave the buffer oldest first, `train_batch_size` a step, so a group enqueued while an
    update trains waits about async/train steps; past `max_staleness` steps it ages out. With
    async ≤ max_staleness × train every group can train in time."""
    fits = max_staleness * train_batch_size
    if not max_staleness or async_train_batch_size <= fits:
        return None
    return (
        f"agentlightning.async_rollout.async_train_batch_size={async_train_batch_size} with "
        f"agl_lab.rollout.max_staleness={max_staleness} and data.train_batch_size={train_batch_size}: a group waits "
        f"about {async_train_batch_size / train_batch_size:g} steps in the buffer but may be only {max_staleness} "
        f"version(s) old, so groups age out every few steps and their generation is wasted (dropped, "
        f"training/overlap/n_stale_groups_dropped; measured on SmolLM2 calc at 2 × batch, staleness 1: 8 groups "
        f"dropped in 5 steps of 4); set it to {fits} (max_staleness × train_batch_size)"
    )


def check_estimator(adv_estimator: Any, *, rollout_level: bool = True) -> str:
    """Name of the estimator; raise for the ones the rollout-level pipeline cannot run."""
    name = str(getattr(adv_estimator, "value", adv_estimator))
    if name.lower() == "remax":
        raise NotImplementedError(
            "algorithm.adv_estimator=remax is not supported (as in AGL v1): the REMAX baseline needs one "
            f"extra greedy generation per task; use an outcome estimator such as {OUTCOME_HINT}"
        )
    if rollout_level and name.lower() in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={name} gives token-varying advantages, which rollout-level "
            "advantage cannot broadcast: set algorithm.enable_rollout_level_advantage=false, or use "
            f"an outcome estimator ({OUTCOME_HINT})"
        )
    return name


def check_selection_args(
    mini_batch_rows: int,
    max_ppo_update_times: int | None = None,
    policy: str = "zero_adv_first",
    small_batch: str = "train",
) -> None:
    """Raise ValueError naming the config key for an argument selection cannot use."""
    if mini_batch_rows <= 0:
        raise ValueError(
            f"mini_batch_rows must be positive (actor.ppo_mini_batch_size × rollout.n), got {mini_batch_rows}"
        )
    if max_ppo_update_times is not None and max_ppo_update_times <= 0:
        raise ValueError(
            f"agentlightning.max_ppo_update_times must be null or a positive integer, got {max_ppo_update_times}"
        )
    if policy not in SELECTION_POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {list(SELECTION_POLICIES)}")
    if small_batch not in SMALL_BATCH_CHOICES:
        raise ValueError(f"agl_lab.algorithm.small_batch={small_batch!r} is not one of {list(SMALL_BATCH_CHOICES)}")


# ---------------------------------------------------------------------------------------------
# Derived quantities
# ---------------------------------------------------------------------------------------------


def small_batch_under(drop_order: str, small_batch: str) -> str:
    """What a batch smaller than one mini-batch does: `small_batch`, except under AGL v1's drop
    order (`agl_lab.parity.drop_order=agl`), which skips the step whatever `small_batch` says, as
    AGL v1 does (`selection.agl_alignment` keeps no row of such a batch). The update decides
    whether a step trains with this, so the decision and the selection agree."""
    return "skip" if check_drop_order(drop_order) == "agl" else small_batch


def mini_batch_rows(ppo_mini_batch_size: int, rollout_n: int) -> int:
    """Rows in one PPO mini-batch. verl counts `actor.ppo_mini_batch_size` in *tasks* (prompts);
    each task has `rollout.n` rollouts, each one row at the trajectory level."""
    return int(ppo_mini_batch_size) * int(rollout_n)


def uses_bypass(rollout_correction: Any) -> bool:
    """True when `algorithm.rollout_correction` asks for bypass mode: the sampling logprobs serve
    as the old logprobs, and the actor's recompute before the update is skipped."""
    return bool((rollout_correction or {}).get("bypass_mode"))


#: the matrix products' precision over float32 CPU weights (`agl_lab.model.compute_dtype`, engines/precision.py)
COMPUTE_DTYPES = ("float32", "bfloat16")


def check_compute_dtype(value: Any) -> str | None:
    """`agl_lab.model.compute_dtype` → the dtype's name (None for null); a ValueError naming the key."""
    if value is None:
        return None
    if str(value) not in COMPUTE_DTYPES:
        raise ValueError(
            f"agl_lab.model.compute_dtype={value!r} is not one of null, {', '.join(COMPUTE_DTYPES)} "
            "(the matrix products' precision)"
        )
    return str(value)


#: what happens to a group older than `agl_lab.rollout.max_staleness` versions (docs/engines.md "Overlap")
STALE_GROUPS = ("drop", "wait")


def check_overlap(max_staleness: Any, stale_groups: str, engine: str = "local", async_enabled: bool = True) -> int:
    """The overlap rule: `agl_lab.rollout.max_staleness` counts policy versions (0 = the synchronous
    loop, no overlap); N > 0 needs the local engine (its serving copy) and the carry-over manager.
    Returns N."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"agl_lab.rollout.max_staleness={max_staleness!r}: use an int >= 0 (policy versions a trained "
            "token may lag; 0 = no overlap, 1 = one-step off-policy)"
        )
    if stale_groups not in STALE_GROUPS:
        raise ValueError(f"agl_lab.rollout.stale_groups={stale_groups!r} is not one of {list(STALE_GROUPS)}")
    if max_staleness and engine != "local":
        raise ValueError(
            f"agl_lab.rollout.max_staleness={max_staleness} overlaps generation with the update, which only "
            f"the local engine does (a serving copy of its weights); agl_lab.engine={engine} does not yet "
            "(#50 item 5): set agl_lab.rollout.max_staleness=0 or agl_lab.engine=local"
        )
    if max_staleness and not async_enabled:
        raise ValueError(
            f"agl_lab.rollout.max_staleness={max_staleness} needs the carry-over collection that runs while "
            "the update trains: set agentlightning.async_rollout.enabled=true (and async_train_batch_size)"
        )
    return max_staleness
