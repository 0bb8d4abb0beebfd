"""`agl-lab train`: Ctrl-C ends cleanly with the resume line; `--steps` / `--until` with `--resume`.

Real command (a subprocess for Ctrl-C, `train_main` in process otherwise), real tiny model,
gateway, runner, checkpoints.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from agl_lab.cli import train_main
from tests.conftest import scaled
from tests.processes import cli_env
from tests.trainer_runs import SMALL


def _args(tmp_path, run: str, *extra: str) -> list[str]:
    return [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / run),
        *SMALL,
        "trainer.save_freq=1",
        f"trainer.default_local_dir={tmp_path / 'ck'}",
        *extra,
    ]


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.timeout(600)
def test_ctrl_c_prints_the_last_checkpoint_and_the_resume_command_without_a_traceback(tmp_path):
    args = _args(tmp_path, "run", "trainer.total_training_steps=200")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agl_lab.cli", "train", *args],
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Critical: a suite started in the background (`cmd &`, nohup, some CI runners) inherits
        # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the Ctrl-C below
        # would be ignored and the run would train to the end. A terminal's child has it default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    out, err = proc.communicate(timeout=scaled(300))  # the step in progress ends first: loaded, > 120 s
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    at = int((tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text())
    assert at >= 2
    assert f"last checkpoint: step {at} ({tmp_path / 'ck' / f'global_step_{at}'}) — resume with: agl-lab train " in out
    resume_line = out.split("resume with: ")[1].splitlines()[0]
    assert resume_line.endswith(" --resume") and "trainer.total_training_steps=200" in resume_line
    assert "reward curve: " + str(tmp_path / "run" / "reward_curve.png") in out
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.timeout(600)
def test_sigterm_stops_like_ctrl_c_and_leaves_no_agent_subprocess_alive(tmp_path):
    """SIGTERM (Slurm, Kubernetes, docker stop, systemd) to `agl-lab train`: the agents' process
    groups (each agent leads its own session) are terminated, the resume line printed, exit 143."""
    from agl_lab.engines.tiny import tiny_model_dir
    from tests.trainer_runs import lookup_tasks, write_parquet

    pids = tmp_path / "pids"
    pids.mkdir()
    train = write_parquet(tmp_path / "train.parquet", lookup_tasks(8))
    args = _args(
        tmp_path,
        "run",
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={tiny_model_dir(seed=0)}",
        "agentlightning.local.agent_class=tests.agents_for_tests:PidFileHangAgent",
    )
    log_out, log_err = tmp_path / "out.txt", tmp_path / "err.txt"  # files: an orphan holding a pipe would block
    with log_out.open("w") as fo, log_err.open("w") as fe:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agl_lab.cli", "train", *args],
            env={**cli_env(), "T_PID_DIR": str(pids)},
            stdout=fo,
            stderr=fe,
            text=True,
        )
    deadline = time.time() + 400
    while len(list(pids.iterdir())) < 4:  # two agents (agent + tool each) at least
        assert proc.poll() is None, log_err.read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    out, err = log_out.read_text(), log_err.read_text()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert "terminated (SIGTERM) after" in out
    assert f"last checkpoint: none under {tmp_path / 'ck'}" in out  # the agents hang: no step ended
    started = [int(p.name) for p in pids.iterdir()]
    deadline = time.time() + 30  # reaped by init once their parent is gone
    while any(_alive(pid) for pid in started) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if _alive(pid)], "agent subprocesses outlived the trainer"


@pytest.mark.timeout(600)
def test_steps_after_resume_means_more_steps_and_until_means_up_to_that_step(tmp_path, capsys):
    assert train_main(_args(tmp_path, "a", "--until", "2")) == 0
    assert _steps(tmp_path / "a" / "metrics.jsonl") == [1, 2]
    capsys.readouterr()

    assert train_main(_args(tmp_path, "b", "--resume", "--steps", "1")) == 0  # 1 more: step 3
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out and "agl-lab train: steps 3–3" in out
    assert _steps(tmp_path / "b" / "metrics.jsonl") == [3]

    assert train_main(_args(tmp_path, "c", "--resume", "--until", "3")) == 0  # already there
    assert "already at step 3 (≥ 3): nothing to train" in capsys.readouterr().out
    assert not (tmp_path / "c" / "metrics.jsonl").exists() or not _steps(tmp_path / "c" / "metrics.jsonl")

    assert train_main(_args(tmp_path, "d", "--resume", "--until", "4")) == 0
    assert _steps(tmp_path / "d" / "metrics.jsonl") == [4]


def test_steps_and_until_are_exclusive_and_not_negative(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_main(_args(tmp_path, "x", "--steps", "1", "--until", "2"))
    assert "not allowed with argument" in capsys.readouterr().err
    assert train_main(_args(tmp_path, "x", "--until", "-1")) == 2
    assert "--until must be >= 0" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_a_named_run_dir_holds_its_own_checkpoints_so_a_second_seed_starts_fresh(tmp_path, capsys):
    """With `trainer.default_local_dir` left at verl's shared default, `--run-dir` puts the
    checkpoints in `<run_dir>/checkpoints`: a second seed's fresh run dir does not auto-resume from
    the first seed's checkpoint, and `--resume` into the first run dir finds its own."""

    def args(run: str, *extra: str) -> list[str]:
        return ["configs/cpu_tiny.yaml", "--run-dir", str(tmp_path / run), *SMALL, "trainer.save_freq=1", *extra]

    assert train_main(args("seed0", "agl_lab.seed=0", "--until", "2")) == 0
    out = capsys.readouterr().out
    assert f"agl-lab train: checkpoints {tmp_path / 'seed0' / 'checkpoints'}" in out
    assert (tmp_path / "seed0" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    saved = (tmp_path / "seed0" / "config.yaml").read_text()
    assert f"default_local_dir: {tmp_path / 'seed0' / 'checkpoints'}" in saved  # what `agl-lab eval RUN_DIR` reads

    assert train_main(args("seed1", "agl_lab.seed=1", "--until", "1")) == 0
    assert "resumed from" not in capsys.readouterr().out
    assert _steps(tmp_path / "seed1" / "metrics.jsonl") == [1]
    assert (tmp_path / "seed1" / "checkpoints" / "global_step_1").is_dir()

    assert train_main(args("seed0", "agl_lab.seed=0", "--resume", "--until", "3")) == 0
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'seed0' / 'checkpoints' / 'global_step_2'}" in out
    assert _steps(tmp_path / "seed0" / "metrics.jsonl") == [1, 2, 3]
