"""AGL/verl config keys the Trainer honours on the local engine, end to end on CPU.

Real tiny model, real gateway, real agents; tasks written to parquet/JSONL files in the test.
"""

from __future__ import annotations

import json

import pytest

from agl_lab.config import ConfigError
from agl_lab.data import load_task_files
from agl_lab.engines.tiny import tiny_model_dir
from agl_lab.trainer import Trainer
from tests.processes import cli_env
from tests.trainer_runs import SMALL, lookup_tasks, write_jsonl, write_parquet

# ---------------------------------------------------------------------------------------------
# data.train_files / val_files
# ---------------------------------------------------------------------------------------------


def test_task_files_load_one_dict_per_row_from_parquet_and_jsonl(tmp_path):
    rows = lookup_tasks(3)
    from_parquet = load_task_files(write_parquet(tmp_path / "t.parquet", rows), "data.train_files")
    from_jsonl = load_task_files([write_jsonl(tmp_path / "t.jsonl", rows)], "data.train_files")
    assert from_parquet == rows == from_jsonl
    assert all(type(r["table"]) is dict for r in from_parquet)  # JSON-native values, as AGL sends them


def test_task_file_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.val_files: task file .*nope\.parquet"):
        load_task_files(str(tmp_path / "nope.parquet"), "data.val_files")
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1"}, {"q": "2+2"}])
    with pytest.raises(KeyError, match=r"data\.train_files: row 1 .* has no column 'question'"):
        load_task_files(path, "data.train_files", ["question"])


def test_env_map_columns_are_required_of_every_task_file_row(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1"}])  # no `result` column
    with pytest.raises(KeyError, match=r"data\.train_files: row 0 .* has no column 'result'"):
        Trainer.from_config(
            "tests/fixtures/agl_calc_x.yaml", [f"data.train_files={path}"], console=False, run_dir=tmp_path / "run"
        )


def test_agent_class_without_tasks_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"agent_class is set but there are no tasks.*data\.train_files"):
        Trainer.from_config(
            "configs/cpu_tiny.yaml",
            [*SMALL, "agentlightning.local.agent_class=pkg.mod:Agent"],
            run_dir=tmp_path / "run",
            console=False,
        )


def test_a_hub_id_as_model_path_is_a_clear_error_naming_the_key(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref\.model\.path='Qwen/Qwen2\.5-1\.5B-Instruct' is not a "
        r"local Hugging Face model directory",
    ):
        Trainer.from_config(
            "configs/cpu_tiny.yaml",
            [*SMALL, "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct"],
            run_dir=tmp_path / "run",
            console=False,
        )


def test_files_model_path_and_unbounded_wait_train_one_step(tmp_path):
    """data.train_files (parquet) + val_files (JSONL) + actor_rollout_ref.model.path (a local HF
    directory) + agl_lab.rollout.wait_timeout_seconds=null, one real step on the local engine."""
    train = write_parquet(tmp_path / "train.parquet", lookup_tasks(8))
    val = write_jsonl(tmp_path / "val.jsonl", lookup_tasks(2, seed=1))
    model_dir = tiny_model_dir(seed=0)
    overrides = [
        *SMALL,
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"actor_rollout_ref.model.path={model_dir}",
        "agl_lab.rollout.wait_timeout_seconds=null",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides, run_dir=tmp_path / "run", console=False) as tr:
        assert len(tr.train_dataset) == 8 and len(tr.val_dataset) == 2
        assert tr.engine.model_name == model_dir.name  # the configured model, not the built-in default
        ro = tr.rollout()
        assert {r.input["data_id"] for r in ro.rollouts} <= {f"row-{i}" for i in range(8)}  # kept intact
        assert len({r.data_id for r in ro.rollouts}) == 4  # one fresh group per task
        u = tr.update(tr.build_batch(ro))
        assert not u.skipped
        assert not [k for k in u.metrics if "*" in k]


# ---------------------------------------------------------------------------------------------
# trainer.test_freq / val_before_train / val_only / val_kwargs.n / logger / perf metrics
# ---------------------------------------------------------------------------------------------


def test_fit_validates_before_every_test_freq_and_after_the_last_step_with_wandb_offline(tmp_path):
    overrides = [
        *SMALL,
        "trainer.total_training_steps=3",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "trainer.logger=[console,wandb]",
        "agl_lab.wandb.mode=offline",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides, run_dir=tmp_path / "run", console=False) as tr:
        assert tr.metrics_logger.wandb_run is not None  # trainer.logger has wandb → a real offline run
        tr.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # val before train at 0, then 1-based steps
    assert [("val/reward" in r) for r in records] == [True, False, True, True]  # step 2 (freq) and 3 (last)
    assert records[0]["val/n_rollouts"] == 2 * 4  # val_kwargs.n copies of each of the 4 val tasks
    for r in records[1:]:
        assert r["perf/total_num_tokens"] > 0 and r["perf/time_per_step"] == r["timing_s/step"]
        assert r["perf/throughput"] == pytest.approx(r["perf/total_num_tokens"] / r["timing_s/step"])
        for timer in ("gen", "old_log_prob", "adv", "update_actor", "update_weights", "step"):
            assert f"timing_s/{timer}" in r, timer
    assert "timing_s/validate" in records[2] and "timing_s/validate" not in records[1]
    assert records[0]["timing_s/validate"] > 0  # the validation before training is timed too
    assert (tmp_path / "run" / "config.yaml").exists()  # written at start
    assert list((tmp_path / "run").glob("wandb/offline-run-*"))


def test_val_only_validates_and_trains_nothing(tmp_path):
    overrides = [*SMALL, "trainer.val_only=true", "trainer.val_before_train=false"]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides, run_dir=tmp_path / "run", console=False) as tr:
        history = tr.fit()
        assert tr.engine.policy_version == 0 and tr.global_step == 0
    assert len(history) == 1 and "val/reward" in history[0] and "training/reward" not in history[0]


# ---------------------------------------------------------------------------------------------
# Checkpoints: kill `agl-lab train` after a checkpoint, rerun with --resume
# ---------------------------------------------------------------------------------------------

RESUME_KEYS = (
    "training/reward",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "training/n_sample_trained",
    "training/n_zero_adv_groups",
    "training/policy_version",
)


def _train_cmd(tmp_path, name: str, *extra: str) -> list[str]:
    import sys

    return [
        sys.executable,
        "-m",
        "agl_lab.cli",
        "train",
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / name),
        *SMALL,
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        *extra,
    ]


def _records(path) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(x) for x in path.read_text().splitlines())}  # last per step wins


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three CLI runs; minutes on a loaded 2-core machine
def test_killed_cli_run_resumes_and_continues_like_an_uninterrupted_run(tmp_path):
    import subprocess
    import time

    straight = subprocess.run(
        _train_cmd(tmp_path, "a", f"trainer.default_local_dir={tmp_path / 'ck_a'}"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    expected = _records(tmp_path / "a" / "metrics.jsonl")
    assert sorted(expected) == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "ck_a").glob("global_step_*")) == [
        f"global_step_{i}" for i in range(1, 5)
    ]

    ck = tmp_path / "ck_b"
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "b", f"trainer.default_local_dir={ck}"),
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = ck / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 600
    while not (latest.exists() and int(latest.read_text() or 0) >= 2):
        assert proc.poll() is None, "the run ended before its second checkpoint"
        assert time.time() < deadline
        time.sleep(0.2)
    proc.kill()  # SIGKILL: no clean shutdown, as a crashed or preempted job
    proc.wait()
    at = int(latest.read_text())

    resumed = subprocess.run(
        _train_cmd(tmp_path, "c", f"trainer.default_local_dir={ck}", "--resume"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ck / f'global_step_{at}'} at step {at}" in resumed.stdout
    got = _records(tmp_path / "c" / "metrics.jsonl")
    assert sorted(got) == list(range(at + 1, 5)) and got  # only the steps after the checkpoint
    for step, record in got.items():
        for key in RESUME_KEYS:
            # a step whose rows all have advantage 0 forwards none (the zero-advantage skip) and
            # logs no actor/entropy: the resumed run must lack it on the same steps
            assert (key in record) == (key in expected[step]), (step, key)
            if key in record:
                assert record[key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


# ---------------------------------------------------------------------------------------------
# AGL's calc_x example config, unchanged but for CPU sizes, on the local engine
# ---------------------------------------------------------------------------------------------

# Every metric name AGL v1 logs for calc_x's settings (sync, trajectory level, GRPO, no critic,
# no reference model, rollout correction config present, validation after the last step),
# as its verl trainer, rollout adapter and validation emit them.
AGL_METRICS = [
    # rollout adapter (train) and trajectory level
    "training/reward",
    "training/n_sample",
    "training/n_rollouts",
    "training/n_rollouts_w_trace",
    "training/n_rollouts_w_reward",
    "training/n_truncated_sample",
    "training/n_skipped_empty_rows",
    "training/n_turns",
    "response_length/training/avg_by_turn",
    "response_length/training/max_by_turn",
    "response_length/training/min_by_turn",
    "training/n_unmerged_rollouts",
    "training/n_trace_merge_mismatch_rows",
    # validation
    "val/reward",
    "val/n_rollouts",
    "val/n_rollouts_w_trace",
    "val/n_rollouts_w_reward",
    "val/mean_response_length_per_turn",
    "val/mean_total_response_length_per_rollout",
    "val/turn_count",
    # trainer
    "timing/step_start_wall",
    "timing/rollout_phase_end_wall",
    "training/n_sample_collected",
    "training/n_sample_dropped/marked",
    "training/n_sample_dropped/same_reward",
    "training/n_sample_dropped/random",
    "training/n_sample_trained",
    "training/n_groups",
    "training/n_zero_adv_groups",
    "critic/n_transition_after_dropping",
    # lifecycle
    *[
        f"timing/{p}/{s}"
        for p in ("rollout_queue_wait_s", "rollout_run_duration_s", "rollout_total_s")
        for s in ("mean", "p50", "p90", "max")
    ],
    "timing/rollout_n_missing_running_ts",
    # rollout-level advantage, loss
    "training/rollout_level_advantage/n_rows",
    "training/rollout_level_advantage/n_rollouts",
    "training/rollout_level_advantage/n_multi_row_rollouts",
    "training/rollout_level_advantage/max_rows_per_rollout",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    # inherited from verl
    *[f"critic/{k}/{s}" for k in ("score", "rewards", "advantages", "returns") for s in ("mean", "max", "min")],
    *[f"{k}/{s}" for k in ("response_length", "prompt_length") for s in ("mean", "max", "min", "clip_ratio")],
    *[
        f"timing_s/{t}"
        for t in ("step", "gen", "old_log_prob", "adv", "update_actor", "update_weights", "validate", "save_checkpoint")
    ],
    "perf/total_num_tokens",
    "perf/time_per_step",
    "perf/throughput",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/lr",
]
# What only verl engines add (computed inside verl's FSDP workers / GPU profiling), for the record.
VERL_ONLY = [
    "perf/mfu/actor_infer",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "perf/max_memory_reserved_gb",
    "perf/cpu_memory_used_gb",
    "timing_per_token_ms/*",
]


def calc_x_rows(n: int, seed: int) -> list[dict]:
    """calc_x's parquet schema: {id, question, chain, result, source}."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "id": f"calc-{seed}-{i}",
                "question": f"What is {a} + {b}?",
                "chain": f"{a} + {b} = {a + b}",
                "result": str(a + b),
                "source": "test",
            }
        )
    return rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_agl_calc_x_config_trains_two_steps_and_logs_every_agl_metric(tmp_path):
    train = write_parquet(tmp_path / "train.parquet", calc_x_rows(8, 0))
    val = write_parquet(tmp_path / "test.parquet", calc_x_rows(2, 1))
    template = tmp_path / "job-template.yaml"
    template.write_text("kind: Job\n")
    overrides = [
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"actor_rollout_ref.model.path={tiny_model_dir(seed=0)}",  # a local HF dir, not a hub id
        "agentlightning.local.agent_class=tests.agents_for_tests:CalcXAgent",  # the example's agent is not here
        f"agentlightning.k8s.job_template_path={template}",
        # CPU sizes: 2 tasks × n=4 per step, one mini-batch; 2 steps; rows padded to 256 + 256
        # tokens instead of calc_x's 2048 + 8192 (AGL pads every row to the limits)
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=256",
        "agentlightning.trace_aggregator.trajectory_max_response_length=256",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]
    with Trainer.from_config(
        "tests/fixtures/agl_calc_x.yaml", overrides, run_dir=tmp_path / "run", console=False
    ) as tr:
        assert tr.runner is not None and tr.task is None
        tr.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    logged = set().union(*records)
    missing = [m for m in AGL_METRICS if m not in logged]
    assert not missing, missing
    assert any(k.startswith("rollout_corr/") for k in logged)  # AGL computes them whenever logprobs exist
    assert (tmp_path / "ckpt" / "global_step_2" / "trainer_state.pt").exists()  # save_freq=64: also the last step


# ---------------------------------------------------------------------------------------------
# agl_lab.server: the embedded server's limits
# ---------------------------------------------------------------------------------------------


def test_server_limits_reach_the_embedded_server(tmp_path):
    """agl_lab.server.{lease_seconds, max_body_bytes, upstream_*} configure the real server."""
    import httpx

    trainer = Trainer.from_config(
        None,
        [
            *SMALL,
            "agl_lab.server.lease_seconds=42",
            "agl_lab.server.max_body_bytes=200000",
            "agl_lab.server.max_attempts=5",
            "agl_lab.server.upstream_max_attempts=2",
        ],
        console=False,
        run_dir=str(tmp_path / "run"),
    )
    with trainer:
        config = trainer.server.config
        assert (config.lease_seconds, config.max_body_bytes, config.upstream_max_attempts) == (42, 200_000, 2)
        assert config.upstream_timeout_seconds == 300 and config.max_attempts == 5  # unset: the server's default
        big = [{"input": {"text": "x" * 300_000}}]
        r = httpx.post(f"{trainer.base_url}/api/rollouts", json=big, headers={"Authorization": f"Bearer {trainer.key}"})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
        assert len(trainer.rollout().rollouts) == 8  # the run itself is unaffected
