"""What `fit` leaves on disk as it goes, with the tiny model training for real: the validation and
training curve at `trainer.test_freq` (metrics.jsonl, reward_curve.png), verl's TensorBoard scalars
(`trainer.logger: [console, tensorboard]`) and checkpoint retention (`trainer.max_actor_ckpt_to_keep`),
for a fit interrupted mid-way and resumed."""

from __future__ import annotations

import pytest

from agl_lab.logger import read_metrics
from agl_lab.trainer import Trainer
from agl_lab.viz import plot_run_metrics
from tests.trainer_runs import SMALL


def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(900)
def test_an_interrupted_fit_has_written_its_validation_points_scalars_and_newest_checkpoints(tmp_path, monkeypatch):
    tb_dir, ckpt, run = tmp_path / "tb", tmp_path / "ckpt", tmp_path / "run"
    monkeypatch.setenv("TENSORBOARD_DIR", str(tb_dir))  # verl's rule: $TENSORBOARD_DIR, else tensorboard_log/…
    overrides = [
        *SMALL,
        "trainer.total_training_steps=6",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        f"trainer.default_local_dir={ckpt}",
        "trainer.logger=[console,tensorboard]",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=run, console=False) as t:
        update = t.update

        def interrupted_update(batch=None, **kw):  # Ctrl-C during the 5th step's update
            if t.global_step == 4:
                raise KeyboardInterrupt
            return update(batch, **kw)

        t.update = interrupted_update
        with pytest.raises(KeyboardInterrupt):
            t.fit(progress=False)
        # (the Trainer is still open: the sinks have flushed what they wrote)
        t.metrics_logger.close()

    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    val = {r["step"]: r["val/reward"] for r in records if "val/reward" in r}
    assert sorted(val) == [2, 4]  # at test_freq, as the fit went
    # the curve on disk is the one of steps 1–4 with both validation points (drawn when step 4 logged)
    import pandas as pd

    redrawn = plot_run_metrics(pd.DataFrame(records).groupby("step").last(), tmp_path / "redrawn.png")
    assert (run / "reward_curve.png").read_bytes() == redrawn.read_bytes()

    scalars = _scalars(tb_dir)  # verl's tag names: the metric keys themselves
    assert sorted(scalars["training/reward"]) == [1, 2, 3, 4]
    assert scalars["val/reward"] == pytest.approx(val)
    assert scalars["training/reward"][3] == pytest.approx(records[2]["training/reward"])
    assert "actor/pg_loss" in scalars and "timing_s/step" in scalars

    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_3", "global_step_4"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"

    # resume: from the newest (step 4); the resumed process prunes only what it saved itself, as verl's
    # checkpoint manager does (its list of saved paths starts empty in each process): 3 and 4 stay
    with Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=[*overrides, "trainer.logger=[console]"], run_dir=run, console=False
    ) as t:
        t.fit(progress=False)
        assert t.global_step == 6 and list(t.metrics.index) == [5, 6]  # resumed from global_step_4
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == [
        "global_step_3",
        "global_step_4",
        "global_step_5",
        "global_step_6",
    ]


def test_an_unknown_logger_fails_at_load_naming_the_key_and_the_accepted_values():
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.logger has \['mlflow'\].*\['console', 'wandb', 'tensorboard'\]"):
        load_config("configs/cpu_tiny.yaml", ["trainer.logger=[console,mlflow]"])
