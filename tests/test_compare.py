"""agl_lab.compare (agl_lab.comparison): real runs of the tiny model (two learning rates × two seeds, 1 step each,
validated at that step), read back from their run directories."""

from __future__ import annotations

import math

import pytest

import agl_lab
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    dirs = []
    for lr in ("1e-3", "1e-4"):
        for seed in (0, 1):
            d = tmp_path_factory.mktemp(f"lr{lr}-s{seed}")
            with Trainer.from_config(
                "configs/cpu_tiny.yaml",
                overrides=[
                    *SMALL,
                    f"actor_rollout_ref.actor.optim.lr={lr}",
                    f"agl_lab.seed={seed}",
                    "trainer.test_freq=1",
                ],
                run_dir=d,
                console=False,
            ) as t:
                t.fit(1, progress=False)
            dirs.append(d)
    return dirs


def test_compare_has_one_line_per_setting_with_the_differing_key_and_mean_se_over_seeds(run_dirs):
    table = agl_lab.compare(run_dirs)
    assert list(table["actor_rollout_ref.actor.optim.lr"]) == [1e-3, 1e-4] and list(table.n_seeds) == [2, 2]
    runs = table.attrs["runs"]
    assert len(runs) == 4 and sorted(runs.seed) == [0, 0, 1, 1] and (runs.steps == 1).all()
    assert "agl_lab.seed" not in table and "agl_lab.run_dir" not in table  # seeds are replicates, not settings
    for lr in (1e-3, 1e-4):
        rewards = runs[runs["actor_rollout_ref.actor.optim.lr"] == lr]["training/reward"]
        line = table[table["actor_rollout_ref.actor.optim.lr"] == lr].iloc[0]
        assert line["training/reward mean"] == pytest.approx(rewards.mean())
        assert line["training/reward se"] == pytest.approx(rewards.std(ddof=1) / math.sqrt(2))
    assert table["val/reward mean"].notna().all()  # validation ran at step 1


def test_plot_compare_writes_a_png(run_dirs, tmp_path):
    path = agl_lab.plot_compare(run_dirs, tmp_path / "compare.png")
    assert path.stat().st_size > 0


def test_plot_compare_puts_validation_markers_only_on_the_reward_axis(run_dirs):
    import matplotlib.pyplot as plt

    markers = lambda ax: [ln for ln in ax.get_lines() if ln.get_linestyle() == "None"]  # noqa: E731
    reward = agl_lab.plot_compare(run_dirs)
    assert len(markers(reward)) == 2  # one validation series per setting
    grad = agl_lab.plot_compare(run_dirs, metric="actor/grad_norm")
    assert markers(grad) == [] and len(grad.get_lines()) == 2
    plt.close("all")


def test_compare_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.yaml not found"):
        agl_lab.compare([tmp_path])


# ---------------------------------------------------------------------------------------------
# Windows in steps, final values, named settings, paired-by-seed differences (issue 36), on run
# directories as a Trainer writes them: 50 steps, validation every 10 steps
# ---------------------------------------------------------------------------------------------


def _run_dir(path, seed, n, offset=0.0, steps=50, val_every=10):
    import json

    from omegaconf import OmegaConf

    from agl_lab.config import default_config

    cfg = default_config()
    cfg.agl_lab.seed, cfg.actor_rollout_ref.rollout.n, cfg.trainer.test_freq = seed, n, val_every
    path.mkdir(parents=True)
    OmegaConf.save(cfg, path / "config.yaml")
    lines = []
    for step in range(1, steps + 1):
        line = {"step": step, "training/reward": step / 100 + offset}
        if step % val_every == 0:
            line["val/reward"] = step / 50 + offset
        lines.append(json.dumps(line))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def study(tmp_path):
    # n8 − n4 = 0.10, 0.11, 0.12 for seeds 0, 1, 2
    return {
        "n4": [_run_dir(tmp_path / f"n4-s{s}", s, 4) for s in range(3)],
        "n8": [_run_dir(tmp_path / f"n8-s{s}", s, 8, offset=0.10 + 0.01 * s) for s in range(3)],
    }


def test_last_is_a_window_of_steps_and_validation_takes_the_validations_inside_it(study):
    table = agl_lab.compare(study["n4"], last=10)
    line = table.iloc[0]
    assert line["training/reward mean"] == pytest.approx(sum(range(41, 51)) / 10 / 100)
    # only the validation at step 50 is in the last 10 steps (the old last-10-*values* took 10-50: 0.6)
    assert line["val/reward mean"] == pytest.approx(1.0) and line["val/reward n"] == 1
    wide = agl_lab.compare(study["n4"], last=25).iloc[0]  # steps 26-50: validations 30, 40, 50
    assert wide["val/reward mean"] == pytest.approx(0.8) and wide["val/reward n"] == 3
    early = agl_lab.compare(study["n4"], first=20).iloc[0]  # steps 1-20: validations 10, 20
    assert early["val/reward mean"] == pytest.approx(0.3) and early["val/reward n"] == 2
    assert early["training/reward mean"] == pytest.approx(sum(range(1, 21)) / 20 / 100)
    assert line["val/reward final"] == pytest.approx(1.0) and line["training/reward final"] == pytest.approx(0.5)
    assert set(table.attrs["runs"]["window"]) == {"steps 41-50"}
    with pytest.raises(ValueError, match="not both"):
        agl_lab.compare(study["n4"], last=5, first=5)


def test_named_settings_and_the_paired_by_seed_difference(study):
    table = agl_lab.compare(study, last=10)
    assert list(table["setting"]) == ["n4", "n8"] and list(table["actor_rollout_ref.rollout.n"]) == [4, 8]
    n4, n8 = table.iloc[0], table.iloc[1]
    assert math.isnan(n4["val/reward diff"])  # the baseline
    diffs = [0.10, 0.11, 0.12]
    assert n8["val/reward diff"] == pytest.approx(0.11) and n8["training/reward diff"] == pytest.approx(0.11)
    se = (sum((d - 0.11) ** 2 for d in diffs) / 2) ** 0.5 / math.sqrt(3)
    assert n8["val/reward diff se"] == pytest.approx(se) and n8["n_pairs"] == 3
    # unpaired, the seeds' spread would be in the se; paired, only the spread of the differences is
    assert n8["val/reward se"] == pytest.approx(0.01 / math.sqrt(3)) and n8["val/reward diff se"] < 0.01
    other = agl_lab.compare(study, baseline="n8")
    assert other.iloc[0]["val/reward diff"] == pytest.approx(-0.11)
    with pytest.raises(ValueError, match="not one of the settings"):
        agl_lab.compare(study, baseline="n16")


def test_plot_compare_takes_named_settings_and_draws_the_paired_difference(study, tmp_path):
    import matplotlib.pyplot as plt

    ax, ax_diff = agl_lab.plot_compare(study, diff=True)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["n4 (3 seeds)", "n8 (3 seeds)"]
    assert ax_diff.get_ylabel() == "− n4 (paired by seed)"
    (curve,) = ax_diff.get_lines()[:1]
    assert curve.get_ydata() == pytest.approx([0.11] * 50)
    plt.close("all")
    assert agl_lab.plot_compare(study, tmp_path / "d.png", diff=True).stat().st_size > 0
