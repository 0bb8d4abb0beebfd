"""agl_lab.sweep / `agl-lab sweep`: a grid × seeds of real `agl-lab train` runs, each in its own
directory named after its setting, then one `compare` table (issue 36)."""

from __future__ import annotations

import json

import pytest

from agl_lab.sweep import grid_settings, parse_axes, setting_dir, sweep, sweep_main
from tests.trainer_runs import SMALL


def test_axes_fixed_overrides_and_the_setting_names():
    axes, fixed = parse_axes(
        [
            "actor_rollout_ref.rollout.n=4,8",
            "data.train_batch_size=8,4",
            "trainer.test_freq=1",
            "agl_lab.task.tools=[a,b]",
        ]
    )
    assert axes == {"actor_rollout_ref.rollout.n": ["4", "8"], "data.train_batch_size": ["8", "4"]}
    assert fixed == ["trainer.test_freq=1", "agl_lab.task.tools=[a,b]"]  # a list literal is one value
    product = grid_settings(axes)
    assert list(product) == [
        "n=4,train_batch_size=8",
        "n=4,train_batch_size=4",
        "n=8,train_batch_size=8",
        "n=8,train_batch_size=4",
    ]
    zipped = grid_settings(axes, zip_axes=True)
    assert zipped == {
        "n=4,train_batch_size=8": ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=8"],
        "n=8,train_batch_size=4": ["actor_rollout_ref.rollout.n=8", "data.train_batch_size=4"],
    }
    assert setting_dir("n=4,train_batch_size=8") == "n4-train_batch_size8"
    with pytest.raises(ValueError, match="same number of values"):
        grid_settings({"a.x": ["1", "2"], "b.y": ["1"]}, zip_axes=True)
    with pytest.raises(ValueError, match="not key=value"):
        parse_axes(["rollout.n"])


def test_a_sweep_runs_each_setting_and_seed_in_its_own_dir_and_compares_them(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = sweep_main(
        [
            "configs/cpu_tiny.yaml",
            "actor_rollout_ref.actor.optim.lr=1e-3,1e-4",
            *SMALL,
            "--seeds",
            "0,1",
            "--parallel",
            "2",
            "--steps",
            "1",
            "--out",
            str(out),
            "--last",
            "1",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    dirs = sorted(p.relative_to(out).as_posix() for p in out.glob("*/seed*"))
    assert dirs == ["lr1e-3/seed0", "lr1e-3/seed1", "lr1e-4/seed0", "lr1e-4/seed1"]
    for d in dirs:
        assert (out / d / "metrics.jsonl").exists() and "done: 1 steps" in (out / d / "train.log").read_text()
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["settings"] == {
        "lr=1e-3": ["actor_rollout_ref.actor.optim.lr=1e-3"],
        "lr=1e-4": ["actor_rollout_ref.actor.optim.lr=1e-4"],
    }
    assert "lr=1e-3" in printed and "training/reward mean" in printed  # the summary table
    # again: every run is done, none runs twice; the table is the same comparison, by name
    result = sweep(
        "configs/cpu_tiny.yaml", manifest["settings"], seeds=[0, 1], overrides=SMALL, out=out, last=1, steps=1
    )
    assert list(result.runs["log"]) == ["already done"] * 4
    assert list(result.table["setting"]) == ["lr=1e-3", "lr=1e-4"] and list(result.table["n_seeds"]) == [2, 2]
    assert result.table["n_pairs"].iloc[1] == 2  # lr=1e-4 − lr=1e-3, paired by seed
    assert set(result.runs["seed"]) == {0, 1}
    # a finished run counts as done only for the same command: other overrides in that dir run again
    from agl_lab.sweep import _command, _finished

    run_dir = out / "lr1e-3" / "seed0"
    same = _command(
        "configs/cpu_tiny.yaml", run_dir, [*SMALL, "actor_rollout_ref.actor.optim.lr=1e-3", "agl_lab.seed=0"], 1
    )
    assert _finished(run_dir, same) and not _finished(run_dir, [*same, "trainer.test_freq=1"])
