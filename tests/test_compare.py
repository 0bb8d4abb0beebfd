"""agl_lab.compare (agl_lab.comparison): real runs of the tiny model (two learning rates × two seeds, 2 steps each),
read back from their run directories."""

from __future__ import annotations

import math

import pytest

import agl_lab
from agl_lab.trainer import Trainer
from tests.test_trainer import SMALL


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    dirs = []
    for lr in ("1e-3", "1e-4"):
        for seed in (0, 1):
            d = tmp_path_factory.mktemp(f"lr{lr}-s{seed}")
            with Trainer.from_config("configs/cpu_tiny.yaml", overrides=[
                    *SMALL, f"actor_rollout_ref.actor.optim.lr={lr}", f"agl_lab.seed={seed}",
                    "trainer.test_freq=2"], run_dir=d, console=False) as t:
                t.fit(2, progress=False)
            dirs.append(d)
    return dirs


def test_compare_has_one_line_per_setting_with_the_differing_key_and_mean_se_over_seeds(run_dirs):
    table = agl_lab.compare(run_dirs)
    assert list(table["actor_rollout_ref.actor.optim.lr"]) == [1e-3, 1e-4] and list(table.n_seeds) == [2, 2]
    runs = table.attrs["runs"]
    assert len(runs) == 4 and sorted(runs.seed) == [0, 0, 1, 1] and (runs.steps == 2).all()
    assert "agl_lab.seed" not in table and "agl_lab.run_dir" not in table  # seeds are replicates, not settings
    for lr in (1e-3, 1e-4):
        rewards = runs[runs["actor_rollout_ref.actor.optim.lr"] == lr]["training/reward"]
        line = table[table["actor_rollout_ref.actor.optim.lr"] == lr].iloc[0]
        assert line["training/reward mean"] == pytest.approx(rewards.mean())
        assert line["training/reward se"] == pytest.approx(rewards.std(ddof=1) / math.sqrt(2))
    assert table["val/reward mean"].notna().all()  # validation ran at step 2


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
