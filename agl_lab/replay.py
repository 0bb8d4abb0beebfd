"""Replay any recorded step on a laptop, with no engine, server or agent.

The recordings are written by `agl_lab.recording` (its docstring gives the format).

Replay: `replay_step(run_dir, step)` (also `agl-lab replay RUN_DIR --step N`)
rebuilds the step's batch, advantages, selection and loss weights from the recording with the
run's own `config.yaml`, and compares every recomputed metric with the recorded one: the
engine-independent part (batch building and the algorithms) must agree exactly. It imports
neither verl nor Ray (the batch is agl_lab's `BatchData`, the GRPO/RLOO estimators and the data
metrics are computed as verl does, `algorithms.estimators`), so it answers in seconds. What the
engine computed (old logprobs, the actor update, KL-in-reward when it is on) is not recomputed.
`what_if(run_dir, step, overrides)` replays the same step under other settings (aggregation
level, loss divisor, drop order, advantage estimator, ... : the keys in `REPLAYABLE`) and
returns the differences as DataFrames and a plot. Any other key is refused with one line naming
it: the model, sampling, the optimiser and the engine's loss acted on rollouts and weights the
recording holds as they were, so a replay under them would answer "nothing moved" for a change
that may matter a great deal.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from agl_lab.engines.base import Engine
from agl_lab.recording import (  # noqa: F401 (re-export: notebooks read recordings through agl_lab.replay)
    DIRNAME,
    Recorder,
    Recording,
    frame_records,
    jsonable,
    load_recording,
    load_validation,
    recorded_steps,
    rng_from_json,
    validated_steps,
)
from agl_lab.results import BatchResult, UpdateResult

# not compared: wall-clock figures, the recording's own size, and the version the engine's sync made
_EXACT_SKIP = ("timing", "perf/", "recording/", "training/policy_version")

# The keys a replay re-runs: what `config.batch_options` and `config.update_options` read, less
# `actor_rollout_ref.rollout.n` (how many rollouts were sampled per task). Anything else changes
# sampling, the model, the optimiser or the engine's loss (temperature, model path, learning
# rate, clip ratios, KL, seed): the recording holds their outcome, not a way to recompute it.
REPLAYABLE = (
    "agentlightning.trace_aggregator.level",
    "agentlightning.trace_aggregator.multi_segment",
    "agentlightning.trace_aggregator.trajectory_max_prompt_length",
    "agentlightning.trace_aggregator.trajectory_max_response_length",
    "data.max_prompt_length",
    "data.max_response_length",
    "agentlightning.reward_fillna_value",
    "agentlightning.max_ppo_update_times",
    "agl_lab.algorithm.exclude_failed_rollouts",
    "agl_lab.algorithm.turn_credit",
    "agl_lab.algorithm.turn_gamma",
    "agl_lab.algorithm.small_batch",
    "agl_lab.algorithm.normalize_by",
    "agl_lab.parity.drop_order",
    "agl_lab.parity.bf16_rewards",
    "agl_lab.parity.grpo_float32",
    "algorithm.adv_estimator",
    "algorithm.gamma",
    "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.enable_rollout_level_advantage",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
)


def check_replayable(overrides: Sequence[str]) -> None:
    """ValueError naming the override keys a replay cannot re-run (not in `REPLAYABLE`), and why."""
    keys = [str(o).split("=", 1)[0].lstrip("+~").strip() for o in overrides]
    refused = [k for k in dict.fromkeys(keys) if k not in REPLAYABLE]
    if refused:
        raise ValueError(
            f"a replay cannot re-run {', '.join(refused)}: the recording holds the rollouts as sampled and "
            "no model, so a change to sampling, the model, the optimiser or the engine's loss would show "
            f"as 'nothing moved'; a replay re-runs {', '.join(REPLAYABLE)} (agl_lab.replay.REPLAYABLE)"
        )


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------


class _NoEngine(Engine):
    """The update stage without an engine: nothing is paused, prepared, trained or synced, so
    `run_update` computes exactly its engine-independent part (advantages, selection, weights)."""

    model_name = "replay"

    def __init__(self, policy_version: int | None):
        self._version = policy_version

    @property
    def policy_version(self) -> int | None:
        return self._version

    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        return data, {}  # no old logprobs: the advantage does not read them

    def update(self, data: Any) -> dict[str, float]:
        return {}

    def pause(self, timeout: float | None = None) -> None: ...
    def resume(self) -> None: ...
    def sync_weights(self) -> None: ...

    def _none(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a replay has no engine: this needs the run's model")

    def compute_log_probs_and_entropy(self, data: Any, temperature: float = 1.0) -> tuple[Any, Any]:
        raise NotImplementedError(
            "a replay has no engine, so no model to run (agl_lab.replay.replay_update recomputes the update on one)"
        )

    endpoints = abort = compute_log_probs = save = load = _none  # type: ignore[assignment]


@dataclass
class Replay:
    """A recorded step rebuilt: the batch and update results, and the recorded-vs-replayed table.

    `comparison`: one row per metric both have (engine-independent ones only: batch building and
    the algorithms; wall-clock figures are left out) with `recorded`, `replayed` and `equal`.
    `equal` is exact equality (NaN equals NaN). `weights_equal` / `dropped_equal` compare the
    loss-weight and dropped tables the same way, on the columns the recording has (one written
    before a column was added to `UpdateResult.weights` still replays as equal).
    `rows`: `batch.rows` (one line per row, skipped ones included) with each row's own numbers
    from the replayed update (`row_weights_table`): `trained`, `advantage` (NaN where not
    trained) and `loss_weight` (0 where not trained). `update.tokens(i)` gives a row's tokens
    without an engine (`new_logprob`, `ratio`, `entropy` NaN: they need the run's model).
    """

    recording: Recording
    batch: BatchResult
    update: UpdateResult
    comparison: pd.DataFrame
    weights_equal: bool
    dropped_equal: bool
    rows: pd.DataFrame

    @property
    def equal(self) -> bool:
        """Every compared metric and both tables equal to the bit."""
        return bool(self.comparison["equal"].all()) and self.weights_equal and self.dropped_equal

    @property
    def differences(self) -> pd.DataFrame:
        return self.comparison[~self.comparison["equal"]]


def replay_step(
    run_dir: str | Path, step: int, overrides: Sequence[str] = (), *, tokenizer: Any = None, container: str = "agl"
) -> Replay:
    """Rebuild step `step` of the run in `run_dir` from its recording (no engine, server or agent).

    `overrides` (`key=value`) change the run's config first: with none, the replay must
    reproduce the recorded engine-independent metrics exactly; with some, it answers "what if"
    (keys in `REPLAYABLE` only: ValueError naming any other).
    `tokenizer` (default: the run's, decode-only — `engines.tiny.load_decoder`, no model weights and
    no transformers import) decodes the tokens around a merge break, which its classification
    needs (retokenization vs other), and `batch.rows`' text columns.
    `container`: the batch's type (`agl_lab.batch.build_batch`): `"agl"` (default) imports neither
    verl nor Ray (for GRPO and RLOO: any other estimator is verl's); `"verl"` builds the `DataProto`
    an engine trains on.
    """
    from agl_lab.algorithms.loss import row_weights_table
    from agl_lab.batch import build_batch
    from agl_lab.config import batch_options, load_saved_config, update_options
    from agl_lab.update import run_update

    check_replayable(overrides)
    rec = load_recording(run_dir, step)
    cfg = load_saved_config(Path(run_dir) / "config.yaml", overrides)
    if tokenizer is None:
        from agl_lab.engines.tiny import load_decoder
        from agl_lab.models import resolve_model_path

        tokenizer = load_decoder(model_path=resolve_model_path(cfg.agl_lab.model))
    built = build_batch(
        rec.rollouts, **batch_options(cfg), pad_token_id=rec.pad_token_id, tokenizer=tokenizer, container=container
    )
    batch = BatchResult(built, step=rec.batch_step, tokenizer=tokenizer)
    with _quiet_update_log():  # the run already warned about this step (alignment, skips)
        update = run_update(cfg, _NoEngine(rec.policy_version), batch, step=rec.batch_step)
    replayed = {**batch.metrics, **update.metrics}
    numbers = None
    if update.trained is not None:  # a skipped step trained no row
        opts = update_options(cfg)
        numbers = row_weights_table(
            update.trained, loss_mode=opts["loss_mode"], divisor=opts["divisor"], num_trained_rows=len(update.trained)
        )
    return Replay(
        recording=rec,
        batch=batch,
        update=update,
        comparison=_compare(rec.metrics, replayed),
        weights_equal=_frames_equal(rec.weights, update.weights),
        dropped_equal=_frames_equal(rec.dropped, update.dropped),
        rows=_rows_with_numbers(batch.rows, numbers),
    )


def _rows_with_numbers(rows: pd.DataFrame, numbers: pd.DataFrame | None) -> pd.DataFrame:
    """`rows` (`BatchResult.rows`) + trained, advantage, loss_weight of each row, matched on
    (rollout_id, first_call): selection reorders and drops rows, so batch_index cannot match them."""
    keys = ["rollout_id", "first_call"]
    if numbers is None:
        return rows.assign(trained=False, advantage=np.nan, loss_weight=0.0)
    picked = numbers[[*keys, "advantage", "loss_weight"]].assign(trained=True)
    out = rows.merge(picked, on=keys, how="left", validate="one_to_one")
    out["trained"] = out["trained"].eq(True)
    out["advantage"] = out["advantage"].astype(float)
    out["loss_weight"] = out["loss_weight"].astype(float).fillna(0.0)
    return out


@contextlib.contextmanager
def _quiet_update_log() -> Iterator[None]:
    log = logging.getLogger("agl_lab.update")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    return a == b


def _compare(recorded: Mapping[str, Any], replayed: Mapping[str, Any]) -> pd.DataFrame:
    keys = sorted(k for k in set(recorded) & set(replayed) if not k.startswith(_EXACT_SKIP))
    rows = [
        {
            "metric": k,
            "recorded": recorded[k],
            "replayed": jsonable(replayed[k]),
            "equal": _same(recorded[k], jsonable(replayed[k])),
        }
        for k in keys
    ]
    return pd.DataFrame(rows, columns=["metric", "recorded", "replayed", "equal"])


def _frames_equal(recorded: pd.DataFrame, replayed: pd.DataFrame) -> bool:
    if recorded.empty or replayed.empty:
        return recorded.empty and replayed.empty
    again = pd.DataFrame(frame_records(replayed))  # through JSON, as the recording went
    if not set(recorded.columns) <= set(again.columns) or len(again) != len(recorded):
        return False
    return all(_same(a, b) for col in recorded.columns for a, b in zip(recorded[col], again[col]))


# ---------------------------------------------------------------------------------------------
# Replaying the update on the engine, from the checkpoint before the step
# ---------------------------------------------------------------------------------------------


@dataclass
class UpdateReplay:
    """A recorded step's update recomputed on the engine, from the checkpoint of the step before.

    `losses`: the engine's `actor/*` metrics as recorded and as recomputed, with `abs_diff`.
    `param_change`: ‖Δθ‖ of the recomputed update, and — when the checkpoint of the step itself
    exists — ‖Δθ_recorded‖ and the relative gap ‖Δθ − Δθ_recorded‖ / ‖Δθ_recorded‖ (None
    otherwise). Parameters are compared on the local engine, whose weights live in this process.
    """

    replay: Replay
    update: UpdateResult
    losses: pd.DataFrame
    param_change: dict[str, float | None]


def replay_update(run_dir: str | Path, step: int, *, checkpoint_root: str | Path | None = None) -> UpdateReplay:
    """Recompute step `step`'s update: the engine loads `global_step_{step-1}` (the run's initial
    weights for step 1), the recorded batch is rebuilt, the RNG states of the step are restored,
    and `run_update` trains once; the loss and the parameter change are compared with the run's."""
    import torch

    from agl_lab import checkpoints
    from agl_lab.config import load_saved_config
    from agl_lab.engines.build import build_engine
    from agl_lab.tasks import agent_and_task
    from agl_lab.update import run_update

    base = replay_step(run_dir, step, container="verl")  # the engine trains on verl's DataProto
    rec, cfg = base.recording, load_saved_config(Path(run_dir) / "config.yaml")
    root = Path(checkpoint_root) if checkpoint_root is not None else checkpoints.checkpoint_root(cfg)
    before_dir, after_dir = root / f"global_step_{step - 1}", root / f"global_step_{step}"
    if step > 1 and not before_dir.exists():
        raise FileNotFoundError(
            f"replaying step {step}'s update needs the checkpoint of step {step - 1} at "
            f"{before_dir} (trainer.save_freq=1 keeps one per step)"
        )
    _, task = agent_and_task(cfg, None, None, has_tasks=True)
    engine = build_engine(cfg, task=task)
    try:
        if step > 1:
            engine.load(str(before_dir / "engine"))
        model = getattr(engine, "model", None)
        start = _flat_params(model) if model is not None else None
        checkpoints.set_rng_state(rng_from_json(rec.rng))
        update = run_update(cfg, engine, base.batch, step=rec.batch_step)
        change = _flat_params(model) - start if model is not None else None
        recorded_change = None
        if change is not None and after_dir.exists():
            engine.load(str(after_dir / "engine"))
            recorded_change = _flat_params(model) - start
    finally:
        engine.close()
    keys = sorted(k for k in set(rec.metrics) & set(update.metrics) if k.startswith("actor/"))
    losses = pd.DataFrame(
        [
            {
                "metric": k,
                "recorded": rec.metrics[k],
                "replayed": float(update.metrics[k]),
                "abs_diff": abs(float(update.metrics[k]) - float(rec.metrics[k])),
            }
            for k in keys
        ],
        columns=["metric", "recorded", "replayed", "abs_diff"],
    )
    norm = (lambda t: float(torch.linalg.vector_norm(t))) if change is not None else None
    param_change = {
        "replayed_norm": norm(change) if norm else None,
        "recorded_norm": norm(recorded_change) if recorded_change is not None else None,
        "relative_gap": (norm(change - recorded_change) / max(norm(recorded_change), 1e-30))
        if recorded_change is not None
        else None,
    }
    return UpdateReplay(replay=base, update=update, losses=losses, param_change=param_change)


def _flat_params(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().flatten().float().clone() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------
# What if
# ---------------------------------------------------------------------------------------------


@dataclass
class WhatIf:
    """The same recorded step under the run's settings (`base`) and under `overrides` (`alt`).

    `metrics`: metric, base, alt, delta for every metric whose value moved. `weights`: one row
    per rollout with its loss share under each (share = loss_weight / Σ loss_weight; 0 where the
    rollout was dropped), `reward`, `advantage` and `rows_advantages_differ` under each (where
    its rows' advantages differ, `advantage` is NaN: see `rows`). `rows`: one line per row
    (rollout_id, first_call) of either batch with its `advantage`, `loss_weight` and `trained`
    under each (`_base`, `_alt`; NaN where the row is not in that batch, e.g. at another level).
    `dropped`: the rollouts dropped under one setting and not the other, with the reason.
    """

    overrides: list[str]
    base: Replay
    alt: Replay
    metrics: pd.DataFrame
    weights: pd.DataFrame
    dropped: pd.DataFrame
    rows: pd.DataFrame

    def plot(self, path: str | Path | None = None):
        """Loss share per rollout, base vs alt (sorted by base share); a PNG at `path` if given."""
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        w = self.weights.sort_values("share_base", ascending=False).reset_index(drop=True)
        fig, ax = plt.subplots(figsize=(8, 3.2))
        x = np.arange(len(w))
        ax.bar(x - 0.2, w["share_base"], width=0.4, label="as run")
        ax.bar(x + 0.2, w["share_alt"], width=0.4, label=" ".join(self.overrides) or "alt")
        ax.set_xlabel("rollout (sorted by its share as run)")
        ax.set_ylabel("share of the policy loss")
        ax.set_title(f"step {self.base.recording.step}: who carries the loss")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110)
            plt.close(fig)
            return Path(path)
        return ax


def what_if(run_dir: str | Path, step: int, overrides: Sequence[str]) -> WhatIf:
    """Replay `step` as run and under `overrides`; the differences as DataFrames (see `WhatIf`)."""
    check_replayable(overrides)  # before the base replay: a refused key costs no seconds
    base = replay_step(run_dir, step)
    alt = replay_step(run_dir, step, overrides, tokenizer=base.batch.tokenizer)
    a = {**base.batch.metrics, **base.update.metrics}
    b = {**alt.batch.metrics, **alt.update.metrics}
    moved = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(_EXACT_SKIP):
            continue
        va, vb = jsonable(a.get(key)), jsonable(b.get(key))
        if not _same(va, vb):
            num = isinstance(va, (int, float)) and isinstance(vb, (int, float))
            moved.append({"metric": key, "base": va, "alt": vb, "delta": (vb - va) if num else None})
    return WhatIf(
        overrides=list(overrides),
        base=base,
        alt=alt,
        metrics=pd.DataFrame(moved, columns=["metric", "base", "alt", "delta"]),
        weights=_weights_side_by_side(base.update.weights, alt.update.weights),
        dropped=_dropped_difference(base.update.dropped, alt.update.dropped),
        rows=_rows_side_by_side(base.rows, alt.rows),
    )


def _rows_side_by_side(base: pd.DataFrame, alt: pd.DataFrame) -> pd.DataFrame:
    keys, numbers = ["rollout_id", "first_call"], ["advantage", "loss_weight", "trained"]
    out = base[[*keys, *numbers]].merge(alt[[*keys, *numbers]], on=keys, how="outer", suffixes=("_base", "_alt"))
    return out.sort_values(keys).reset_index(drop=True)


def _shares(weights: pd.DataFrame) -> pd.DataFrame:
    if weights.empty:
        return pd.DataFrame(columns=["rollout_id", "share", "reward", "advantage", "rows_advantages_differ"])
    total = float(weights["loss_weight"].sum()) or 1.0
    return pd.DataFrame(
        {
            "rollout_id": weights["rollout_id"],
            "share": weights["loss_weight"] / total,
            "reward": weights["reward"],
            "advantage": weights["advantage"],
            "rows_advantages_differ": weights["rows_advantages_differ"],
        }
    )


def _weights_side_by_side(base: pd.DataFrame, alt: pd.DataFrame) -> pd.DataFrame:
    out = _shares(base).merge(_shares(alt), on="rollout_id", how="outer", suffixes=("_base", "_alt"))
    out[["share_base", "share_alt"]] = out[["share_base", "share_alt"]].fillna(0.0)
    out["share_delta"] = out["share_alt"] - out["share_base"]
    return out.sort_values("rollout_id").reset_index(drop=True)


def _dropped_difference(base: pd.DataFrame, alt: pd.DataFrame) -> pd.DataFrame:
    columns = ["rollout_id", "dropped_in", "reason"]
    rows = []
    ids_a = set(base["rollout_id"]) if not base.empty else set()
    ids_b = set(alt["rollout_id"]) if not alt.empty else set()
    for label, frame, others in (("base", base, ids_b), ("alt", alt, ids_a)):
        if frame.empty:
            continue
        for rid, reason in zip(frame["rollout_id"], frame["reason"]):
            if rid not in others:
                rows.append({"rollout_id": rid, "dropped_in": label, "reason": reason})
    return pd.DataFrame(rows, columns=columns).drop_duplicates().reset_index(drop=True)


def replay_main(argv: list[str]) -> int:
    """`agl-lab replay RUN_DIR [--step N] [key=value ...]`: replay a recorded step; with overrides,
    what would have changed."""
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab replay", description="Replay a recorded training step.")
    parser.add_argument("run_dir", help="a run directory with recording/ (agl-lab train writes it)")
    parser.add_argument("--step", type=int, default=None, help="the step as logged (default: the last recorded)")
    parser.add_argument("overrides", nargs="*", help="key=value settings for a what-if replay")
    args = parser.parse_intermixed_args(argv)
    steps = recorded_steps(args.run_dir)
    if not steps:
        print(f"agl-lab replay: {Path(args.run_dir) / DIRNAME} holds no recording")
        return 2
    step = steps[-1] if args.step is None else args.step
    try:
        if not args.overrides:
            result = replay_step(args.run_dir, step)
            with pd.option_context("display.max_rows", 200, "display.width", 160):
                print(result.comparison.to_string(index=False))
            verdict = (
                "every engine-independent metric and table equal"
                if result.equal
                else f"{len(result.differences)} metrics differ" + ("" if result.weights_equal else "; weights differ")
            )
            print(f"\nstep {step}: {len(result.comparison)} metrics compared: {verdict}")
            return 0 if result.equal else 1
        diff = what_if(args.run_dir, step, args.overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"agl-lab replay: {e}")
        return 2
    with pd.option_context("display.max_rows", 200, "display.width", 160):
        print(f"step {step}, what if {' '.join(args.overrides)}:\n")
        print(diff.metrics.to_string(index=False) if len(diff.metrics) else "no metric moved")
        if len(diff.dropped):
            print("\n" + diff.dropped.to_string(index=False))
    return 0
