"""Where metrics go: one console line per step, `metrics.jsonl` in the run directory, W&B, TensorBoard.

`trainer.logger` (verl's key) picks the sinks: `console`, `wandb`, `tensorboard`;
`metrics.jsonl` is always written, and so is `reward_curve.png` each time a validation is
logged (training reward per step, validation points so far), so a run stopped mid-way has
its curve. `tensorboard` is verl's own backend (`verl.utils.tracking.Tracking`): one scalar
per metric under its verl name, in `$TENSORBOARD_DIR`, else
`tensorboard_log/{trainer.project_name}/{trainer.experiment_name}` under the working directory
(verl's rule).

W&B is off by default (`agl_lab.wandb.mode: disabled`); `offline` writes a local run that
`wandb sync` can upload later, `online` needs an API key. Nothing here is imported by the
pure core.

With W&B on, the Trainer also uploads AGL v1's side tables through `MetricsLogger.log_tables`
(`log_batch_tables` below), built from the stage results:

| W&B key                              | when       | content                                       |
|--------------------------------------|------------|-----------------------------------------------|
| `training/trace_merge_mismatches`    | each step  | the first 100 merge breaks (AGL's columns)    |
| `training/rollout_trajectories`      | each step  | pointer to a jsonl.zip of 24 compact rollouts |
| `val/rollout_trajectories`           | validation | pointer to a jsonl.zip of every val rollout   |

A compact trajectory is `{rollout_id, reward, prompt, response}` of a rollout's last call.
An upload failure warns and never stops training (as in AGL v1).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import tempfile
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_lab.batch import MISMATCH_TABLE_ROWS, BreakRecord
from agl_lab.results import BatchResult
from agl_lab.validation import compact_trajectories

TRAIN_TRAJECTORY_RECORDS = 24  # compact train trajectories uploaded per step (AGL v1)
MISMATCH_COLUMNS = [
    "global_steps",
    "rollout_id",
    "data_id",
    "turn_index",
    "template_mismatch",
    "retoken_mismatch",
    "others_mismatch",
    "prompt_length",
    "response_length",
    "previous_trace_length",
    "current_trace_length",
    "previous_trace",
    "current_trace",
]  # AGL v1's column names, kept for dashboards built on them
TRAJECTORY_TABLE_COLUMNS = ["global_steps", "trajectory_artifact", "trajectory_artifact_path", "row_count"]

# The keys the console line shows, in order, with their short labels.
CONSOLE_KEYS = (
    ("training/reward", "reward"),
    ("val/reward", "val"),
    ("training/n_sample_trained", "rows"),
    ("training/n_sample_dropped/alignment", "dropped_rows"),  # rows; UpdateResult.dropped has one line per rollout
    ("training/n_failed_rollouts", "failed"),
    ("training/n_failed_rollouts_trained", "failed_trained"),  # shown when > 0 (CONSOLE_IF_NONZERO)
    ("training/n_missing_reward_rollouts", "no_reward"),
    ("training/n_zero_adv_groups", "zero_adv"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "entropy"),
    # max |log π_trainer − log π_sampler| over loss tokens (not verl's probability-space diff)
    ("training/rollout_logprobs_diff_max", "lp_diff_max"),
    ("timing_s/step", "step_s"),
)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_number(value: Any) -> str:
    """A console number that keeps its magnitude: 3 decimals, scientific below 1e-3 (4e-05, not
    0.000), `0` only for an exact zero; ints and other values as they are."""
    if not isinstance(value, float):
        return str(value)
    if value == 0:
        return "0"
    if math.isfinite(value) and abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3f}"


#: console keys shown only on the steps where they are not 0 (rollouts trained on a fill reward)
CONSOLE_IF_NONZERO = ("training/n_failed_rollouts_trained", "training/n_missing_reward_rollouts")


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    parts = [f"step {step:>4}"]
    for key, label in CONSOLE_KEYS:
        if key in CONSOLE_IF_NONZERO and not metrics.get(key):
            continue
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {format_number(_jsonable(metrics[key]))}")
        if label == "lp_diff_max" and OVERLAP_KEY in metrics:  # overlap: the same split by token age
            parts += [f"{label}_age{k.rsplit('_', 1)[1]} {format_number(_jsonable(v))}" for k, v in _by_age(metrics)]
    return " | ".join(parts)


#: logged only when generation overlaps the update (`agl_lab.rollout.max_staleness` > 0)
OVERLAP_KEY = "training/overlap/serving_version"


def _by_age(metrics: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """`staleness/lp_diff_max_age_k` items, by age k."""
    items = [(k, v) for k, v in metrics.items() if k.startswith("staleness/lp_diff_max_age_") and v is not None]
    return sorted(items, key=lambda kv: int(kv[0].rsplit("_", 1)[1]))


class MetricsLogger:
    """Append-only metric sink. `log(step, metrics)` writes one JSON object per call.

    `curve_path`: where `log` redraws the reward curve whenever a record carries `val/reward`
    (None: only `write_curve` draws it). `tensorboard`: also write every numeric metric as a
    scalar through verl's `Tracking` (see the module docstring for the directory).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        console: bool = True,
        wandb_mode: str = "disabled",
        project: str = "agl_lab",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        tensorboard: bool = False,
        curve_path: str | os.PathLike | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.console = console
        self.curve_path = None if curve_path is None else Path(curve_path)
        self.history: list[dict[str, Any]] = []
        self._wandb_run = None
        self._tracking = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb_run = wandb.init(
                project=project, name=experiment, mode=wandb_mode, dir=str(self.run_dir), config=dict(config or {})
            )
        if tensorboard:
            from verl.utils.tracking import Tracking

            self._tracking = Tracking(project, experiment, default_backend=["tensorboard"])

    @classmethod
    def for_run(cls, cfg: Any, run_dir: str | os.PathLike, *, console: bool = True) -> MetricsLogger:
        """The sinks `trainer.logger` and `agl_lab.wandb.mode` ask for, writing into `run_dir`."""
        from agl_lab import config as config_mod

        console_on, wandb_mode, tensorboard = config_mod.loggers(cfg)
        return cls(
            run_dir,
            console=console and console_on,
            wandb_mode=wandb_mode,
            tensorboard=tensorboard,
            project=str(cfg.trainer.project_name),
            experiment=str(cfg.trainer.experiment_name),
            config=config_mod.to_container(cfg),
            curve_path=Path(run_dir) / "reward_curve.png",
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            print(format_console_line(step, metrics), flush=True)
        if self._wandb_run is not None:
            self._wandb_run.log(dict(metrics), step=step)
        if self._tracking is not None:  # scalars only: TensorBoard's add_scalar takes one number
            self._tracking.log(
                {
                    k: v
                    for k, v in record.items()
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                },
                step=step,
            )
        if self.curve_path is not None and record.get("val/reward") is not None:
            self.write_curve(self.curve_path)  # the validation curve so far, at trainer.test_freq

    @property
    def frame(self):
        """Every logged record as a DataFrame indexed by step (a validation logged before
        training shares its step's row)."""
        import pandas as pd

        return pd.DataFrame(self.history).groupby("step").last() if self.history else pd.DataFrame()

    def write_curve(self, path: str | os.PathLike | None = None):
        """Training reward per step and validation reward where it ran (`viz.plot_run_metrics`)."""
        from agl_lab.viz import plot_run_metrics

        return plot_run_metrics(self.frame, path)

    def drop_after(self, step: int) -> int:
        """Keep only the lines of steps <= `step` in metrics.jsonl (rewritten atomically), and a
        torn last line is dropped too: after a resume from `step`, the log matches the model
        (a killed run's later steps are redone, not listed twice). Returns the lines dropped."""
        if not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the line a kill -9 cut short
                dropped += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
                dropped += 1
            else:
                kept.append(line + "\n")
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self.history = [r for r in self.history if r.get("step", 0) <= step]
        return dropped

    @property
    def wandb_run(self):
        return self._wandb_run

    def log_tables(
        self, step: int, result: Any, split: str = "train", *, tokenizer: Any = None, reward_fillna_value: float = 0.0
    ) -> None:
        """AGL v1's W&B side tables of a `BatchResult` (train) or `ValidationResult`; no-op
        without W&B."""
        if self._wandb_run is not None:
            log_batch_tables(
                self._wandb_run, result, step, split, tokenizer=tokenizer, reward_fillna_value=reward_fillna_value
            )

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._tracking is not None:
            self._tracking.finish()
            self._tracking = None


def throughput_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """verl's `perf/*` step metrics (one device): tokens of the trained batch per step second."""
    tokens = float(metrics.get("perf/total_num_tokens", 0.0))
    seconds = float(metrics["timing_s/step"])
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": seconds,
        "perf/throughput": tokens / seconds if seconds > 0 else 0.0,
    }


def read_metrics(path: str | os.PathLike, repeated: str = "error") -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` file, in order. A log whose steps repeat (a run appended
    to another) raises ValueError naming them; `repeated="keep_last"` keeps each step's last copy
    and warns (`agl_lab.runs.read_records`)."""
    from agl_lab.runs import read_records

    return read_records(path, repeated)


# =========================================================================== W&B side tables


def mismatch_table_rows(breaks: Sequence[BreakRecord], step: int) -> list[list[Any]]:
    """AGL v1's `training/trace_merge_mismatches` rows (first 100 breaks), flags from the diagnosis."""
    out = []
    for b in breaks[:MISMATCH_TABLE_ROWS]:
        kind = b.diagnosis.kind if b.diagnosis is not None else None
        out.append(
            [
                step,
                b.rollout_id,
                b.data_id,
                b.call,
                kind == "template",
                kind == "retokenization",
                kind not in ("template", "retokenization"),
                b.prompt_tokens,
                b.response_tokens,
                b.previous_trace_tokens,
                b.current_trace_tokens,
                b.previous_trace,
                b.current_trace,
            ]
        )
    return out


def trajectories_zip(records: Sequence[dict[str, Any]], member: str) -> bytes:
    """One JSONL member (compact separators, UTF-8) in a deflate zip."""
    lines = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in records)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, lines.encode("utf-8"))
    return buffer.getvalue()


def log_batch_tables(
    run: Any,
    result: Any,
    step: int,
    split: str = "train",
    *,
    tokenizer: Any = None,
    reward_fillna_value: float = 0.0,
    wandb_module: Any = None,
) -> None:
    """Upload AGL v1's side tables to a W&B run (`run.log`, `run.log_artifact`, `run.id`).

    train (`result`: `agl_lab.results.BatchResult`): `training/trace_merge_mismatches`
    (always, ≤100 rows) and the first 24 compact trajectories, decoded with `tokenizer`;
    validation (`result`: `agl_lab.validation.ValidationResult`): all its compact trajectories.
    `wandb_module` supplies `Table` and `Artifact` (default: `import wandb`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"log_batch_tables: split must be 'train' or 'validation', got {split!r}.")
    if split == "train" and not isinstance(result, BatchResult):
        raise TypeError(
            "log_batch_tables: split 'train' needs the BatchResult of Trainer.build_batch "
            "(or agl_lab.results.BatchResult(agl_lab.batch.build_batch(...)))."
        )
    if wandb_module is None:
        import wandb as wandb_module
    try:
        if split == "train":
            table = wandb_module.Table(
                columns=list(MISMATCH_COLUMNS), data=mismatch_table_rows(result.built.breaks, step)
            )
            run.log({"training/trace_merge_mismatches": table}, step=step)
            records = compact_trajectories(result.rollouts, reward_fillna_value, tokenizer, TRAIN_TRAJECTORY_RECORDS)
        else:
            records = result.trajectories
        _log_trajectories(run, records, step, split, wandb_module)
    except Exception as exc:  # noqa: BLE001 - W&B side-uploads are best effort, like AGL v1
        warnings.warn(f"log_batch_tables: W&B upload for step {step} failed: {exc!r}", stacklevel=2)


def _log_trajectories(run: Any, records: list[dict[str, Any]], step: int, split: str, wandb_module: Any) -> None:
    """The jsonl.zip artifact of compact trajectories and its one-row pointer table."""
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", str(getattr(run, "id", None) or "run"))
    name = f"{split}-trajectories-{safe_id}-step-{step}"
    path = f"step_{step}/{split}_trajectories.jsonl.zip"
    artifact = wandb_module.Artifact(
        name=name,
        type=f"{split}_trajectories",
        metadata={"global_steps": step, "row_count": len(records), "format": "jsonl.zip"},
    )
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        with open(local, "wb") as fh:
            fh.write(trajectories_zip(records, f"{split}_trajectories.jsonl"))
        artifact.add_file(local, name=path)  # wandb copies the file here (policy "mutable")
        run.log_artifact(artifact)
    key = "training/rollout_trajectories" if split == "train" else "val/rollout_trajectories"
    table = wandb_module.Table(columns=list(TRAJECTORY_TABLE_COLUMNS), data=[[step, name, path, len(records)]])
    run.log({key: table}, step=step)
