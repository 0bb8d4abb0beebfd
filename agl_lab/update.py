"""Stage 3 of a step, engine-agnostic: from a built batch to new serving weights.

    marked rows dropped → rollout-level advantage on the whole batch → group metrics →
    zero-advantage-first mini-batch alignment → per-rollout normalisation   (algorithms)
    → old logprobs: recomputed by the engine at the sampling temperature, or bypass
    → engine.update (PPO epochs)  → engine.sync_weights (policy_version += 1)

The pure part lives in `agl_lab.algorithms.prepare_update_batch`; this module maps config
keys onto it and drives the engine.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch

from agl_lab.results import BatchResult, UpdateResult

_DROP_COLUMNS = ["rollout_id", "data_id", "rows", "reason"]


def update_options(cfg) -> dict[str, Any]:
    """`prepare_update_batch` keyword arguments from the composed config."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    n = int(cfg.actor_rollout_ref.rollout.n)
    max_updates = cfg.agentlightning.max_ppo_update_times
    return dict(
        mini_batch_rows=int(actor.ppo_mini_batch_size) * n,  # verl counts mini-batches in tasks
        adv_estimator=str(algo.adv_estimator),
        gamma=float(algo.gamma),
        lam=float(algo.lam),
        num_repeat=n,
        norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo),
        rollout_level_advantage=bool(algo.enable_rollout_level_advantage),
        algo_config=algo,
        max_ppo_update_times=None if max_updates is None else int(max_updates),
        small_batch=str(cfg.agl_lab.algorithm.small_batch),
        loss_mode=str(actor.policy_loss.loss_mode),
        divisor=str(cfg.agl_lab.algorithm.normalize_by),
    )


def run_update(cfg, engine, batch: BatchResult, *, step: int) -> UpdateResult:
    from agl_lab.algorithms import prepare_update_batch, rollout_weights_table, select_for_update

    opts = update_options(cfg)
    data = batch.data.select_idxs(list(range(len(batch.data))))  # never mutate the caller's batch
    temperature = float(cfg.actor_rollout_ref.rollout.temperature)
    data.meta_info["temperature"] = temperature
    # Row counts alone decide a skip: decide it before the engine stops serving (verl would
    # sleep the replicas, recompute logprobs and push the same weights back for nothing).
    _, records, early = select_for_update(
        data, mini_batch_rows=opts["mini_batch_rows"], max_ppo_update_times=opts["max_ppo_update_times"],
        small_batch=opts["small_batch"])
    if early["training/skipped_steps"]:
        return _skipped(step, early, records, engine)
    engine.pause()  # no generation crosses the update (verl: the replicas sleep); Trainer.update resumes
    metrics: dict[str, Any] = {}
    engine_prepares = hasattr(engine, "prepare")
    if engine_prepares:
        # verl: old/ref logprobs, critic values, KL-in-reward and rollout correction must exist
        # before the advantage is computed, so the engine prepares the whole batch first.
        t0 = time.time()
        data, prep_metrics = engine.prepare(data)
        metrics.update(prep_metrics)
        metrics["timing_s/old_log_prob"] = time.time() - t0
    t0 = time.time()
    prepared, records, adv_metrics = prepare_update_batch(data, seed=int(cfg.agl_lab.seed) + step, **opts)
    metrics.update(adv_metrics)
    metrics["timing_s/adv"] = time.time() - t0
    if prepared is None:
        return _skipped(step, metrics, records, engine)

    if not engine_prepares:  # local engine: old logprobs of the kept rows only
        t0 = time.time()
        _old_log_probs(cfg, engine, prepared, temperature)
        metrics["timing_s/old_log_prob"] = time.time() - t0

    t0 = time.time()
    metrics.update(engine.update(prepared))
    metrics["timing_s/update_actor"] = time.time() - t0
    t0 = time.time()
    engine.sync_weights()
    metrics["timing_s/update_weights"] = time.time() - t0
    metrics["training/policy_version"] = engine.policy_version

    advantages = rollout_weights_table(prepared, loss_mode=opts["loss_mode"], divisor=opts["divisor"],
                                       num_trained_rows=len(prepared))
    return UpdateResult(step=step, metrics=metrics, advantages=advantages,
                        dropped=pd.DataFrame(records, columns=_DROP_COLUMNS), policy_version=engine.policy_version)


def _old_log_probs(cfg, engine, data, temperature: float) -> None:
    """`old_log_probs` [N, R]: the engine's sampling logprobs (bypass mode) or recomputed."""
    if bool(cfg.algorithm.rollout_correction.get("bypass_mode", False)):
        from agl_lab.ppo import prepare_old_log_probs

        prepare_old_log_probs(None, data, temperature, bypass_mode=True)
        return
    with torch.no_grad():
        data.batch["old_log_probs"] = engine.compute_log_probs(data, temperature=temperature)


def _skipped(step: int, metrics: dict[str, Any], records: list[dict[str, Any]], engine) -> UpdateResult:
    print(f"step {step}: no trainable rows after drops; the step is skipped "
          f"(see UpdateResult.dropped)", flush=True)
    return UpdateResult(step=step, metrics=metrics, advantages=pd.DataFrame(),
                        dropped=pd.DataFrame(records, columns=_DROP_COLUMNS), skipped=True,
                        policy_version=engine.policy_version)
