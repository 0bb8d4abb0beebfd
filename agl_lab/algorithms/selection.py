"""What to train on: marked rows out, then whole rollouts out until whole mini-batches remain.

Unlike AGL v1, selection runs *after* the advantages are computed (dropping a rollout must
not change the advantages of the rollouts kept), drops whole zero-advantage groups first
(they carry no policy gradient), then whole rollouts at random with a seeded RNG — never
part of a rollout — and never skips a step silently. Every drop is a metric *and* a record
`{rollout_id, data_id, rows, reason}` (a row of `UpdateResult.dropped`).

Whether a step trains at all depends on row counts only (`skip_reason`), so the update
stage decides it before the engine stops serving.

Pure: DataProto in, `(kept_index, records, metrics)` out.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from agl_lab.algorithms.advantage import group_keys, rollout_ids, rollout_index, zero_advantage_groups
from agl_lab.rules import SELECTION_POLICIES, SMALL_BATCH_CHOICES, check_selection_args  # noqa: F401 (re-export)

logger = logging.getLogger(__name__)


# =============================================================================================
# The skip decision (row counts only)
# =============================================================================================


def target_rows(n: int, mini_batch_rows: int, max_updates: int | None, small_batch: str) -> int:
    """Rows to keep: whole mini-batches, at most `max_updates` of them; small batch → n or 0."""
    if n < mini_batch_rows:
        return n if small_batch == "train" else 0
    target = (n // mini_batch_rows) * mini_batch_rows
    if max_updates is not None:
        target = min(target, mini_batch_rows * max_updates)
    return target


def marked_rows(data: Any) -> np.ndarray:
    """`is_drop_mask` as bool [N] (all False when absent): rows the batch builder marked."""
    if "is_drop_mask" in data.batch.keys():
        return data.batch["is_drop_mask"].bool().cpu().numpy()
    return np.zeros(len(data), dtype=bool)


def skip_reason(
    n_trainable: int, mini_batch_rows: int, small_batch: str, *, skipped_by: str | None = None
) -> str | None:
    """Why a step with `n_trainable` unmarked rows trains nothing, or None when it trains.
    `skipped_by` names the setting that makes a small batch skip when it is not
    `agl_lab.algorithm.small_batch='skip'` (the parity drop order)."""
    if n_trainable == 0:
        return "no trainable rows left after the marked drop"
    if target_rows(n_trainable, mini_batch_rows, None, small_batch) == 0:
        setting = skipped_by or "agl_lab.algorithm.small_batch='skip'"
        return f"{n_trainable} trainable rows is fewer than one mini-batch ({mini_batch_rows} rows) and {setting}"
    return None


# =============================================================================================
# Records
# =============================================================================================


def _drop_record(data: Any, rollout_id: Any, row: int, rows: int, reason: str) -> dict[str, Any]:
    data_ids = data.non_tensor_batch.get("data_id_list")
    return {
        "rollout_id": rollout_id,
        "data_id": None if data_ids is None else data_ids[row],
        "rows": int(rows),
        "reason": reason,
    }


def drop_marked_rows(data: Any) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, int]]:
    """Rows the batch builder marked (`is_drop_mask`): dropped row by row, as AGL v1 does.

    Returns `(kept_index [K] int64, records, metrics)`; one record per affected rollout.
    """
    marked = marked_rows(data)
    records: list[dict[str, Any]] = []
    rollouts, pos = rollout_index(rollout_ids(data))
    for r in np.unique(pos[marked]):
        rows = np.flatnonzero(marked & (pos == r))
        records.append(_drop_record(data, rollouts[r], int(rows[0]), len(rows), "marked"))
    metrics = {"training/n_sample_collected": len(data), "training/n_sample_dropped/marked": int(marked.sum())}
    return np.flatnonzero(~marked), records, metrics


def skipped_step(data: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records and metrics of a skipped step: marked rows, then every other rollout `small_batch_skip`."""
    alive, records, metrics = drop_marked_rows(data)
    t = _alive_rollouts(data, alive, with_groups=False)
    records += [
        _drop_record(data, rid, t["first_row"][r], t["rows"][r], "small_batch_skip") for r, rid in enumerate(t["ids"])
    ]
    metrics.update(
        {
            "training/n_sample_dropped/same_reward": 0,
            "training/n_sample_dropped/random": 0,
            "training/n_sample_dropped/small_batch": len(alive),
            "training/n_dropped_groups/zero_adv": 0,
            "training/n_sample_target": 0,
            "training/n_sample_trained": 0,
            "training/n_mini_batches": 0,
            "training/skipped_steps": 1,
        }
    )
    return records, metrics


# =============================================================================================
# Mini-batch alignment: zero-advantage groups first, then whole rollouts, seeded
# =============================================================================================


def _plan_drops(
    rows: np.ndarray, zero_adv: np.ndarray, group: list[Any], need: int, rng: np.random.Generator, policy: str
) -> list[tuple[int, str]]:
    """Choose whole rollouts to drop so that about `need` rows go; returns (rollout, reason).

    rows [n_rollouts] rows per rollout; zero_adv [n_rollouts] bool; group [n_rollouts] key.
    Phase A drops whole zero-advantage groups that fit in `need` (random order); phase B whole
    rollouts that fit — zero-advantage ones first — in random order. Rollouts may have several
    rows, so the fitting drops can stop short of `need`; phase C then drops the smallest
    remaining rollout: the batch ends *below* the target and the update's last mini-batch is
    partial. That keeps the cap on updates and never cuts a rollout. Only when one rollout is
    left (dropping it would empty the batch) do we keep it: `need` extra rows are trained.
    """
    dropped = np.zeros(len(rows), dtype=bool)
    plan: list[tuple[int, str]] = []
    if policy != "zero_adv_first":
        zero_adv = np.zeros(len(rows), dtype=bool)  # "random": zero advantage earns no priority

    def drop(r: int, reason: str) -> None:
        nonlocal need
        dropped[r] = True
        need -= int(rows[r])
        plan.append((r, reason))

    if policy == "zero_adv_first":
        groups = list(dict.fromkeys(group[r] for r in np.flatnonzero(zero_adv)))
        for g in rng.permutation(len(groups)):
            members = [r for r in range(len(rows)) if group[r] == groups[g]]
            if rows[members].sum() <= need:
                for r in members:
                    drop(r, "zero_adv_group")
        tiers = [np.flatnonzero(zero_adv & ~dropped), np.flatnonzero(~zero_adv & ~dropped)]
    else:
        tiers = [np.flatnonzero(~dropped)]
    for tier in tiers:
        for r in rng.permutation(tier):
            if rows[r] <= need:
                drop(int(r), "zero_adv_rollout" if zero_adv[r] else "random")
    left = np.flatnonzero(~dropped)
    if need > 0 and len(left) > 1:
        # smallest rollout, zero-advantage first, random among ties
        key = np.lexsort((rng.random(len(left)), rows[left], ~zero_adv[left]))
        r = int(left[key[0]])
        drop(r, "zero_adv_rollout" if zero_adv[r] else "random")
    return plan


def _alive_rollouts(data: Any, alive: np.ndarray, with_groups: bool = True) -> dict[str, Any]:
    """Per rollout among the `alive` rows: ids, rows, first row, group key, zero-advantage flag."""
    ids, pos = rollout_index(np.asarray(rollout_ids(data))[alive])
    first_row = [int(alive[np.flatnonzero(pos == r)[0]]) for r in range(len(ids))]
    out = {"ids": ids, "pos": pos, "rows": np.bincount(pos, minlength=len(ids)), "first_row": first_row}
    if with_groups:
        keys = group_keys(data)
        group = [None if keys is None else keys[i] for i in first_row]
        zero_groups = set(zero_advantage_groups(data.select_idxs(alive))) if len(alive) else set()
        out.update(group=group, zero_adv=np.array([g in zero_groups for g in group], dtype=bool))
    return out


def _selection_metrics(
    plan: list[tuple[int, str]], t: dict[str, Any], n: int, target: int, kept: int, mini_batch_rows: int
) -> dict[str, Any]:
    rows = t["rows"]
    return {
        "training/n_sample_dropped/same_reward": sum(int(rows[r]) for r, why in plan if why.startswith("zero_adv")),
        "training/n_sample_dropped/random": sum(int(rows[r]) for r, why in plan if why == "random"),
        "training/n_sample_dropped/small_batch": n if target == 0 else 0,
        "training/n_dropped_groups/zero_adv": len({t["group"][r] for r, why in plan if why == "zero_adv_group"}),
        "training/n_sample_target": target,
        "training/n_sample_trained": kept,
        "training/n_mini_batches": math.ceil(kept / mini_batch_rows),
        "training/skipped_steps": int(target == 0),
    }


def select_for_update(
    data: Any,
    *,
    mini_batch_rows: int,
    max_ppo_update_times: int | None = None,
    seed: int = 0,
    policy: str = "zero_adv_first",
    small_batch: str = "train",
) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, Any]]:
    """Rows to train on: marked rows out, then whole rollouts out until whole mini-batches remain.

    Target rows = ⌊n / mini_batch_rows⌋ × mini_batch_rows, capped at mini_batch_rows ×
    `max_ppo_update_times`. Drops are whole zero-advantage groups first, then whole rollouts
    (zero-advantage ones first) drawn with `np.random.default_rng(seed)` — same seed, same
    drops (see `_plan_drops` for how a multi-row rollout can end the batch below target).
    A batch smaller than one mini-batch is trained as one smaller mini-batch
    (`small_batch="train"`) or the step is skipped (`"skip"`: metric training/skipped_steps=1).

    Compute advantages *before* calling this (after `drop_marked_rows`): dropping a rollout
    must not change the advantages of the rollouts kept.

    Returns `(kept_index [K] int64 ascending, records, metrics)`; records are dicts
    `{rollout_id, data_id, rows, reason}` with reason in marked | zero_adv_group |
    zero_adv_rollout | random | small_batch_skip.
    """
    check_selection_args(mini_batch_rows, max_ppo_update_times, policy, small_batch)
    alive, records, metrics = drop_marked_rows(data)
    n = len(alive)
    target = target_rows(n, mini_batch_rows, max_ppo_update_times, small_batch)
    t = _alive_rollouts(data, alive)
    if target == 0:
        plan = [(r, "small_batch_skip") for r in range(len(t["ids"]))]
        logger.warning("skipping this training step: %s", skip_reason(n, mini_batch_rows, small_batch))
    else:
        if n < mini_batch_rows:
            logger.info(
                "training %d rows as one mini-batch smaller than ppo_mini_batch_size × n = %d rows", n, mini_batch_rows
            )
        plan = _plan_drops(t["rows"], t["zero_adv"], t["group"], n - target, np.random.default_rng(seed), policy)

    gone = np.zeros(len(t["ids"]), dtype=bool)
    for r, reason in plan:
        gone[r] = True
        records.append(_drop_record(data, t["ids"][r], t["first_row"][r], t["rows"][r], reason))
    kept = alive[~gone[t["pos"]]]
    metrics.update(_selection_metrics(plan, t, n, target, len(kept), mini_batch_rows))
    return kept, records, metrics


# =============================================================================================
# AGL v1's drop order (parity switch agl_lab.parity.drop_order=agl)
# =============================================================================================


def agl_alignment(
    data: Any, *, mini_batch_rows: int, max_ppo_update_times: int | None = None, seed: int = 0
) -> tuple[np.ndarray, list[dict[str, Any]], dict[str, Any]]:
    """AGL v1's mini-batch alignment, for side-by-side runs: *before* advantages, row by row.

    Keep ⌊n / mini_batch_rows⌋ × mini_batch_rows rows (capped at × max_ppo_update_times);
    drop first rows of "same reward" groups (every row reward of the uid group allclose to the
    first: AGL's `_same_reward_uid_indices`), shuffled, then other rows uniformly at random. A
    rollout can lose part of its rows, and a batch under one mini-batch trains nothing (AGL
    skips the step). AGL's RNG is unseeded; here it is `default_rng(seed)`.

    Returns `(kept_index [K] ascending, records, metrics)`; a record per rollout that lost rows.
    """
    check_selection_args(mini_batch_rows, max_ppo_update_times)
    alive, records, metrics = drop_marked_rows(data)
    n = len(alive)
    target = target_rows(n, mini_batch_rows, max_ppo_update_times, "skip")
    rng = np.random.default_rng(seed)
    sub = data.select_idxs(alive) if n else data
    same = set(zero_advantage_groups(sub, rule="agl")) if n else set()  # no advantages yet: AGL's reward rule
    keys = group_keys(sub)
    in_same = np.array([keys is not None and keys[i] in same for i in range(n)], dtype=bool)
    need = n - target
    first = rng.permutation(np.flatnonzero(in_same))[:need]
    rest = rng.permutation(np.setdiff1d(np.arange(n), first))[: need - len(first)]
    gone = np.zeros(n, dtype=bool)
    gone[first], gone[rest] = True, True
    ids = np.asarray(rollout_ids(data))[alive]
    for reason, rows in (("same_reward", first), ("random", rest)):
        for rid in dict.fromkeys(ids[rows]):
            r_rows = rows[ids[rows] == rid]
            records.append(_drop_record(data, rid, int(alive[r_rows[0]]), len(r_rows), reason))
    kept = alive[~gone]
    metrics.update(
        {
            "training/n_sample_dropped/same_reward": len(first),
            "training/n_sample_dropped/random": len(rest),
            "training/n_sample_dropped/small_batch": n if target == 0 else 0,
            "training/n_dropped_groups/zero_adv": 0,
            "training/n_sample_target": target,
            "training/n_sample_trained": len(kept),
            "training/n_mini_batches": len(kept) // mini_batch_rows,
            "training/skipped_steps": int(target == 0),
        }
    )
    return kept, records, metrics
