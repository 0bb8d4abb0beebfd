"""Record every training step; replay any step on a laptop, with no engine, server or agent.

Recording (on by default, `agl_lab.record.*`): after each `Trainer.step()` the step's completed
rollouts and what the step made of them are written to `RUN_DIR/recording/step_NNNNNN.json.gz`
(N = the step as logged in metrics.jsonl). The format is gzip-compressed JSON, one document per
step — readable with `zcat | python -m json.tool`, no schema library, floats exact (Python's
float repr round-trips, so token logprobs and rewards come back to the bit), and token-id lists
compress ~5-10× under gzip:

    {"format": "agl_lab.recording", "version": 1,
     "step": N, "batch_step": N - 1,                   # the logged step; the step the batch was built at
     "policy_version": int,                            # weights that served the step's calls
     "seed": int, "rng": {python, numpy, torch},       # RNG states at the start of the step
     "pad_token_id": int,                              # what build_batch padded with
     "rollouts": [CompletedRollout as a dict, ...],    # token ids, logprobs, rewards, events, times
     "metrics": {...},                                 # the step's logged metrics
     "weights": [...], "dropped": [...]}               # UpdateResult.weights / .dropped as records

Each validation (`Trainer.validate`, so also `val_before_train` and `test_freq`) writes its
rollouts to `RUN_DIR/recording/validation_NNNNNN.json.gz` (N = the step it validated; same
rollout dicts, no batch): the same validation tasks before and after training, transcript by
transcript (`load_validation`, `agl_lab.transcript.format_transcript`).

`recording/bytes` (the file's size) is a step metric. `agl_lab.record.events: false` leaves the
raw events out (the triplets stay); `agl_lab.record.max_steps: K` keeps the newest K files.

Replay: `replay_step(run_dir, step)` (also `Trainer.replay` and `agl-lab replay RUN_DIR --step N`)
rebuilds the step's batch, advantages, selection and loss weights from the recording with the
run's own `config.yaml`, and compares every recomputed metric with the recorded one: the
engine-independent part (batch building and the algorithms) must agree exactly. What the
engine computed (old logprobs, the actor update, KL-in-reward when it is on) is not recomputed.
`what_if(run_dir, step, overrides)` replays the same step under other settings (aggregation
level, loss divisor, drop order, advantage estimator, clip ratios, ...) and returns the
differences as DataFrames and a plot.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from agl_lab.engines.base import Engine
from agl_lab.records import CompletedRollout, completed_rollout_from_dict, completed_rollout_to_dict, sort_rollouts
from agl_lab.results import BatchResult, UpdateResult

FORMAT, VERSION = "agl_lab.recording", 1
DIRNAME = "recording"
# not compared: wall-clock figures, the recording's own size, and the version the engine's sync made
_EXACT_SKIP = ("timing", "perf/", "recording/", "training/policy_version")


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"step_{step:06d}.json.gz"


def validation_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"validation_{step:06d}.json.gz"


def validated_steps(run_dir: str | Path) -> list[int]:
    """The steps whose validation rollouts are recorded under `run_dir`, in order."""
    return sorted(int(p.name[11:17]) for p in (Path(run_dir) / DIRNAME).glob("validation_*.json.gz"))


def load_validation(run_dir: str | Path, step: int) -> list[CompletedRollout]:
    """The validation rollouts recorded at step `step` (0: before training), in task order."""
    path = validation_path(run_dir, step)
    if not path.exists():
        raise FileNotFoundError(f"no validation recorded at step {step} in {path.parent} "
                                f"(recorded: {validated_steps(run_dir) or 'none'})")
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return [completed_rollout_from_dict(d) for d in doc["rollouts"]]


def recorded_steps(run_dir: str | Path) -> list[int]:
    """The steps recorded under `run_dir`, in order."""
    return sorted(int(p.name[5:11]) for p in (Path(run_dir) / DIRNAME).glob("step_*.json.gz"))


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Writes one recording per step into `run_dir/recording/` (see the module docstring)."""

    def __init__(self, run_dir: str | Path, options: Mapping[str, Any]):
        """`options`: `agl_lab.record` (its types and range are checked when the config loads)."""
        self.enabled = bool(options.get("enabled", True))
        self.events = bool(options.get("events", True))
        max_steps = options.get("max_steps")
        self.max_steps = None if max_steps is None else int(max_steps)
        self.dir = Path(run_dir) / DIRNAME

    def record(self, step: int, *, batch_step: int, rollouts: Sequence[CompletedRollout], metrics: Mapping[str, Any],
               update: UpdateResult, policy_version: int | None, seed: int, rng: Mapping[str, Any],
               pad_token_id: int) -> int:
        """Write step `step`'s recording; returns its size in bytes (0 when recording is off)."""
        if not self.enabled:
            return 0
        doc = {"format": FORMAT, "version": VERSION, "step": step, "batch_step": batch_step,
               "policy_version": policy_version, "seed": seed, "rng": _rng_to_json(rng),
               "pad_token_id": pad_token_id, "rollouts": self._rollout_docs(rollouts),
               "metrics": _jsonable(dict(metrics)),
               "weights": _frame_records(update.weights), "dropped": _frame_records(update.dropped)}
        size = self._write(step_path(self.dir.parent, step), doc)
        if self.max_steps is not None:
            self._remove(recorded_steps(self.dir.parent)[:-self.max_steps])
        return size

    def record_validation(self, step: int, rollouts: Sequence[CompletedRollout], metrics: Mapping[str, Any]) -> int:
        """Write the validation rollouts of step `step`, in task order; returns the file's size (0 when off)."""
        if not self.enabled:
            return 0
        doc = {"format": FORMAT, "version": VERSION, "step": step, "kind": "validation",
               "rollouts": self._rollout_docs(sort_rollouts(rollouts)), "metrics": _jsonable(dict(metrics))}
        return self._write(validation_path(self.dir.parent, step), doc)

    def _rollout_docs(self, rollouts: Sequence[CompletedRollout]) -> list[dict[str, Any]]:
        docs = [completed_rollout_to_dict(r) for r in rollouts]
        if not self.events:
            for d in docs:
                d["events"] = []
        return docs

    def _write(self, path: Path, doc: Mapping[str, Any]) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{path.name}.tmp"
        with gzip.open(tmp, "wt", compresslevel=6) as f:
            json.dump(doc, f, separators=(",", ":"), allow_nan=True)
        tmp.replace(path)  # a killed write never leaves a half recording under the real name
        return path.stat().st_size

    def drop_after(self, step: int) -> int:
        """Remove the recordings of steps after `step` (a resume redoes them); returns how many."""
        for s in validated_steps(self.dir.parent):
            if s > step:
                validation_path(self.dir.parent, s).unlink(missing_ok=True)
        return self._remove([s for s in recorded_steps(self.dir.parent) if s > step])

    def _remove(self, steps: Sequence[int]) -> int:
        for s in steps:
            step_path(self.dir.parent, s).unlink(missing_ok=True)
        return len(steps)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor
        return value.item()
    return value


def _frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return _jsonable(frame.to_dict(orient="records")) if frame is not None and not frame.empty else []


def _rng_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """`checkpoints.rng_state()` as JSON: python's tuple, numpy's MT19937 state, torch's bytes."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": base64.b64encode(state["torch"].numpy().tobytes()).decode()}


def rng_from_json(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `_rng_to_json`: a state `checkpoints.set_rng_state` accepts."""
    import torch

    version, internal, gauss = doc["python"]
    name, keys, pos, has_gauss, cached = doc["numpy"]
    raw = np.frombuffer(base64.b64decode(doc["torch"]), dtype=np.uint8).copy()
    return {"python": (version, tuple(internal), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            "torch": torch.from_numpy(raw)}


# ---------------------------------------------------------------------------------------------
# Reading a recording
# ---------------------------------------------------------------------------------------------


@dataclass
class Recording:
    """One recorded step, as written by `Recorder.record`."""

    step: int
    batch_step: int
    policy_version: int | None
    seed: int
    rng: dict[str, Any]
    pad_token_id: int
    rollouts: list[CompletedRollout]
    metrics: dict[str, Any]
    weights: pd.DataFrame
    dropped: pd.DataFrame
    path: Path


def load_recording(run_dir: str | Path, step: int) -> Recording:
    """The recording of `step` under `run_dir`; FileNotFoundError naming the recorded steps."""
    path = step_path(run_dir, step)
    if not path.exists():
        steps = recorded_steps(run_dir)
        raise FileNotFoundError(
            f"no recording of step {step} in {Path(run_dir) / DIRNAME}: recorded steps are "
            f"{_span(steps) if steps else 'none'} (recording is agl_lab.record.enabled, on by default)")
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{path} is not an agl_lab recording of version {VERSION} "
                         f"(format {doc.get('format')!r}, version {doc.get('version')!r})")
    return Recording(step=doc["step"], batch_step=doc["batch_step"], policy_version=doc["policy_version"],
                     seed=doc["seed"], rng=doc["rng"], pad_token_id=doc["pad_token_id"],
                     rollouts=[completed_rollout_from_dict(r) for r in doc["rollouts"]], metrics=doc["metrics"],
                     weights=pd.DataFrame(doc["weights"]), dropped=pd.DataFrame(doc["dropped"]), path=path)


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 3 else ", ".join(map(str, steps))


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

    endpoints = abort = compute_log_probs = save = load = _none  # type: ignore[assignment]


@dataclass
class Replay:
    """A recorded step rebuilt: the batch and update results, and the recorded-vs-replayed table.

    `comparison`: one row per metric both have (engine-independent ones only: batch building and
    the algorithms; wall-clock figures are left out) with `recorded`, `replayed` and `equal`.
    `equal` is exact equality (NaN equals NaN). `weights_equal` / `dropped_equal` compare the
    loss-weight and dropped tables the same way.
    """

    recording: Recording
    batch: BatchResult
    update: UpdateResult
    comparison: pd.DataFrame
    weights_equal: bool
    dropped_equal: bool

    @property
    def equal(self) -> bool:
        """Every compared metric and both tables equal to the bit."""
        return bool(self.comparison["equal"].all()) and self.weights_equal and self.dropped_equal

    @property
    def differences(self) -> pd.DataFrame:
        return self.comparison[~self.comparison["equal"]]


def replay_step(run_dir: str | Path, step: int, overrides: Sequence[str] = (), *, tokenizer: Any = None) -> Replay:
    """Rebuild step `step` of the run in `run_dir` from its recording (no engine, server or agent).

    `overrides` (`key=value`) change the run's config first: with none, the replay must
    reproduce the recorded engine-independent metrics exactly; with some, it answers "what if".
    `tokenizer` (default: the run's, loaded from its model directory — no model weights) decodes
    the tokens around a merge break, which its classification needs (retokenization vs other).
    """
    from agl_lab.batch import build_batch
    from agl_lab.config import load_saved_config, trace_limits
    from agl_lab.update import run_update

    rec = load_recording(run_dir, step)
    cfg = load_saved_config(Path(run_dir) / "config.yaml", overrides)
    if tokenizer is None:
        from agl_lab.engines.tiny import load_tokenizer
        from agl_lab.models import resolve_model_path

        tokenizer = load_tokenizer(model_path=resolve_model_path(cfg.agl_lab.model))
    agl = cfg.agentlightning
    level = str(agl.trace_aggregator.level)
    max_prompt, max_response = trace_limits(cfg, level)
    built = build_batch(rec.rollouts, level=level, max_prompt_length=max_prompt, max_response_length=max_response,
                        pad_token_id=rec.pad_token_id, reward_fillna_value=float(agl.reward_fillna_value),
                        tokenizer=tokenizer, multi_segment=bool(agl.trace_aggregator.multi_segment),
                        exclude_failed=bool(cfg.agl_lab.algorithm.exclude_failed_rollouts))
    batch = BatchResult(built, step=rec.batch_step, tokenizer=tokenizer)
    with _quiet_update_log():  # the run already warned about this step (alignment, skips)
        update = run_update(cfg, _NoEngine(rec.policy_version), batch, step=rec.batch_step)
    replayed = {**batch.metrics, **update.metrics}
    return Replay(recording=rec, batch=batch, update=update, comparison=_compare(rec.metrics, replayed),
                  weights_equal=_frames_equal(rec.weights, update.weights),
                  dropped_equal=_frames_equal(rec.dropped, update.dropped))


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
    rows = [{"metric": k, "recorded": recorded[k], "replayed": _jsonable(replayed[k]),
             "equal": _same(recorded[k], _jsonable(replayed[k]))} for k in keys]
    return pd.DataFrame(rows, columns=["metric", "recorded", "replayed", "equal"])


def _frames_equal(recorded: pd.DataFrame, replayed: pd.DataFrame) -> bool:
    if recorded.empty or replayed.empty:
        return recorded.empty and replayed.empty
    again = pd.DataFrame(_frame_records(replayed))  # through JSON, as the recording went
    if list(again.columns) != list(recorded.columns) or len(again) != len(recorded):
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

    base = replay_step(run_dir, step)
    rec, cfg = base.recording, load_saved_config(Path(run_dir) / "config.yaml")
    root = Path(checkpoint_root) if checkpoint_root is not None else checkpoints.checkpoint_root(cfg)
    before_dir, after_dir = root / f"global_step_{step - 1}", root / f"global_step_{step}"
    if step > 1 and not before_dir.exists():
        raise FileNotFoundError(f"replaying step {step}'s update needs the checkpoint of step {step - 1} at "
                                f"{before_dir} (trainer.save_freq=1 keeps one per step)")
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
    losses = pd.DataFrame([{"metric": k, "recorded": rec.metrics[k], "replayed": float(update.metrics[k]),
                            "abs_diff": abs(float(update.metrics[k]) - float(rec.metrics[k]))} for k in keys],
                          columns=["metric", "recorded", "replayed", "abs_diff"])
    norm = (lambda t: float(torch.linalg.vector_norm(t))) if change is not None else None
    param_change = {"replayed_norm": norm(change) if norm else None,
                    "recorded_norm": norm(recorded_change) if recorded_change is not None else None,
                    "relative_gap": (norm(change - recorded_change) / max(norm(recorded_change), 1e-30))
                    if recorded_change is not None else None}
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
    rollout was dropped), `reward` and `advantage` under each. `dropped`: the rollouts dropped
    under one setting and not the other, with the reason.
    """

    overrides: list[str]
    base: Replay
    alt: Replay
    metrics: pd.DataFrame
    weights: pd.DataFrame
    dropped: pd.DataFrame

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
    base = replay_step(run_dir, step)
    alt = replay_step(run_dir, step, overrides, tokenizer=base.batch.tokenizer)
    a = {**base.batch.metrics, **base.update.metrics}
    b = {**alt.batch.metrics, **alt.update.metrics}
    moved = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(_EXACT_SKIP):
            continue
        va, vb = _jsonable(a.get(key)), _jsonable(b.get(key))
        if not _same(va, vb):
            num = isinstance(va, (int, float)) and isinstance(vb, (int, float))
            moved.append({"metric": key, "base": va, "alt": vb, "delta": (vb - va) if num else None})
    return WhatIf(overrides=list(overrides), base=base, alt=alt,
                  metrics=pd.DataFrame(moved, columns=["metric", "base", "alt", "delta"]),
                  weights=_weights_side_by_side(base.update.weights, alt.update.weights),
                  dropped=_dropped_difference(base.update.dropped, alt.update.dropped))


def _shares(weights: pd.DataFrame) -> pd.DataFrame:
    if weights.empty:
        return pd.DataFrame(columns=["rollout_id", "share", "reward", "advantage"])
    total = float(weights["loss_weight"].sum()) or 1.0
    return pd.DataFrame({"rollout_id": weights["rollout_id"], "share": weights["loss_weight"] / total,
                         "reward": weights["reward"], "advantage": weights["advantage"]})


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
            verdict = "every engine-independent metric and table equal" if result.equal else \
                f"{len(result.differences)} metrics differ" + ("" if result.weights_equal else "; weights differ")
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
