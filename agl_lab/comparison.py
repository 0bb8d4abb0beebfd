"""Runs side by side: `compare(run_dirs)` → one DataFrame, the settings that differ as columns.

Every run directory a Trainer writes holds `config.yaml` (what it was asked to do) and
`metrics.jsonl` (one line per step). `compare` reads both:

    table = compare(["runs/lr1-s0", "runs/lr1-s1", "runs/lr2-s0", "runs/lr2-s1"])
    table            # one line per setting: the config keys that differ, n_seeds, mean ± s.e.
    table.attrs["runs"]   # one line per run: its differing keys, seed, steps and metrics
    plot_compare(run_dirs, path="compare.png")   # training (and validation) reward per setting

A setting is a run's config minus what never defines one (`SEED_KEYS`, `IGNORED_KEYS`: the
seed, run and checkpoint directories, names); runs that share a setting are its seeds. A
metric's value per run is its mean over the last `last` steps that logged it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

SEED_KEYS = ("agl_lab.seed",)
IGNORED_KEYS = ("agl_lab.run_dir", "trainer.default_local_dir", "trainer.experiment_name", "trainer.project_name",
                "trainer.resume_mode", "trainer.resume_from_path")
METRICS = ("training/reward", "val/reward")


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(node) if isinstance(node, list) else node}


def _load_run(run_dir: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    from omegaconf import OmegaConf

    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for path in (cfg_path, metrics_path):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: compare() reads run directories a Trainer wrote "
                                    "(config.yaml + metrics.jsonl)")
    config = _leaves(OmegaConf.to_container(OmegaConf.load(cfg_path), resolve=False))
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return config, pd.DataFrame(lines)


def runs_table(run_dirs: Sequence[str | os.PathLike], metrics: Sequence[str] = METRICS,
               last: int = 10) -> tuple[pd.DataFrame, list[str]]:
    """One line per run (its differing config keys, seed, steps, metrics) and the differing keys."""
    loaded = [(Path(d), *_load_run(Path(d))) for d in run_dirs]
    keys = sorted(set().union(*(c for _, c, _ in loaded)))
    differ = [k for k in keys if k not in SEED_KEYS and k not in IGNORED_KEYS
              and len({json.dumps(c.get(k), default=str) for _, c, _ in loaded}) > 1]
    records = []
    for run_dir, config, df in loaded:
        record: dict[str, Any] = {"run": str(run_dir), **{k: config.get(k) for k in differ},
                                  "seed": config.get(SEED_KEYS[0]),
                                  "steps": int(df["step"].max()) if "step" in df and len(df) else 0}
        for m in metrics:
            values = df[m].dropna() if m in df else pd.Series(dtype=float)
            record[m] = float(values.tail(last).mean()) if len(values) else math.nan
        records.append(record)
    return pd.DataFrame(records), differ


def compare(run_dirs: Sequence[str | os.PathLike], metrics: Sequence[str] = METRICS, last: int = 10) -> pd.DataFrame:
    """One line per setting: the config keys that differ between runs, `n_seeds`, and for each
    metric `<metric> mean` and `<metric> se` (standard error over seeds; NaN for one seed).
    `.attrs["runs"]` holds the per-run table."""
    runs, differ = runs_table(run_dirs, metrics, last)
    groups = runs.groupby(differ, dropna=False, sort=False) if differ else [((), runs)]
    records = []
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        record: dict[str, Any] = dict(zip(differ, key))
        record["n_seeds"] = len(group)
        for m in metrics:
            values = group[m].dropna()
            record[f"{m} mean"] = float(values.mean()) if len(values) else math.nan
            record[f"{m} se"] = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
        records.append(record)
    table = pd.DataFrame(records)
    table.attrs["runs"] = runs
    return table


def plot_compare(run_dirs: Sequence[str | os.PathLike], path: str | os.PathLike | None = None,
                 metric: str = "training/reward", val_metric: str | None = "auto"):
    """Per setting, the mean over seeds of `metric` per step (a band of ± s.e.), and `val_metric`
    as markers in the same colour (`auto`: `val/reward` when `metric` is the training reward, else
    none — a validation reward does not belong on another metric's axis); saves a PNG when `path`
    is given and returns its Path, else the Axes."""
    if val_metric == "auto":
        val_metric = "val/reward" if metric == "training/reward" else None
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs, differ = runs_table(run_dirs, (metric,))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, group in (runs.groupby(differ, dropna=False, sort=False) if differ else [("all runs", runs)]):
        curves = []
        for run_dir in group["run"]:
            _, df = _load_run(Path(run_dir))
            if metric in df:
                curves.append(df.dropna(subset=[metric]).groupby("step")[metric].last())
        if not curves:
            continue
        frame = pd.concat(curves, axis=1)
        mean, se = frame.mean(axis=1), frame.std(axis=1, ddof=1) / math.sqrt(frame.shape[1])
        name = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(differ, label if isinstance(label, tuple)
                                                                       else (label,))) or str(label)
        line, = ax.plot(mean.index, mean.values, label=f"{name} (n={frame.shape[1]})")
        if frame.shape[1] > 1:
            ax.fill_between(mean.index, mean - se, mean + se, alpha=0.2, color=line.get_color())
        vals = [df.dropna(subset=[val_metric]).groupby("step")[val_metric].last()
                for df in (_load_run(Path(r))[1] for r in group["run"]) if val_metric and val_metric in df]
        if vals:
            val = pd.concat(vals, axis=1).mean(axis=1)
            ax.plot(val.index, val.values, "o", color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=8)
    if path is None:
        return ax
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
