"""What each stage of a training step returns: plain objects that display well in Jupyter.

    RolloutResult  .rollouts (list[CompletedRollout]) .triplets .lifecycle .groups .metrics
    BatchResult    .data (verl DataProto) .rows .breaks .groups .metrics .built (the records)
    UpdateResult   .metrics .weights .dropped .skipped

DataFrames are computed on first access from the stage's own records (`agl_lab.views`) and
cached, so a result is cheap to create and can be rebuilt with other settings from the same
rollouts. Outside a Trainer, wrap the batch builder's record yourself:
`BatchResult(agl_lab.batch.build_batch(rollouts, ...))`.
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pandas as pd

from agl_lab.records import CompletedRollout

if TYPE_CHECKING:  # batch imports torch; the results only hold its record
    from agl_lab.batch import BuiltBatch


def _metrics_table(metrics: dict[str, Any], keys: list[str]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{metrics[k]:.4g}</td></tr>"
        if isinstance(metrics[k], float)
        else f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(metrics[k]))}</td></tr>"
        for k in keys
        if k in metrics
    )
    return f"<table>{rows}</table>"


def _summary_html(title: str, lines: list[str], metrics: dict[str, Any], keys: list[str]) -> str:
    items = "".join(f"<li>{line}</li>" for line in lines)
    return f"<div><b>{html.escape(title)}</b><ul>{items}</ul>{_metrics_table(metrics, keys)}</div>"


def _short_repr(obj: Any, parts: list[str]) -> str:
    return f"{type(obj).__name__}({', '.join(parts)})"


def _first_line(message: str | None, limit: int = 200) -> str:
    """First line of an error message, shortened (tracebacks follow on later lines)."""
    text = (message or "").strip()
    line = text.splitlines()[0] if text else "no error message"
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(repr=False)
class RolloutResult:
    """The completed rollouts of one rollout phase."""

    step: int
    rollouts: list[CompletedRollout]
    metrics: dict[str, Any]
    is_train: bool = True
    carry_over: list[dict[str, Any]] = field(default_factory=list)
    tokenizer: Any = field(default=None, repr=False)  # decodes `.triplets`' text columns

    @cached_property
    def triplets(self) -> pd.DataFrame:
        from agl_lab.views import triplets_df

        return triplets_df(self.rollouts, self.tokenizer)

    @cached_property
    def lifecycle(self) -> pd.DataFrame:
        from agl_lab.views import lifecycle_df

        return lifecycle_df(self.rollouts, start=self.metrics.get("timing/step_start_wall"))

    @cached_property
    def groups(self) -> pd.DataFrame:
        from agl_lab.views import groups_df

        return groups_df(self.rollouts)

    @property
    def failed(self) -> list[CompletedRollout]:
        """The rollouts that ended `failed` (their `error_message` says why)."""
        return [r for r in self.rollouts if r.state == "failed"]

    @property
    def mean_reward(self) -> float | None:
        """Mean final reward of the rollouts that have one (None when none has)."""
        values = [r.final_reward for r in self.rollouts if r.final_reward is not None]
        return float(sum(values) / len(values)) if values else None

    def __repr__(self) -> str:
        reward = self.mean_reward
        parts = [
            f"step={self.step}",
            f"rollouts={len(self.rollouts)}",
            f"failed={len(self.failed)}",
            f"mean_reward={'None' if reward is None else f'{reward:.3f}'}",
            f"carry_over_groups={len(self.carry_over)}",
        ]
        if self.failed:
            parts.append(f"first_error={_first_line(self.failed[0].error_message)!r}")
        return _short_repr(self, parts)

    def _repr_html_(self) -> str:
        n_failed = len(self.failed)
        n_calls = sum(len(r.triplets) for r in self.rollouts)
        reward = self.mean_reward
        lines = [
            f"step {self.step} · {'train' if self.is_train else 'validation'}",
            f"{len(self.rollouts)} rollouts in {len({r.data_id for r in self.rollouts})} groups, "
            f"{n_failed} failed, {n_calls} model calls, mean reward "
            f"{'—' if reward is None else f'{reward:.3f}'}",
        ]
        if n_failed:
            lines.append(
                f"<span style='color:#c33'>first error: "
                f"{html.escape(_first_line(self.failed[0].error_message))}</span> "
                "(all of them: <code>.lifecycle[['rollout_id', 'state', 'error_message']]</code>)"
            )
        if self.carry_over:
            lines.append(f"{len(self.carry_over)} groups carried over to the next step")
        keys = ["training/reward", "val/reward", "timing/rollout_total_s/p50", "timing/rollout_total_s/max"]
        return _summary_html("RolloutResult", lines, self.metrics, keys)


@dataclass(repr=False)
class BatchResult:
    """Training rows built from a rollout phase: the verl DataProto, its records and views.

    `built` is the batch builder's plain record (`agl_lab.batch.BuiltBatch`); `.rows`,
    `.breaks` and `.groups` are DataFrames built from it on first access.
    """

    built: BuiltBatch
    step: int = 0
    tokenizer: Any = field(default=None, repr=False)  # decodes `.rows`' text columns
    metrics: dict[str, Any] = field(init=False)
    # The policy version an update of this batch produced (None: not used for an update yet).
    # `Trainer.update` refuses a used batch: its rollouts are off-policy now.
    updated_to_version: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.metrics = dict(self.built.metrics)

    @property
    def data(self) -> Any:
        """The verl DataProto of the kept rows."""
        return self.built.data

    @property
    def level(self) -> str:
        return self.built.level

    @property
    def rollouts(self) -> list[CompletedRollout]:
        """The rollouts the rows came from, sorted as the batch builder sorts them."""
        return self.built.rollouts

    @cached_property
    def rows(self) -> pd.DataFrame:
        from agl_lab.views import rows_frame

        return rows_frame(self.built.rows, self.tokenizer)

    @cached_property
    def breaks(self) -> pd.DataFrame:
        from agl_lab.views import breaks_frame

        return breaks_frame(self.built.breaks)

    @cached_property
    def groups(self) -> pd.DataFrame:
        from agl_lab.views import groups_df

        return groups_df(self.rollouts, self.built)

    def __repr__(self) -> str:
        n_rows = len(self.data) if self.data is not None else 0
        return _short_repr(
            self,
            [
                f"step={self.step}",
                f"rows={n_rows}",
                f"rollouts={len(self.rollouts)}",
                f"breaks={len(self.built.breaks)}",
            ],
        )

    def _repr_html_(self) -> str:
        n_rows = len(self.data) if self.data is not None else 0
        lines = [
            f"step {self.step} · {n_rows} rows from {len(self.rollouts)} rollouts ({self.level} level)",
            f"{len(self.built.breaks)} merge breaks",
        ]
        keys = [
            "training/n_sample",
            "training/n_unmerged_rollouts",
            "training/n_truncated_sample",
            "training/n_trace_merge_mismatch_rows",
        ]
        return _summary_html("BatchResult", lines, self.metrics, keys)


@dataclass(repr=False)
class UpdateResult:
    """One policy update: metrics, the per-rollout loss-weight table and every dropped rollout.

    `weights`: one line per trained rollout with its advantage and the loss weight it carries
    (`agl_lab.algorithms.rollout_weights_table`); empty when the step was skipped.
    `dropped`: one line per rollout that lost rows, `rows` of them, and why (`reason`); the
    console's `dropped_rows` and `training/n_sample_dropped/*` count rows (`dropped_rows` here).
    """

    step: int
    metrics: dict[str, Any]
    weights: pd.DataFrame
    dropped: pd.DataFrame
    skipped: bool = False
    policy_version: int = 0
    # For `tokens`: the BatchResult updated on, the batch as trained (old_log_probs, advantages;
    # dropped rows gone), the engine that trained it and the sampling temperature.
    batch: Any = field(default=None, repr=False)
    trained: Any = field(default=None, repr=False)
    engine: Any = field(default=None, repr=False)
    temperature: float = 1.0

    def tokens(self, row: Any) -> pd.DataFrame:
        """One line per response token of `row` — an int (the row of the batch: `b.rows.batch_index`)
        or a line of `b.rows` — with the rollout, old and new logprob, ratio, entropy, loss mask and
        advantage (`agl_lab.token_view`; new logprob and entropy: the engine's current policy,
        computed now, = this update's policy unless the engine trained again)."""
        from agl_lab.token_view import find_row, row_key, tokens_frame

        if self.trained is None or self.engine is None or self.batch is None:
            raise RuntimeError(
                "UpdateResult.tokens needs the trained batch and its engine: use the result of "
                "Trainer.update() (a skipped or replayed update has neither)"
            )
        import warnings

        rollout_id, first_call = row_key(row, self.batch.data)
        i, data = find_row(self.trained, rollout_id, first_call), self.trained
        if i is None:  # dropped before the update: its tokens from the built batch, nothing of the update
            warnings.warn(
                f"the row of rollout {rollout_id} starting at call {first_call} was not trained (dropped "
                "before the update: see UpdateResult.dropped); old_logprob, ratio and advantage are NaN",
                stacklevel=2,
            )
            i, data = find_row(self.batch.data, rollout_id, first_call), self.batch.data
        frame = tokens_frame(
            data, i, self.engine, self.batch.tokenizer, temperature=self.temperature, policy_version=self.policy_version
        )
        frame.attrs["trained"] = data is self.trained
        return frame

    def staleness(self) -> pd.DataFrame:
        """One line per trained loss token: batch_row, rollout_id, turn, position, version (that
        sampled it), age (= the trained version − version), rollout/old logprob, lp_diff, is_weight
        and is_clipped (`agl_lab.staleness.staleness_frame`). Group by `age` or `turn` for the
        per-age / per-turn view; `attrs["trained_version"]` is the version the update started from."""
        from agl_lab.staleness import staleness_frame

        version = self.metrics.get("staleness/trained_version")
        if self.trained is None or version is None:
            raise RuntimeError(
                "UpdateResult.staleness needs the trained batch and its rollout_versions: use the result "
                "of Trainer.update() on a batch built by build_batch (a skipped update has none)"
            )
        return staleness_frame(self.trained, int(version))

    @property
    def dropped_rows(self) -> int:
        """Rows of the dropped rollouts (the unit of the console's `dropped_rows`)."""
        return int(self.dropped["rows"].sum()) if len(self.dropped) else 0

    def __repr__(self) -> str:
        return _short_repr(
            self,
            [
                f"step={self.step}",
                f"skipped={self.skipped}",
                f"policy_version={self.policy_version}",
                f"dropped={len(self.dropped)} rollouts/{self.dropped_rows} rows",
            ],
        )

    def _repr_html_(self) -> str:
        state = "skipped (no trainable rows)" if self.skipped else f"policy version → {self.policy_version}"
        lines = [f"step {self.step} · {state}", f"{len(self.dropped)} dropped rollouts ({self.dropped_rows} rows)"]
        keys = [
            "training/n_sample_trained",
            "training/n_zero_adv_groups",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/entropy",
            "training/rollout_probs_diff_max",
        ]
        return _summary_html("UpdateResult", lines, self.metrics, keys)


# =============================================================================================
# Rollouts that train on a reward they never earned: said every step (issue 36)
# =============================================================================================

_problems_logger = logging.getLogger("agl_lab.rollout_problems")
EXCLUDE_KEY = "agl_lab.algorithm.exclude_failed_rollouts"
FILLNA_KEY = "agentlightning.reward_fillna_value"


def report_rollout_problems(batch: BatchResult) -> BatchResult:
    """Count and say the rollouts of `batch` that train on `reward_fillna_value` (returns `batch`;
    the fill value said is the one on their rows).

    - FAILED rollouts with trained rows (the default, as Agent Lightning: failures train with
      the fill reward): `training/n_failed_rollouts_trained`, and one warning per step naming the
      count, the first error and `agl_lab.algorithm.exclude_failed_rollouts`, the key that leaves
      them out. The console line shows `failed_trained N` on such steps.
    - Rollouts that ended without a reward (the agent returned None and emitted no reward event):
      `training/n_missing_reward_rollouts`, one warning per step; console `no_reward N`.
    - Rows dropped for a prompt over the limit: `training/n_dropped_prompt_too_long`, one warning
      per step naming the key to raise (`_report_prompt_too_long`).
    """
    reward = {row.rollout_id: row.reward for row in batch.built.rows if not row.skipped_empty}
    trained = set(reward)
    rollouts = batch.built.rollouts
    failed = [r for r in rollouts if r.state == "failed" and r.rollout_id in trained]
    missing = [r for r in rollouts if r.state != "failed" and r.final_reward is None]
    batch.metrics["training/n_failed_rollouts_trained"] = len(failed)
    batch.metrics["training/n_missing_reward_rollouts"] = len(missing)
    if failed:
        first = (failed[0].error_message or "no error message").strip()
        _problems_logger.warning(
            "step %d: %d of %d rollouts FAILED and are trained with reward %g (%s, as Agent Lightning does): "
            "their rows pull the policy away from what they sampled. First error (rollout %s): %s\n"
            "To leave failed rollouts out of training set %s=true (every error: RolloutResult.lifecycle"
            "[['rollout_id', 'state', 'error_message']]).",
            batch.step + 1,  # the console's 1-based step
            len(failed),
            len(rollouts),
            reward[failed[0].rollout_id],
            FILLNA_KEY,
            failed[0].rollout_id,
            first[:2000],
            EXCLUDE_KEY,
        )
    if missing:
        _problems_logger.warning(
            "step %d: %d of %d rollouts ended without a reward (the agent returned None and emitted no reward "
            "event, e.g. rollout %s); they are trained with reward %s (%s). Return the reward from the agent, "
            "or post a reward event for the rollout before it returns.",
            batch.step + 1,  # the console's 1-based step
            len(missing),
            len(rollouts),
            missing[0].rollout_id,
            next((f"{reward[r.rollout_id]:g}" for r in missing if r.rollout_id in reward), "(none: no rows)"),
            FILLNA_KEY,
        )
    _report_prompt_too_long(batch)
    return batch


def _report_prompt_too_long(batch: BatchResult) -> None:
    """One warning a step whose rows were dropped for a prompt over the limit (AGL drops them
    without a word), naming the key to raise: a step can otherwise train nothing and say only
    that no trainable row was left."""
    dropped = [row for row in batch.built.rows if row.is_drop and not row.skipped_empty]
    if not dropped:
        return
    key = (
        "agentlightning.trace_aggregator.trajectory_max_prompt_length"
        if str(batch.level).startswith("trajectory")
        else "data.max_prompt_length"
    )
    n_rows = sum(not row.skipped_empty for row in batch.built.rows)
    _problems_logger.warning(
        "step %d: %d of %d rows dropped: their prompt is longer than %s=%d "
        "(training/n_dropped_prompt_too_long); raise it to train on them",
        batch.step + 1,  # the console's 1-based step
        len(dropped),
        n_rows,
        key,
        dropped[0].prompt_tokens,  # cut to the limit when marked (batch.py)
    )
