"""Staleness you can see (#50 items 2-3, docs/engines.md "Overlap"): every trained token carries
the policy version that sampled it (`rollout_versions`), the update logs `staleness/*` (token ages,
|Δlogp| by age) and `UpdateResult.staleness()` lists them per token.

- at max_staleness=1 the ages are 0 or 1, never above the bound, and the age histogram counts every
  trained response token once;
- at staleness 0 every token has age 0 and the age-0 |Δlogp| is `training/rollout_logprobs_diff_*`
  itself (split by age, not counted twice);
- under rollout_is=token the view's IS weight of a row is min(exp(old − rollout), threshold) by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from agl_lab.staleness import STALENESS_COLUMNS
from agl_lab.trainer import Trainer
from agl_lab.viz import plot_staleness
from tests.trainer_runs import SMALL

OVERLAP = [
    *SMALL,
    "agentlightning.async_rollout.enabled=true",
    "agentlightning.async_rollout.async_train_batch_size=6",
    "agl_lab.rollout.max_staleness=1",
    "algorithm.rollout_correction.bypass_mode=true",
    "agl_lab.model.warm_start_steps=50",
]
# decoupled: old logprobs recomputed by the trained version, so a stale token's gap is measured
DECOUPLED = [
    *OVERLAP[:-2],
    "algorithm.rollout_correction.bypass_mode=false",
    "algorithm.rollout_correction.rollout_is=token",
    "agl_lab.model.warm_start_steps=50",
]


def _steps(tmp_path, overrides, steps):
    """(batch, update) of each step of a tiny-model run."""
    out = []
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path, console=False) as t:
        for _ in range(steps):
            b = t.build_batch(t.rollout())
            out.append((b, t.update(b)))
    return out


def _trained_tokens(u) -> int:
    data = u.trained
    known = data.batch["response_mask"].bool() & (data.batch["rollout_versions"] >= 0)
    return int(known.sum())


def test_staleness_one_ages_stay_within_the_bound_and_count_every_token(tmp_path):
    ages_seen, gaps = set(), {}
    for _b, u in _steps(tmp_path, DECOUPLED, 3):
        m, frame = u.metrics, u.staleness()
        assert m["staleness/tokens_unknown_version"] == 0  # the gateway stamps every call
        histogram = {int(k.rsplit("_", 1)[1]): v for k, v in m.items() if k.startswith("staleness/tokens_age_")}
        assert set(histogram) <= {0, 1} and m["staleness/token_age_max"] <= 1
        assert sum(histogram.values()) == _trained_tokens(u) == len(frame)
        assert list(frame.columns) == STALENESS_COLUMNS and frame.age.between(0, 1).all()
        assert frame.groupby("age").size().to_dict() == {k: v for k, v in histogram.items() if v}
        for age, group in frame.groupby("age"):
            assert m[f"staleness/lp_diff_max_age_{age}"] == pytest.approx(group.lp_diff.max(), abs=1e-6)
            gaps.setdefault(int(age), []).append(m[f"staleness/lp_diff_mean_age_{age}"])
        ages_seen |= set(frame.age)
    assert 1 in ages_seen  # the overlap trained tokens of the version before
    print("mean |Δlogp| by age", gaps)
    assert min(gaps[1]) > 0  # sampled by the version before the trained one: a real gap


def test_under_bypass_the_gap_is_not_logged_as_a_measured_zero(tmp_path):
    """Bypass makes the old logprobs the sampling ones: |Δlogp| would be 0 by construction, so the
    `staleness/lp_diff_*` keys, `training/rollout_logprobs_diff_*` and the console's `lp_diff_max`
    are left out; ages are still logged."""
    from agl_lab.logger import format_console_line

    (_b, u), (_b2, u2) = _steps(tmp_path, OVERLAP, 2)
    for m in (u.metrics, u2.metrics):
        assert "staleness/token_age_max" in m and not [k for k in m if k.startswith("staleness/lp_diff")]
        assert not [k for k in m if k.startswith("training/rollout_logprobs_diff")]
    assert "lp_diff_max" not in format_console_line(2, u2.metrics)
    assert (u2.staleness().lp_diff == 0).all()  # the view still shows both logprobs: equal


def test_staleness_zero_age_zero_is_the_rollout_logprob_gap(tmp_path):
    (b, u), *_ = _steps(tmp_path, [*SMALL, "algorithm.rollout_correction.bypass_mode=false"], 1)
    m = u.metrics
    assert m["staleness/token_age_max"] == 0 and "staleness/tokens_age_1" not in m
    assert m["staleness/lp_diff_mean_age_0"] == pytest.approx(m["training/rollout_logprobs_diff_mean"], rel=1e-5)
    assert m["staleness/lp_diff_max_age_0"] == pytest.approx(m["training/rollout_logprobs_diff_max"], rel=1e-6)
    frame = u.staleness()  # the same gap by turn: the view's lines grouped by their `turn`
    assert frame.turn.nunique() >= 2  # the demo's task is multi-turn
    for turn, group in frame.groupby("turn"):
        assert m[f"staleness/lp_diff_mean_turn_{turn}"] == pytest.approx(group.lp_diff.mean(), rel=1e-5)
        assert m[f"staleness/lp_diff_max_turn_{turn}"] == pytest.approx(group.lp_diff.max(), abs=1e-7)
    assert not any(
        k.startswith("staleness/lp_diff_max_turn_") and k.rsplit("_", 1)[1] not in map(str, frame.turn) for k in m
    )


def test_is_weights_in_the_view_are_truncated_ratios_by_hand(tmp_path):
    threshold = 1.5
    overrides = [
        *SMALL,
        "algorithm.rollout_correction.bypass_mode=false",
        "algorithm.rollout_correction.rollout_is=token",
        f"algorithm.rollout_correction.rollout_is_threshold={threshold}",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path, console=False) as t:
        u = t.update(t.build_batch(t.rollout()))
        tokens = u.tokens(0)  # u.tokens(row): the same weights, row 0 token by token
    loss = tokens[tokens.loss_mask == 1]
    by_hand = np.minimum(np.exp(loss.old_logprob - loss.rollout_logprob), threshold)
    np.testing.assert_allclose(loss.is_weight, by_hand, rtol=1e-5)
    assert (loss.version == u.metrics["staleness/trained_version"]).all()
    frame = u.staleness()
    row = frame[frame.batch_row == 0]
    by_hand = np.minimum(np.exp(row.old_logprob - row.rollout_logprob), threshold)
    np.testing.assert_allclose(row.is_weight, by_hand, rtol=1e-5)
    assert (row.is_clipped == (np.exp(row.old_logprob - row.rollout_logprob) > threshold * (1 + 1e-5))).all()


def test_an_overlapped_step_replays_to_its_staleness_metrics(tmp_path):
    from agl_lab.replay import replay_step

    run = tmp_path / "run"
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=OVERLAP, run_dir=run, console=False) as t:
        logged = [t.step() for _ in range(3)]
        png = plot_staleness(t.metrics, path=tmp_path / "staleness.png")
    assert png.stat().st_size > 10_000  # drawn (docs/inspect.md shows how it reads)
    assert any(m.get("staleness/tokens_age_1", 0) > 0 for m in logged)  # an overlapped step to replay
    for step, m in enumerate(logged, start=1):
        result = replay_step(run, step)
        compared = result.comparison.set_index("metric")
        ages = [k for k in m if k.startswith("staleness/") and "lp_diff" not in k]  # no model: no Δlogp
        assert set(ages) <= set(compared.index), set(ages) - set(compared.index)
        assert compared.loc[ages, "equal"].all(), compared.loc[ages]


def test_the_console_splits_lp_diff_max_by_age_only_under_overlap():
    from agl_lab.logger import format_console_line

    metrics = {
        "training/rollout_logprobs_diff_max": 0.25,
        "staleness/lp_diff_max_age_1": 0.25,
        "staleness/lp_diff_max_age_0": 0.125,
    }
    assert format_console_line(3, metrics) == "step    3 | lp_diff_max 0.250"  # max_staleness 0: unchanged
    overlapped = format_console_line(3, {**metrics, "training/overlap/serving_version": 3.0})
    assert overlapped == "step    3 | lp_diff_max 0.250 | lp_diff_max_age0 0.125 | lp_diff_max_age1 0.250"
