"""Where metrics go: one console line per step, `metrics.jsonl` in the run directory, W&B.

W&B is off by default (`agl_lab.wandb.mode: disabled`); `offline` writes a local run that
`wandb sync` can upload later, `online` needs an API key. Nothing here is imported by the
pure core.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

# The keys the console line shows, in order, with their short labels.
CONSOLE_KEYS = (
    ("training/reward", "reward"),
    ("val/reward", "val"),
    ("training/n_sample_trained", "rows"),
    ("training/n_zero_adv_groups", "zero_adv"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    ("training/rollout_probs_diff_max", "lp_diff_max"),
    ("timing_s/step", "step_s"),
)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    parts = [f"step {step:>4}"]
    for key, label in CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            value = _jsonable(metrics[key])
            parts.append(f"{label} {value:.3f}" if isinstance(value, float) else f"{label} {value}")
    return " | ".join(parts)


class MetricsLogger:
    """Append-only metric sink. `log(step, metrics)` writes one JSON object per call."""

    def __init__(self, run_dir: str | os.PathLike, *, console: bool = True,
                 wandb_mode: str = "disabled", project: str = "agl_lab",
                 experiment: str = "run", config: Mapping[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.console = console
        self.history: list[dict[str, Any]] = []
        self._wandb_run = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb_run = wandb.init(project=project, name=experiment, mode=wandb_mode,
                                         dir=str(self.run_dir), config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            print(format_console_line(step, metrics), flush=True)
        if self._wandb_run is not None:
            self._wandb_run.log(dict(metrics), step=step)

    @property
    def wandb_run(self):
        return self._wandb_run

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
