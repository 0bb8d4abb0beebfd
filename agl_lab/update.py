"""Stage 3 of a step, engine-agnostic: from a built batch to new serving weights, in one line.

    skip decision (row counts only)          selection.skip_reason
    → engine.pause(timeout)                  no generation crosses the update (phases.update_phase)
    → engine.prepare(batch)                  old logprobs (verl: + ref, values, KL, IS weights)
    → advantage → selection → normalisation  agl_lab.algorithms.prepare_update_batch
    → engine.update(batch)                   PPO epochs
    → engine.sync_weights()                  policy_version += 1
    → engine.resume()                        always: after a skip or an error too (phases.update_phase)

Whether a step trains depends on row counts alone, so it is decided first, once, before the
engine stops serving (verl would sleep its replicas, recompute logprobs and push the same
weights back for nothing). A skipped step makes no training call (only the closing `resume`)
and is reported once: the metric `training/skipped_steps` = 1 and one warning on this module's
logger. Selection runs once, inside `prepare_update_batch`. The engine is paused and resumed by
`agl_lab.phases.update_phase`, so neither a skip nor an error inside the update leaves it paused.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pandas as pd

from agl_lab import heap
from agl_lab.algorithms import (
    marked_rows,
    prepare_update_batch,
    rollout_weights_table,
    skip_reason,
    skipped_step,
)
from agl_lab.algorithms.loss import row_weights_table
from agl_lab.config import update_options
from agl_lab.engines.base import Engine, check_batch, logprob_gap
from agl_lab.phases import update_phase
from agl_lab.results import BatchResult, UpdateResult
from agl_lab.rules import small_batch_under, uses_bypass
from agl_lab.staleness import staleness_metrics

logger = logging.getLogger(__name__)

_DROP_COLUMNS = ["rollout_id", "data_id", "rows", "reason"]


def run_update(cfg, engine: Engine, batch: BatchResult, *, step: int) -> UpdateResult:
    """skip? → pause → prepare → advantage/selection/normalisation → update → sync_weights."""
    opts = update_options(cfg)
    check_batch(batch.data)  # the keys, dtypes and shapes of BATCH_SCHEMA; consumers rely on them
    data = batch.data.select_idxs(list(range(len(batch.data))))  # never mutate the caller's batch
    data.meta_info["temperature"] = float(cfg.actor_rollout_ref.rollout.temperature)
    small_batch = small_batch_under(opts["drop_order"], opts["small_batch"])  # drop_order=agl: AGL v1 skips
    by_parity = small_batch != opts["small_batch"]
    skipped_by = "agl_lab.parity.drop_order='agl' (AGL v1 skips such a step)" if by_parity else None
    n_trainable = int((~marked_rows(data)).sum())
    reason = skip_reason(n_trainable, opts["mini_batch_rows"], small_batch, skipped_by=skipped_by)
    metrics: dict[str, Any] = {}
    # the engine serves again after this block: with the new weights, or the old ones after a skip or an error
    with update_phase(engine, timeout=float(cfg.agl_lab.rollout.drain_timeout_seconds), pause=reason is None):
        if reason is not None:
            return _skipped(step, data, reason, engine)
        with _timed(metrics, "old_log_prob"):  # verl: old/ref logprobs, values, KL-in-reward, IS weights
            data, prep_metrics = engine.prepare(data)
        metrics.update(prep_metrics)
        bypass = engine.bypass_mode or uses_bypass(cfg.algorithm.get("rollout_correction"))
        if not bypass:  # under bypass the old logprobs *are* the sampling ones: the gap is 0 by construction
            metrics.update(logprob_gap(data))  # how far the update starts from on-policy (both engines)
        with _timed(metrics, "adv"):
            prepared, records, adv_metrics = prepare_update_batch(data, seed=int(cfg.agl_lab.seed) + step, **opts)
        metrics.update(adv_metrics)
        metrics.update(
            alignment_report(adv_metrics, opts["mini_batch_rows"], int(cfg.actor_rollout_ref.rollout.n), step + 1)
        )
        # Critical: skip_reason decided on the same row counts, so selection keeps ≥ 1 row here.
        assert prepared is not None, "skip_reason and select_for_update disagree on this batch"
        # the trained tokens' ages; their Δlogp by age and turn unless bypass makes it 0 by construction
        metrics.update(staleness_metrics(prepared, engine.policy_version, bypass=bypass))
        with _timed(metrics, "update_actor"):
            metrics.update(engine.update(prepared))
        with _timed(metrics, "update_weights"):
            engine.sync_weights()
        with _timed(metrics, "trim_heap"):  # the update's freed gigabytes back to the OS: flat RSS (heap.py)
            metrics.update(heap.trim())
    metrics["training/policy_version"] = engine.policy_version
    if "attention_mask" in prepared.batch.keys():  # verl: tokens of the trained batch
        metrics["perf/total_num_tokens"] = int(prepared.batch["attention_mask"].sum())

    weights = rollout_weights_table(
        prepared, loss_mode=opts["loss_mode"], divisor=opts["divisor"], num_trained_rows=len(prepared)
    )
    rows = row_weights_table(
        prepared, loss_mode=opts["loss_mode"], divisor=opts["divisor"], num_trained_rows=len(prepared)
    )
    weights = with_row_advantages(weights, rows)
    return UpdateResult(
        step=step,
        metrics=metrics,
        weights=weights,
        dropped=pd.DataFrame(records, columns=_DROP_COLUMNS),
        policy_version=engine.policy_version,
        batch=batch,
        trained=prepared,
        engine=engine,
        temperature=data.meta_info["temperature"],
    )


def with_row_advantages(weights: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """`weights` (one line per rollout) with its rows' advantages spelled out, from `rows`
    (`row_weights_table`, one line per row): `advantage_min`, `advantage_max` and
    `rows_advantages_differ`. Where a rollout's rows differ (`turn_credit: return`), its
    `advantage` is NaN, not its first row's, and `signed_weight` is the sum over its rows."""
    if weights.empty:
        return weights
    by_rollout = rows.groupby("rollout_id", sort=False)
    low = weights["rollout_id"].map(by_rollout["advantage"].min())  # NaN rows (no loss token) left out
    high = weights["rollout_id"].map(by_rollout["advantage"].max())
    differ = (low != high) & low.notna()
    out = weights.copy()
    out.insert(out.columns.get_loc("advantage") + 1, "advantage_min", low.astype(float))
    out.insert(out.columns.get_loc("advantage_min") + 1, "advantage_max", high.astype(float))
    out.insert(out.columns.get_loc("advantage_max") + 1, "rows_advantages_differ", differ.astype(bool))
    # Critical: only where rows differ — elsewhere A × Σw stays bit-equal to what recordings hold
    out.loc[differ, "advantage"] = float("nan")
    summed = weights["rollout_id"].map(by_rollout["signed_weight"].sum())
    out.loc[differ, "signed_weight"] = summed[differ]
    return out


ALIGNMENT_WARN_FRACTION = 0.2  # warn when alignment drops more than this share of the rows that carry signal


def alignment_report(metrics: dict[str, Any], mini_batch_rows: int, n: int, step: int) -> dict[str, Any]:
    """`training/n_sample_dropped/alignment`: rows (not rollouts) dropped to fill whole mini-batches.

    Zero-advantage rows (`n_sample_dropped/same_reward`: whole groups with one reward) go first and
    carry no policy-gradient signal, so dropping them costs nothing; one warning, with the numbers
    and the fix, only when more than 20 % of the rows *with* signal (`n_sample_dropped/random`) went.
    `UpdateResult.dropped` lists the same drops per rollout, its `rows` column in these units.
    `step` is the one the warning names: the console's 1-based step."""
    zero_adv = int(metrics.get("training/n_sample_dropped/same_reward", 0))
    signal = int(metrics.get("training/n_sample_dropped/random", 0))
    dropped = zero_adv + signal
    trained = int(metrics.get("training/n_sample_trained", 0))
    with_signal = signal + trained
    if with_signal and signal / with_signal > ALIGNMENT_WARN_FRACTION:
        logger.warning(
            "step %d: mini-batch alignment dropped %d of %d rows that carry a learning signal (%.0f%%; plus %d "
            "zero-advantage rows, which carry none): a step trains whole mini-batches of ppo_mini_batch_size × "
            "rollout.n = %d × %d = %d rows. Pick actor.ppo_mini_batch_size so that the rows of a step fill whole "
            "mini-batches (trajectory level: one row per rollout, so a divisor of data.train_batch_size keeps "
            "them all; transition level: rows vary, and smaller mini-batches lose fewer). Every dropped "
            "rollout is in UpdateResult.dropped (one line per rollout, its rows in `rows`).",
            step,
            signal,
            with_signal,
            100 * signal / with_signal,
            zero_adv,
            mini_batch_rows // n,
            n,
            mini_batch_rows,
        )
    return {"training/n_sample_dropped/alignment": dropped}


@contextlib.contextmanager
def _timed(metrics: dict[str, Any], name: str) -> Iterator[None]:
    """`with _timed(metrics, name):` records the block's wall time as `timing_s/<name>`."""
    t0 = time.time()
    yield
    metrics[f"timing_s/{name}"] = time.time() - t0


def _skipped(step: int, data: Any, reason: str, engine: Engine) -> UpdateResult:
    """The one report of a skipped step: drop records, `training/skipped_steps` = 1, one warning."""
    records, metrics = skipped_step(data)
    # step + 1: the console's 1-based step (UpdateResult.step is the 0-based step the batch was built at)
    logger.warning("step %d is skipped: %s (every dropped rollout is in UpdateResult.dropped)", step + 1, reason)
    return UpdateResult(
        step=step,
        metrics=metrics,
        weights=pd.DataFrame(),
        dropped=pd.DataFrame(records, columns=_DROP_COLUMNS),
        skipped=True,
        policy_version=engine.policy_version,
    )
