"""Runs side by side: `compare(run_dirs)` → one DataFrame, the settings that differ as columns.

Every run directory a Trainer writes holds `config.yaml` (what it was asked to do) and
`metrics.jsonl` (one line per step). `compare` reads both:

    table = compare(["runs/lr1-s0", "runs/lr1-s1", "runs/lr2-s0", "runs/lr2-s1"])
    table            # one line per setting: the config keys that differ, n_seeds, mean ± s.e.
    table = compare({"n4": ["runs/n4/seed0", "runs/n4/seed1"], "n8": ["runs/n8/seed0", "runs/n8/seed1"]},
                    last=10)   # named settings; the last 10 *steps*; n8 − n4 paired by seed
    table.attrs["runs"]   # one line per run: its differing keys, seed, steps and metrics
    plot_compare(run_dirs, path="compare.png")   # training (and validation) reward per setting
    compare(["evals/base", "runs/x/checkpoints/global_step_20"])  # evaluations (agl_lab.evaluation),
                                                                    # paired by task with the first

A setting is a run's config minus what never defines one (`SEED_KEYS`, `IGNORED_KEYS`: the
seed, run and checkpoint directories, names) — or the name you give it; runs that share a
setting are its seeds. A metric's value per run is its mean over a window of *steps* (`last=10`:
the run's last 10 steps; `first=K`: its first K): validation, logged every `trainer.test_freq`
steps, averages the validations inside the window and says how many (`val/reward n`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

SEED_KEYS = ("agl_lab.seed",)
IGNORED_KEYS = (
    "agl_lab.run_dir",
    "trainer.default_local_dir",
    "trainer.experiment_name",
    "trainer.project_name",
    "trainer.resume_mode",
    "trainer.resume_from_path",
)
METRICS = ("training/reward", "val/reward")


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(node) if isinstance(node, list) else node}


def _load_run(run_dir: Path, repeated: str = "error") -> tuple[dict[str, Any], pd.DataFrame]:
    from omegaconf import OmegaConf

    from agl_lab.runs import read_records

    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for path in (cfg_path, metrics_path):
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: compare() reads run directories a Trainer wrote (config.yaml + metrics.jsonl)"
            )
    config = _leaves(OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False))
    return config, pd.DataFrame(read_records(metrics_path, repeated))  # steps that repeat: refused


def _window(df: pd.DataFrame, last: int | None, first: int | None) -> tuple[pd.DataFrame, str]:
    """The lines of steps inside the window and its name: `last=K` the steps (S − K, S] of a run
    that ended at step S; `first=K` the steps [1, K]. Windows are in steps, not in values: a metric
    logged every 10 steps (validation) has the values logged inside the window."""
    if last is not None and first is not None:
        raise ValueError("give last= or first=, not both (each is a window of steps)")
    if "step" not in df or not len(df):
        return df.iloc[0:0], "no steps"
    if first is not None:
        if first < 1:
            raise ValueError(f"first={first} must be >= 1 (steps)")
        return df[df["step"] <= first], f"steps 1-{first}"
    last = 10 if last is None else last
    if last < 1:
        raise ValueError(f"last={last} must be >= 1 (steps)")
    end = int(df["step"].max())
    return df[df["step"] > end - last], f"steps {max(end - last + 1, 0)}-{end}"


def _as_named(
    run_dirs: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]],
) -> list[tuple[str | None, Path]]:
    if isinstance(run_dirs, Mapping):
        return [
            (str(name), Path(d))
            for name, dirs in run_dirs.items()
            for d in ([dirs] if isinstance(dirs, (str, os.PathLike)) else dirs)
        ]
    return [(None, Path(d)) for d in run_dirs]


def runs_table(
    run_dirs: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]],
    metrics: Sequence[str] = METRICS,
    last: int | None = None,
    first: int | None = None,
    repeated: str = "error",
) -> tuple[pd.DataFrame, list[str]]:
    """One line per run and the differing config keys (see `compare` for the columns).

    Per run: `setting` (its name when named), the differing keys, `seed`, `steps`, `window`
    (the steps averaged), and per metric `<m>` (mean over the window's values), `<m> n` (how many
    values the window held: validations are every `trainer.test_freq` steps) and `<m> final`
    (the value at the last step that logged it)."""
    loaded = [(name, run_dir, *_load_run(run_dir, repeated)) for name, run_dir in _as_named(run_dirs)]
    keys = sorted(set().union(*(c for _, _, c, _ in loaded)))
    differ = [
        k
        for k in keys
        if k not in SEED_KEYS
        and k not in IGNORED_KEYS
        and len({json.dumps(c.get(k), default=str) for _, _, c, _ in loaded}) > 1
    ]
    named = any(name is not None for name, *_ in loaded)
    records = []
    for name, run_dir, config, df in loaded:
        record: dict[str, Any] = {"run": str(run_dir)}
        if named:
            record["setting"] = name
        record.update({k: config.get(k) for k in differ})
        window, label = _window(df, last, first)
        record.update(
            {
                "seed": config.get(SEED_KEYS[0]),
                "steps": int(df["step"].max()) if "step" in df and len(df) else 0,
                "window": label,
            }
        )
        for m in metrics:
            values = window[m].dropna() if m in window else pd.Series(dtype=float)
            everything = df[m].dropna() if m in df else pd.Series(dtype=float)
            record[m] = float(values.mean()) if len(values) else math.nan
            record[f"{m} n"] = int(len(values))
            record[f"{m} final"] = float(everything.iloc[-1]) if len(everything) else math.nan
        records.append(record)
    return pd.DataFrame(records), differ


def _setting_columns(runs: pd.DataFrame, differ: list[str]) -> list[str]:
    return ["setting"] if "setting" in runs else differ


def _paired(runs: pd.DataFrame, by: list[str], base: tuple, key: tuple, metric: str) -> tuple[float, float, int]:
    """Mean and s.e. of (setting − baseline) over the seeds both ran, and how many pairs."""

    def per_seed(k: tuple) -> pd.Series:
        mask = pd.Series(True, index=runs.index)
        for col, value in zip(by, k):
            mask &= runs[col].isna() if _isnan(value) else runs[col] == value
        return runs[mask].dropna(subset=[metric]).groupby("seed")[metric].mean()

    diff = (per_seed(key) - per_seed(base)).dropna()
    if not len(diff):
        return math.nan, math.nan, 0
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
    return float(diff.mean()), se, int(len(diff))


def _isnan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def compare(
    run_dirs: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]],
    metrics: Sequence[str] = METRICS,
    last: int | None = None,
    first: int | None = None,
    baseline: str | None = None,
    repeated: str = "error",
) -> pd.DataFrame:
    """One line per setting, mean ± s.e. over seeds of each metric in a window of **steps**.

    run_dirs: a list of run directories (settings are the config keys that differ, seeds the
    runs that share them) or named settings `{"n4": [dirs...], "n8": [dirs...]}` (a `setting`
    column, in this order). `last=K` (default 10): each run's last K steps, (S − K, S] for a run
    that ended at step S; `first=K`: its steps 1..K. A metric logged less often than every step
    (validation, every `trainer.test_freq` steps) averages the values logged inside the window,
    and `<metric> n` says how many that was (the fewest over the setting's seeds).

    Columns per metric: `<m> mean`, `<m> se` (standard error over seeds; NaN for one seed),
    `<m> n`, `<m> final` (mean over seeds of each run's last logged value), and, from the second
    setting on, `<m> diff` and `<m> diff se`: the difference to the `baseline` setting (default:
    the first) paired by seed — the mean over seeds run in both of (this − baseline), and its
    standard error — with `n_pairs`. `.attrs["runs"]` holds the per-run table, `.attrs["window"]`
    the window's description.

    A run whose `metrics.jsonl` logs a step twice (a second run appended to it) is refused with
    a ValueError naming it; `repeated="keep_last"` keeps each step's last copy, with a warning.
    """
    if _all_evaluations(run_dirs):
        return compare_evaluations(run_dirs)
    runs, differ = runs_table(run_dirs, metrics, last, first, repeated)
    by = _setting_columns(runs, differ)
    groups = list(runs.groupby(by, dropna=False, sort=False)) if by else [((), runs)]
    keys = [k if isinstance(k, tuple) else (k,) for k, _ in groups]
    if baseline is not None:
        if "setting" not in runs:
            raise ValueError("baseline= names a setting: pass named settings, compare({name: [run dirs]})")
        if (baseline,) not in keys:
            raise ValueError(f"baseline={baseline!r} is not one of the settings {[k[0] for k in keys]}")
    base = (baseline,) if baseline is not None else (keys[0] if keys else ())
    records = []
    for key, (_, group) in zip(keys, groups):
        record: dict[str, Any] = dict(zip(by, key))
        if by == ["setting"]:
            record.update({k: group[k].iloc[0] for k in differ})
        record["n_seeds"] = len(group)
        pairs = 0
        for m in metrics:
            values = group[m].dropna()
            record[f"{m} mean"] = float(values.mean()) if len(values) else math.nan
            record[f"{m} se"] = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            record[f"{m} n"] = int(group[f"{m} n"].min()) if len(group) else 0
            finals = group[f"{m} final"].dropna()
            record[f"{m} final"] = float(finals.mean()) if len(finals) else math.nan
            if len(keys) > 1:
                diff, se, n = (math.nan, math.nan, 0) if key == base else _paired(runs, by, base, key, m)
                record[f"{m} diff"], record[f"{m} diff se"] = diff, se
                pairs = max(pairs, n)
        if len(keys) > 1:
            record["n_pairs"] = pairs
        records.append(record)
    table = pd.DataFrame(records)
    table.attrs["runs"] = runs
    table.attrs["window"] = (
        f"first {first} steps" if first is not None else f"last {10 if last is None else last} steps"
    )
    table.attrs["baseline"] = base[0] if base and by == ["setting"] else dict(zip(by, base))
    return table


def _curves(group: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per step (index) × seed (columns): `metric` of each run of a setting."""
    curves = {}
    for run_dir, seed in zip(group["run"], group["seed"]):
        _, df = _load_run(Path(run_dir))
        if metric in df:
            curves[seed] = df.dropna(subset=[metric]).groupby("step")[metric].last()
    return pd.DataFrame(curves)


def plot_compare(
    run_dirs: Sequence[str | os.PathLike] | Mapping[str, Sequence[str | os.PathLike]],
    path: str | os.PathLike | None = None,
    metric: str = "training/reward",
    val_metric: str | None = "auto",
    diff: bool = False,
    baseline: str | None = None,
):
    """Per setting, the mean over seeds of `metric` per step (a band of ± s.e.), and `val_metric`
    as markers in the same colour (`auto`: `val/reward` when `metric` is the training reward, else
    none — a validation reward does not belong on another metric's axis). `run_dirs` as in
    `compare` (a list, or named settings). `diff=True` adds a lower panel: per step, each
    setting − the `baseline` setting (default the first), paired by seed, ± its s.e. — the
    curve of `compare`'s `<metric> diff`. Saves a PNG when `path` is given and returns its Path,
    else the Axes (a list of two with `diff`)."""
    if _all_evaluations(run_dirs):
        return _plot_evaluations(run_dirs, path)
    if val_metric == "auto":
        val_metric = "val/reward" if metric == "training/reward" else None
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs, differ = runs_table(run_dirs, (metric,))
    by = _setting_columns(runs, differ)
    groups = list(runs.groupby(by, dropna=False, sort=False)) if by else [(("all runs",), runs)]
    if diff:
        fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    base_curves, drawn = None, []
    for label, group in groups:
        label = label if isinstance(label, tuple) else (label,)
        frame = _curves(group, metric)
        if frame.empty:
            continue
        mean, se = frame.mean(axis=1), frame.std(axis=1, ddof=1) / math.sqrt(frame.shape[1])
        name = (
            str(label[0])
            if by in (["setting"], [])
            else ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(by, label))
        )
        seeds = frame.shape[1]
        (line,) = ax.plot(mean.index, mean.values, label=f"{name} ({seeds} seed{'s' if seeds > 1 else ''})")
        if frame.shape[1] > 1:
            ax.fill_between(mean.index, mean - se, mean + se, alpha=0.2, color=line.get_color())
        val = _curves(group, val_metric) if val_metric else pd.DataFrame()
        if not val.empty:
            ax.plot(val.index, val.mean(axis=1).values, "o", color=line.get_color())
        drawn.append((frame, line.get_color()))
        if (baseline is None and base_curves is None) or (baseline is not None and label[0] == baseline):
            base_curves, base_name = frame, name
    if diff:
        if base_curves is None:
            raise ValueError(f"baseline={baseline!r} is not one of the settings")
        for frame, color in drawn:
            seeds = [s for s in frame.columns if s in base_curves.columns]
            if frame is base_curves or not seeds:
                continue
            d = frame[seeds].sub(base_curves[seeds]).dropna()
            mean = d.mean(axis=1)
            ax_diff.plot(mean.index, mean.values, color=color)
            if len(seeds) > 1:
                se = d.std(axis=1, ddof=1) / math.sqrt(len(seeds))
                ax_diff.fill_between(mean.index, mean - se, mean + se, alpha=0.2, color=color)
        ax_diff.axhline(0, color="grey", linewidth=0.8)
        ax_diff.set_xlabel("step")
        ax_diff.set_ylabel(f"− {base_name} (paired by seed)")
    else:
        ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=8)
    if path is None:
        return [ax, ax_diff] if diff else ax
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------- evaluations (agl_lab.evaluation)


def _all_evaluations(paths: Any) -> bool:
    """Whether `paths` (a list, not named settings) are all evaluations: `eval-*.json` files or
    directories holding one (a checkpoint evaluated in place, an `--out` directory)."""
    from agl_lab.evaluation import is_evaluation

    return not isinstance(paths, Mapping) and bool(paths) and all(is_evaluation(p) for p in paths)


def compare_evaluations(paths: Sequence[str | os.PathLike], baseline: int = 0) -> pd.DataFrame:
    """One line per evaluation (`evaluation`, `model`, `kind`, `step`, `n_tasks`) and per score
    (`pass@…`, `mean@…`, `maj@…`): `<m> mean` with its interval `<m> lo`/`<m> hi`, and `<m> diff`,
    `<m> diff se`: this − the `baseline`-th evaluation, paired by task (the mean over the tasks
    both evaluated, and its standard error), with `n_pairs` (0 on the baseline's line)."""
    from agl_lab import eval_stats
    from agl_lab.evaluation import load_evaluation

    evaluations = [load_evaluation(p) for p in paths]
    base = evaluations[baseline]
    records = []
    for i, ev in enumerate(evaluations):
        s = ev.summary
        record: dict[str, Any] = {"evaluation": str(ev.json), "model": s.get("model"), "kind": s.get("kind")}
        record.update({"step": s.get("step"), "n_tasks": len(ev.tasks)})
        pairs = 0
        for column in eval_stats.score_columns(ev.tasks):
            interval = s.get(f"{column} ci") or [math.nan, math.nan]
            record.update({f"{column} mean": s.get(column), f"{column} lo": interval[0], f"{column} hi": interval[1]})
            if len(evaluations) > 1 and column in base.tasks:
                diff, se, n = (
                    (math.nan, math.nan, 0)
                    if i == baseline
                    else eval_stats.paired_difference(base.tasks, ev.tasks, column)
                )
                record[f"{column} diff"], record[f"{column} diff se"] = diff, se
                pairs = max(pairs, n)
        if len(evaluations) > 1:
            record["n_pairs"] = pairs
        records.append(record)
    return pd.DataFrame(records)


def _plot_evaluations(paths: Sequence[str | os.PathLike], path: str | os.PathLike | None):
    """Each evaluation's scores with their intervals, one group of points per evaluation."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    table = compare_evaluations(paths)
    scores = [c[: -len(" mean")] for c in table.columns if c.endswith(" mean") and not c.startswith("maj@")]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{kind} {step}" for kind, step in zip(table["kind"], table["step"])]
    for j, score in enumerate(scores):
        x = [i + 0.15 * j for i in range(len(table))]
        mean = table[f"{score} mean"].astype(float)
        err = [mean - table[f"{score} lo"].astype(float), table[f"{score} hi"].astype(float) - mean]
        ax.errorbar(x, mean, yerr=err, fmt="o", capsize=3, label=score)
    ax.set_xticks(range(len(table)), labels)
    ax.set_ylabel("score (95 % bootstrap interval over tasks)")
    ax.legend(fontsize=8)
    if path is None:
        return ax
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
