"""Evaluate a model after the fact: pass@k, mean@k and maj@k per task, with a bootstrap interval.

    ev = evaluate("runs/calc/checkpoints/global_step_20", k=4)      # a checkpoint
    ev = evaluate("cpu_smollm2_learn", k=4, out="evals/base")        # a config's base model
    ev.tasks        # one row per task: its n rewards, c, pass@1, pass@4, mean@4, maj@4
    ev.summary      # means over tasks, each with its 95 % interval (agl_lab.eval_stats)
    curve = evaluate("runs/calc", k=4)   # a run: its base model and every checkpoint → curve.curve

    agl-lab eval MODEL_OR_RUN [--task NAME] [--k 4] [--n N] [--temperature T] [--seed S]
                 [--split val|train] [--config CONFIG] [--threshold R] [--out DIR] [key=value ...]

What is evaluated is what is trained: a Trainer is built from the model's own config (the
checkpoint's or run's `config.yaml`, or the config given) and its validation rollouts run through
the same gateway, runner and agents as training — each task repeated n times in a row, as
`Trainer.validate` does with `actor_rollout_ref.rollout.val_kwargs.n`, at the gateway's
`agl_lab.server.val_temperature`, with seeded calls (`agl_lab.server.seeding`). So with k = n = 1
and the run's seed, a checkpoint's evaluation is the run's own validation at that step.

MODEL is a checkpoint (`…/global_step_N`, holding trainer_state.pt), a run directory (its
`config.yaml` names `trainer.default_local_dir`; or a directory of `global_step_N`), a LoRA
adapter directory (PEFT's `adapter_config.json`; its base from `--config` or the checkpoint
holding it), a config (a YAML path or shipped preset: its base model), or a model preset
(`smollm2-135m`, with `--config`). The files `eval-<task>-<split>.json` (summary + per-task rows)
and `.csv` (per-task, one column per sample) go beside the checkpoint or adapter, or in `--out`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from agl_lab import eval_stats
from agl_lab.checkpoints import STATE_FILE

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Evaluation:
    """One model's evaluation: `tasks` (one row per task), `summary` (means and intervals) and
    the files written (`json`, `csv`; None when nothing was written)."""

    tasks: pd.DataFrame
    summary: dict[str, Any]
    json: Path | None = None
    csv: Path | None = None


@dataclass
class EvaluationCurve:
    """A run's evaluations, base (step 0) first: `curve` has one row per model (step, scores, intervals)."""

    evaluations: list[Evaluation]
    curve: pd.DataFrame
    csv: Path | None = None
    png: Path | None = None


@dataclass
class _Target:
    """One model to evaluate: its kind, the config to build it from and where its files go."""

    kind: str  # base | checkpoint | adapter
    label: str
    config: Path | None = None  # a YAML file (None: agl_lab's defaults)
    saved: bool = False  # config is a run's or checkpoint's saved config.yaml
    path: Path | None = None  # the checkpoint or adapter directory
    step: int | None = None
    out: Path | None = None
    overrides: list[str] = field(default_factory=list)


# ============================================================================ what MODEL names


def _step_of(path: Path) -> int | None:
    match = re.fullmatch(r"global_step_(\d+)", path.name)
    return int(match.group(1)) if match else None


def _checkpoints_under(root: Path) -> list[Path]:
    found = [p for p in root.glob("global_step_*") if (p / STATE_FILE).exists() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def _run_targets(run: Path) -> list[_Target]:
    """The base model (step 0) and every checkpoint of a run directory, or of a checkpoint root."""
    from agl_lab import config as config_mod
    from agl_lab.checkpoints import checkpoint_root

    found = _checkpoints_under(run)
    config = run / "config.yaml" if (run / "config.yaml").exists() else None
    if config is not None and not found:
        root = checkpoint_root(config_mod.load_saved_config(config))
        found = _checkpoints_under(root if root.is_absolute() else Path.cwd() / root)
    if not found:
        raise SystemExit(
            f"agl-lab eval: no checkpoints in {run} (global_step_N directories holding {STATE_FILE}); "
            "train with trainer.save_freq > 0, or name one checkpoint"
        )
    base_config = config or found[0] / "config.yaml"
    targets = [_Target("base", "base", base_config, True, None, 0, run / "eval_base")]
    targets += [_Target("checkpoint", p.name, p / "config.yaml", True, p, _step_of(p), p) for p in found]
    return targets


def _adapter_config(adapter: Path, config: str | None) -> tuple[Path, bool]:
    if config is not None:
        return _config_file(config), False
    for parent in adapter.resolve().parents:  # a checkpoint's engine/lora_adapter: the checkpoint's config
        if (parent / "config.yaml").exists():
            return parent / "config.yaml", True
    raise SystemExit(f"agl-lab eval: {adapter} is a LoRA adapter: name the config of its base model with --config")


def _config_file(config: str) -> Path:
    from agl_lab.presets import find_config

    try:
        return find_config(config)
    except FileNotFoundError as exc:
        raise SystemExit(f"agl-lab eval: {exc}") from None


def resolve(model: str | os.PathLike, config: str | None = None) -> list[_Target]:
    """The models MODEL names (see the module docstring), or a one-line SystemExit saying what it can be."""
    from agl_lab.models import PRESETS
    from agl_lab.presets import find_config, preset_names

    path = Path(model).expanduser()
    if path.is_dir() and (path / STATE_FILE).exists():
        return [_Target("checkpoint", path.name, path / "config.yaml", True, path, _step_of(path), path)]
    if path.is_dir() and (path / ADAPTER_CONFIG).exists():
        cfg, saved = _adapter_config(path, config)
        return [_Target("adapter", path.name, cfg, saved, path, None, path)]
    if path.is_dir():
        return _run_targets(path)
    if str(model) in PRESETS:
        cfg = _config_file(config) if config is not None else None
        return [_Target("base", str(model), cfg, overrides=[f"agl_lab.model.preset={model}"])]
    try:
        cfg = find_config(model)
    except FileNotFoundError:
        raise SystemExit(
            f"agl-lab eval: {model} is not a checkpoint (global_step_N with {STATE_FILE}), a run directory, "
            f"a LoRA adapter directory ({ADAPTER_CONFIG}), a config ({', '.join(preset_names())}) or a model "
            f"preset ({', '.join(sorted(PRESETS))})"
        ) from None
    return [_Target("base", cfg.stem, cfg)]


# ============================================================================ one model


def _overrides(target: _Target, *, task, n, temperature, seed, extra) -> list[str]:
    """The model's config, changed only where evaluation differs from training's validation."""
    out = [*target.overrides, *extra, f"actor_rollout_ref.rollout.val_kwargs.n={n}", "agl_lab.record.enabled=false"]
    out.append("trainer.logger=[console]")  # nothing goes to W&B or TensorBoard
    if task is not None:
        out.append(f"agl_lab.task.name={task}")
    if temperature is not None:
        out.append(f"agl_lab.server.val_temperature={temperature}")
    if seed is not None:
        out.append(f"agl_lab.seed={seed}")
    return out


def _build_trainer(target: _Target, overrides: list[str], work: Path):
    """A Trainer on the target's weights: its config, then the checkpoint or adapter loaded."""
    from agl_lab import config as config_mod
    from agl_lab.trainer import Trainer

    try:
        if target.kind == "checkpoint":
            return Trainer.load(target.path, overrides, run_dir=work, console=False)
        load = config_mod.load_saved_config if target.saved else config_mod.load_config
        trainer = Trainer(load(target.config, overrides), run_dir=work, console=False)
    except (config_mod.ConfigError, ValueError, KeyError, ModuleNotFoundError) as exc:  # what the config names
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise SystemExit(f"agl-lab eval: {' '.join(str(text).split())}") from None
    if target.kind == "adapter":
        _load_adapter(trainer, target.path)
    return trainer


def _load_adapter(trainer, adapter: Path) -> None:
    """A PEFT adapter into the local engine's LoRA layers (the engine's `load` does the same for a checkpoint)."""
    from agl_lab.engines.lora import load_adapter
    from agl_lab.engines.serving.fast_decode import warm

    engine = trainer.engine
    if getattr(engine, "lora_params", None) is None:
        trainer.close()
        raise SystemExit(
            f"agl-lab eval: {adapter} is a LoRA adapter, but the config builds no LoRA model on the local engine: "
            "set actor_rollout_ref.model.lora_rank (and lora_alpha, target_modules) as the adapter was trained"
        )
    with engine.weights_lock:
        load_adapter(engine.model, adapter)
        warm(engine.model)  # the LoRA merged again before serving


def _tasks(trainer, split: str) -> list[dict]:
    tasks = trainer.val_dataset if split == "val" else trainer.train_dataset
    if not tasks:
        trainer.close()
        raise SystemExit(f"agl-lab eval: no {split} tasks: set agl_lab.task.name (and n_val / n_train > 0)")
    return list(tasks)


def evaluate_one(target: _Target, *, k: int, n: int, split: str, threshold: float, seed, **run) -> Evaluation:
    """Run one model's validation rollouts (n per task) and tabulate them (files not written)."""
    from agl_lab.validation import build_validation

    with tempfile.TemporaryDirectory(prefix="agl-eval-") as work:
        trainer = _build_trainer(target, _overrides(target, n=n, seed=seed, **run), Path(work))
        with trainer:
            cfg = trainer.cfg
            tasks = [t for t in _tasks(trainer, split) for _ in range(n)]  # as Trainer.validate repeats them
            rollouts = trainer.rollout(tasks, is_train=False).rollouts
            fillna = float(cfg.agentlightning.reward_fillna_value)
            table = eval_stats.task_table(rollouts, n, k, threshold=threshold, reward_fillna_value=fillna)
            val_reward = build_validation(rollouts, fillna).metrics["val/reward"]
            seed_used = int(cfg.agl_lab.seed)
            summary = {
                "model": str(target.path or target.config or target.label),
                "kind": target.kind,
                "step": target.step if target.step is not None else trainer.global_step,
                "task": str(cfg.agl_lab.task.name),
                "split": split,
                "n": n,
                "k": k,
                "temperature": float(cfg.agl_lab.server.val_temperature),
                "seed": seed_used,
                "threshold": threshold,
                "val/reward": val_reward,
                **eval_stats.summarize(table, seed=seed_used),
            }
    return Evaluation(table, summary)


# ============================================================================ files


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def write(ev: Evaluation, out: Path) -> Evaluation:
    """`out/eval-<task>-<split>.json` (summary + tasks) and `.csv` (one row per task, one column per sample)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"eval-{_slug(ev.summary['task'])}-{ev.summary['split']}"
    ev.json, ev.csv = stem.with_suffix(".json"), stem.with_suffix(".csv")
    doc = {"summary": ev.summary, "tasks": json.loads(ev.tasks.to_json(orient="records"))}
    ev.json.write_text(json.dumps(doc, indent=1))
    flat = ev.tasks.drop(columns=["rewards", "answers"])
    samples = pd.DataFrame(ev.tasks["rewards"].tolist()).add_prefix("reward_")
    pd.concat([flat, samples], axis=1).to_csv(ev.csv, index=False)
    return ev


def load_evaluation(path: str | os.PathLike) -> Evaluation:
    """An evaluation `write` wrote: its JSON file, or a directory holding exactly one `eval-*.json`."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("eval-*.json"))
        if len(found) != 1:
            raise ValueError(f"{path}: expected one eval-*.json, found {[p.name for p in found] or 'none'}")
        path = found[0]
    doc = json.loads(path.read_text())
    return Evaluation(pd.DataFrame(doc["tasks"]), doc["summary"], json=path)


def is_evaluation(path: str | os.PathLike) -> bool:
    """Whether `path` is an evaluation file, or a directory holding evaluations and no run."""
    path = Path(path)
    if path.is_file():
        return path.name.startswith("eval-") and path.suffix == ".json"
    return path.is_dir() and not (path / "metrics.jsonl").exists() and any(path.glob("eval-*.json"))


# ============================================================================ the entry points


def _curve(evaluations: list[Evaluation]) -> pd.DataFrame:
    rows = []
    for ev in evaluations:
        s = ev.summary
        row = {"step": s["step"], "kind": s["kind"], "model": s["model"]}
        for column in eval_stats.score_columns(ev.tasks):
            interval = s.get(f"{column} ci") or [None, None]
            row.update({column: s.get(column), f"{column} lo": interval[0], f"{column} hi": interval[1]})
        rows.append(row)
    return pd.DataFrame(rows)


def _plot_curve(curve: pd.DataFrame, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for column in [c for c in curve.columns if c.split("@")[0] in ("pass", "mean") and " " not in c]:
        (line,) = ax.plot(curve["step"], curve[column], "o-", label=column)
        ax.fill_between(curve["step"], curve[f"{column} lo"], curve[f"{column} hi"], alpha=0.2, color=line.get_color())
    ax.set_xlabel("checkpoint step (0: base model)")
    ax.set_ylabel("score (95 % bootstrap band over tasks)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def evaluate(
    model: str | os.PathLike,
    *,
    task: str | None = None,
    k: int = 4,
    n: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    split: str = "val",
    threshold: float = eval_stats.DEFAULT_THRESHOLD,
    config: str | None = None,
    out: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    progress: bool = True,
) -> Evaluation | EvaluationCurve:
    """Evaluate `model` (see the module docstring) with `n` samples per task (default k) at
    `temperature` (default: the config's `agl_lab.server.val_temperature`), seeded by `seed`
    (default: the config's `agl_lab.seed`); a success is a reward ≥ `threshold`. Writes the
    files beside the checkpoint or adapter, or under `out` (a run: `out/<global_step_N>`);
    returns an Evaluation, or for a run an EvaluationCurve (base at step 0, then each checkpoint)."""
    from agl_lab.progress import progress_bar

    n = k if n is None else n
    if k < 1 or n < k:
        raise SystemExit(f"agl-lab eval: --k {k} --n {n}: need 1 ≤ k ≤ n (pass@k is estimated from n ≥ k samples)")
    if split not in ("val", "train"):
        raise SystemExit(f"agl-lab eval: --split {split!r} is not one of val, train")
    targets = resolve(model, config)
    is_run = len(targets) > 1 or Path(model).is_dir() and targets[0].kind == "base"
    out = Path(out) if out is not None else None
    bar = progress_bar(total=len(targets), desc="eval", disable=not progress)
    evaluations = []
    for target in targets:
        ev = evaluate_one(
            target, k=k, n=n, split=split, threshold=threshold, seed=seed,
            task=task, temperature=temperature, extra=list(overrides),
        )  # fmt: skip
        where = (out / target.label if is_run else out) if out is not None else target.out
        if where is None:
            raise SystemExit(f"agl-lab eval: {model} has no directory of its own: name one with --out")
        evaluations.append(write(ev, where))
        bar.set_postfix(**{target.label: round(ev.summary[f"pass@{k}"], 3)})
        bar.update(1)
    bar.close()
    if not is_run:
        return evaluations[0]
    curve = _curve(evaluations)
    root = out or Path(model)
    root.mkdir(parents=True, exist_ok=True)
    stem = root / f"eval-curve-{_slug(evaluations[0].summary['task'])}-{split}"
    curve.to_csv(stem.with_suffix(".csv"), index=False)
    return EvaluationCurve(evaluations, curve, stem.with_suffix(".csv"), _plot_curve(curve, stem.with_suffix(".png")))


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="agl-lab eval", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL_OR_RUN", help="checkpoint, run dir, LoRA adapter dir, config or preset")
    p.add_argument("--task", help="task or environment name (default: the config's agl_lab.task.name)")
    p.add_argument("--k", type=int, default=4, help="the pass@k budget (default 4)")
    p.add_argument("--n", type=int, help="samples per task, n ≥ k (default k)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: agl_lab.server.val_temperature)")
    p.add_argument("--seed", type=int, help="call seed and bootstrap seed (default: agl_lab.seed)")
    p.add_argument("--split", default="val", help="val (default) or train")
    p.add_argument("--threshold", type=float, default=eval_stats.DEFAULT_THRESHOLD, help="success: reward ≥ this")
    p.add_argument("--config", help="the config of a LoRA adapter's or a model preset's base model")
    p.add_argument("--out", help="write the files here (default: beside the checkpoint)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def eval_main(argv: list[str]) -> int:
    """`agl-lab eval MODEL_OR_RUN [...]`: the table and summary printed, the files' paths named."""
    args = _parser().parse_intermixed_args(argv)  # key=value overrides may follow the options
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise SystemExit(f"agl-lab eval: {bad[0]!r} is not key=value (one model per call)")
    from agl_lab.config import ConfigError

    try:
        result = evaluate(
            args.model, task=args.task, k=args.k, n=args.n, temperature=args.temperature, seed=args.seed,
            split=args.split, threshold=args.threshold, config=args.config, out=args.out, overrides=args.overrides,
        )  # fmt: skip
    except ConfigError as exc:  # an override the config does not have
        raise SystemExit(f"agl-lab eval: {exc}") from None
    for ev in result.evaluations if isinstance(result, EvaluationCurve) else [result]:
        s = ev.summary
        scores = [c for c in eval_stats.score_columns(ev.tasks) if s.get(c) is not None]
        line = " · ".join(f"{c} {s[c]:.3f} [{s[c + ' ci'][0]:.3f}, {s[c + ' ci'][1]:.3f}]" for c in scores)
        print(f"{s['kind']} step {s['step']}: {s['n_tasks']} tasks · {line} → {ev.json}")
        for note in s["notes"]:
            print(f"  note: {note}")
    if isinstance(result, EvaluationCurve):
        print(f"curve → {result.csv}, {result.png}")
    return 0
