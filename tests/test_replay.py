"""Record and replay: every step of a run is written to run_dir/recording/, and any recorded step
rebuilds — with no engine, server or agent — to the exact numbers the run logged.

The cassette (tests/fixtures/cassette/, made by scripts/make_cassette.py) is a 2-step recording
of the demo; replaying it is a golden test of batch building and the algorithms: a change that
moves any number fails here with the differing metrics.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agl_lab import checkpoints
from agl_lab.config import ConfigError
from agl_lab.recording import Recorder, load_recording, recorded_steps, rng_from_json, step_path
from agl_lab.replay import replay_main, replay_step, what_if

ROOT = Path(__file__).resolve().parents[1]
CASSETTE = Path(__file__).parent / "fixtures" / "cassette"
SMALL = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=3",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.logger=[console]",
    "agl_lab.task.n_val=0",
]


# ---------------------------------------------------------------------------------------------
# The cassette: a golden replay
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 2])
def test_the_cassette_replays_to_the_recorded_numbers(step):
    result = replay_step(CASSETTE, step)
    assert len(result.comparison) > 40  # batch, advantage, selection, group and data metrics
    assert result.differences.empty, f"replay of step {step} moved:\n{result.differences.to_string()}"
    assert result.weights_equal and result.dropped_equal and result.equal
    logged = [json.loads(line) for line in (CASSETTE / "metrics.jsonl").read_text().splitlines()]
    assert {
        k: v for k, v in logged[step - 1].items() if k not in ("step", "recording/bytes")
    } == result.recording.metrics  # the recording holds the step's logged metrics (but its own size)


def test_the_cassette_has_what_a_golden_test_needs():
    """Both steps drop rows (alignment), so selection is exercised, and rewards spread."""
    recordings = [load_recording(CASSETTE, s) for s in recorded_steps(CASSETTE)]
    assert [r.step for r in recordings] == [1, 2] and [r.batch_step for r in recordings] == [0, 1]
    assert all(r.metrics["training/n_sample_dropped/alignment"] > 0 for r in recordings)
    assert all(len(set(r.weights["reward"])) > 1 for r in recordings)
    assert all(len(r.rollouts) == 16 and r.rollouts[0].events for r in recordings)


def test_a_moved_number_fails_with_the_diff(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(CASSETTE, run)
    path = step_path(run, 1)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    doc["metrics"]["training/reward"] += 1e-9  # what a change to the reward aggregation would do
    doc["weights"][0]["loss_weight"] *= 2
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    result = replay_step(run, 1)
    assert not result.equal and not result.weights_equal
    assert list(result.differences["metric"]) == ["training/reward"]


# ---------------------------------------------------------------------------------------------
# What if
# ---------------------------------------------------------------------------------------------


def test_what_if_the_step_had_run_at_transition_level(tmp_path):
    diff = what_if(CASSETTE, 1, ["agentlightning.trace_aggregator.level=transition"])
    moved = diff.metrics.set_index("metric")
    base_rows, alt_rows = moved.loc["training/n_sample", ["base", "alt"]]
    assert alt_rows > base_rows  # a multi-call rollout is one row merged, one row per call otherwise
    assert moved.loc["training/n_sample", "delta"] == alt_rows - base_rows
    w = diff.weights
    assert {"rollout_id", "share_base", "share_alt", "share_delta", "reward_base", "reward_alt"} <= set(w.columns)
    assert w["share_base"].sum() == pytest.approx(1.0) and w["share_alt"].sum() == pytest.approx(1.0)
    assert set(diff.dropped["dropped_in"]) <= {"base", "alt"}
    png = diff.plot(tmp_path / "what_if.png")
    assert png.exists() and png.stat().st_size > 5000


def test_what_if_with_the_same_settings_moves_nothing():
    diff = what_if(CASSETTE, 2, ["agl_lab.algorithm.normalize_by=rollouts"])  # the recorded value
    assert diff.metrics.empty and diff.dropped.empty and (diff.weights["share_delta"] == 0).all()


def test_what_if_under_the_agl_drop_order_drops_other_rollouts():
    diff = what_if(CASSETTE, 1, ["agl_lab.parity.drop_order=agl"])
    assert not diff.metrics.empty  # AGL v1 aligns rows before the advantages: another selection


CANNOT_REPLAY = [
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.rollout.temperature=0.2",
    "actor_rollout_ref.actor.optim.lr=1e-3",
]


def test_what_if_refuses_keys_a_replay_cannot_rerun_in_one_line(capsys):
    """#53 item 10: a sampling, model or optimiser key printed "no metric moved", exit 0."""
    with pytest.raises(ValueError, match=r"cannot re-run actor_rollout_ref\.actor\.clip_ratio:"):
        what_if(CASSETTE, 1, ["agl_lab.parity.drop_order=agl", "actor_rollout_ref.actor.clip_ratio=0.1"])
    with pytest.raises(ValueError, match=r"cannot re-run agl_lab\.seed:"):
        replay_step(CASSETTE, 1, ["+agl_lab.seed=3"])
    assert replay_main([str(CASSETTE), "--step", "1", *CANNOT_REPLAY]) == 2
    out = capsys.readouterr().out
    keys = ", ".join(o.split("=")[0] for o in CANNOT_REPLAY)
    assert out.count("\n") == 1 and out.startswith(f"agl-lab replay: a replay cannot re-run {keys}: "), out
    assert "agl_lab.algorithm.normalize_by" in out and "no metric moved" not in out


def test_every_replayable_key_reaches_the_batch_or_the_update_options():
    """`REPLAYABLE` cannot name a key the replay ignores: changing any one of them changes what
    `batch_options` (at the run's level or at transition level) or `update_options` hand on."""
    from omegaconf import OmegaConf

    from agl_lab.config import batch_options, load_saved_config, update_options
    from agl_lab.replay import REPLAYABLE

    def options(cfg):
        return [batch_options(cfg), batch_options(cfg, "transition"), update_options(cfg)]  # the level, or data.*

    cfg = load_saved_config(CASSETTE / "config.yaml")
    for key in REPLAYABLE:
        value = OmegaConf.select(cfg, key, default="<missing>")
        assert value != "<missing>", f"{key} is not a config key"
        other = cfg.copy()
        changed = not value if isinstance(value, bool) else "other" if isinstance(value, str) else (value or 0) + 1
        OmegaConf.update(other, key, changed)
        assert options(other) != options(cfg), f"{key} changes neither the batch nor the update options"


# ---------------------------------------------------------------------------------------------
# Recording during training, and the CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    from agl_lab.trainer import Trainer

    run = tmp_path_factory.mktemp("rec") / "run"
    trainer = Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=[*SMALL, "agl_lab.record.max_steps=2"], run_dir=run, console=False
    )
    try:
        history = [trainer.step() for _ in range(3)]
    finally:
        trainer.close()
    return run, history


def test_training_records_every_step_and_replays_it_exactly(recorded_run):
    run, history = recorded_run
    assert recorded_steps(run) == [2, 3]  # max_steps=2 keeps the newest two
    for step in (2, 3):
        rec = load_recording(run, step)
        assert history[step - 1]["recording/bytes"] == step_path(run, step).stat().st_size > 0
        assert rec.policy_version == step - 1  # the weights that served this step's calls
        result = replay_step(run, step)
        assert result.equal, result.differences


def test_the_update_replays_on_the_engine_from_the_checkpoint_before(tmp_path):
    from agl_lab.replay import replay_update
    from agl_lab.trainer import Trainer

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    with Trainer.from_config(
        "configs/cpu_tiny.yaml",
        run_dir=run,
        console=False,
        overrides=[*SMALL, "trainer.save_freq=1", f"trainer.default_local_dir={ckpt}"],
    ) as t:
        t.step(), t.step()
    again = replay_update(run, 2)
    assert again.replay.equal
    pg = again.losses.set_index("metric").loc["actor/pg_loss"]
    assert pg["abs_diff"] <= 1e-6 * max(1.0, abs(pg["recorded"]))
    change = again.param_change
    assert change["replayed_norm"] > 0 and change["recorded_norm"] > 0
    assert change["relative_gap"] < 1e-5, change  # the same update, to float32 noise
    shutil.rmtree(ckpt / "global_step_1")
    with pytest.raises(FileNotFoundError, match=r"needs the checkpoint of step 1 .*save_freq=1"):
        replay_update(run, 2)


def test_each_validation_records_its_rollouts_in_task_order(tmp_path):
    from agl_lab.replay import load_validation, validated_steps
    from agl_lab.trainer import Trainer

    run = tmp_path / "run"
    overrides = [*SMALL, "trainer.val_before_train=true", "trainer.test_freq=1", "agl_lab.task.n_val=4"]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=run, console=False) as t:
        history = t.fit(steps=1, progress=False)
        val_ids = [task["task_id"] for task in t.val_dataset]
    assert validated_steps(run) == [0, 1]
    for step, logged in ((0, history[0]), (1, history[1])):
        rollouts = load_validation(run, step)
        assert [r.input["task_id"] for r in rollouts] == val_ids  # the same tasks before and after
        assert all(r.triplets and r.triplets[0].response_ids for r in rollouts)
        mean = sum(r.final_reward for r in rollouts) / len(rollouts)
        assert mean == pytest.approx(logged["val/reward"])
    assert Recorder(run, {}).drop_after(0) == 1 and validated_steps(run) == [0]  # a resume redoes step 1
    with pytest.raises(FileNotFoundError, match=r"no validation recorded at step 5 .*recorded: \[0\]"):
        load_validation(run, 5)


def test_recording_off_and_without_events(tmp_path):
    off = Recorder(tmp_path / "a", {"enabled": False})
    assert (
        off.record(
            1,
            batch_step=0,
            rollouts=[],
            metrics={},
            update=None,
            policy_version=0,
            seed=0,
            rng=checkpoints.rng_state(),
            pad_token_id=0,
        )
        == 0
    )
    assert not (tmp_path / "a").exists()
    rec = load_recording(CASSETTE, 1)
    from agl_lab.results import UpdateResult

    update = UpdateResult(step=0, metrics={}, weights=rec.weights, dropped=rec.dropped)
    lean = Recorder(tmp_path / "b", {"events": False})
    size = lean.record(
        1,
        batch_step=0,
        rollouts=rec.rollouts,
        metrics=rec.metrics,
        update=update,
        policy_version=0,
        seed=0,
        rng=checkpoints.rng_state(),
        pad_token_id=rec.pad_token_id,
    )
    assert 0 < size < step_path(CASSETTE, 1).stat().st_size
    assert all(r.events == [] and r.triplets for r in load_recording(tmp_path / "b", 1).rollouts)


def test_a_resume_drops_the_recordings_of_the_steps_it_redoes(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(CASSETTE, run)
    assert Recorder(run, {}).drop_after(1) == 1 and recorded_steps(run) == [1]
    assert Recorder(run, {}).drop_after(1) == 0


@pytest.mark.parametrize("bad", [0, -1, "ten", True, 1.5])
def test_a_bad_max_steps_fails_at_load_naming_the_key(bad):
    from agl_lab.config import load_config

    with pytest.raises(ConfigError, match=r"agl_lab\.record\.max_steps (must be an integer|must be > 0), got"):
        load_config("configs/cpu_tiny.yaml", {"agl_lab": {"record": {"max_steps": bad}}})


def test_rng_states_round_trip_through_json():
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    state = checkpoints.rng_state()
    from agl_lab.recording import _rng_to_json

    doc = json.loads(json.dumps(_rng_to_json(state)))
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoints.set_rng_state(rng_from_json(doc))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_cli_replays_and_names_what_is_recorded(capsys):
    assert replay_main([str(CASSETTE), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "every engine-independent metric and table equal" in out and "training/reward" in out
    assert replay_main([str(CASSETTE), "--step", "7"]) == 2
    out = capsys.readouterr().out
    assert "no recording of step 7" in out and "recorded steps are 1, 2" in out
    assert replay_main([str(CASSETTE), "agentlightning.trace_aggregator.level=transition"]) == 0
    assert "training/n_sample" in capsys.readouterr().out


def test_replay_imports_neither_verl_nor_ray():
    """`replay_step`, `what_if` and `agl-lab replay` on a recorded run, in a fresh interpreter: the
    batch is agl_lab's BatchData and the estimator agl_lab's, so verl (whose package imports Ray),
    its ray_trainer and Ray stay out of sys.modules — and the replay still equals the recording."""
    code = (
        "import json, sys\n"
        "from agl_lab.cli import main\n"
        "from agl_lab.replay import replay_step, what_if\n"
        f"r = replay_step({str(CASSETTE)!r}, 2)\n"
        f"w = what_if({str(CASSETTE)!r}, 1, ['agentlightning.trace_aggregator.level=transition'])\n"
        f"rc = main(['replay', {str(CASSETTE)!r}, '--step', '1'])\n"
        "mods = ('ray', 'verl', 'verl.protocol', 'verl.trainer.ppo.ray_trainer')\n"
        "print(json.dumps([r.equal, len(w.metrics) > 0, rc, type(r.batch.data).__name__,"
        " [m for m in mods if m in sys.modules]]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, 0, "BatchData", []]


def test_replay_can_build_verls_dataproto():
    """`container="verl"` (replay_update's, for an engine): the same numbers on a DataProto."""
    from verl import DataProto

    r = replay_step(CASSETTE, 2, container="verl")
    assert isinstance(r.batch.data, DataProto) and r.equal
