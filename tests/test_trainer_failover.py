"""The trainer fails over to another server of its ledger (`agentlightning.agl_base_url` listing two
servers): two `agl-lab serve` on one PostgreSQL database, a runner on the second, `agl-lab train`
given both URLs; the first server is killed (SIGKILL) once the first step is trained, and the run
still trains every step, each step's rollouts once, and exits 0.

Real processes, real HTTP on loopback, a real PostgreSQL (tests/postgres.py), the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.processes import free_port, healthy, spawn_cli, stop_groups, wait_for
from tests.trainer_runs import SMALL, read_recording

KEY = "failover-trainer-key"
STEPS = 3
ROLLOUTS_PER_STEP = 4 * 2  # data.train_batch_size=4 × actor_rollout_ref.rollout.n=2 (SMALL)


def _steps_trained(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum("training/n_rerun_rollouts" in line for line in path.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_trainer_fails_over_to_the_second_server_when_its_first_is_killed(postgres_database, tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    run_dir = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        logs.append(tmp_path / f"{name}.log")
        procs.append(spawn_cli(argv, logs[-1]))
        return procs[-1]

    try:
        servers = [
            spawn(
                f"serve{i}",
                ["serve", "--port", url.rsplit(":", 1)[1], "--key", KEY, "--store", postgres_database]
                + ["--model-name", "agl-lab-tiny", "--train-temperature", "1.0", "--lease-seconds", "10"],
            )
            for i, url in enumerate(urls)
        ]
        wait_for(lambda: all(healthy(u) for u in urls), 120, "both servers", procs, logs)
        runner = spawn(
            "runner", ["runner", "configs/cpu_tiny.yaml", "--server", urls[1], "--key", KEY, "--concurrency", "4"]
        )
        trainer = spawn(
            "train",
            [
                "train",
                "configs/cpu_tiny.yaml",
                "--run-dir",
                str(run_dir),
                *SMALL,
                f"trainer.total_training_steps={STEPS}",
                "agl_lab.server.embedded=false",
                f"agentlightning.agl_base_url={urls[0]},{urls[1]}",
                f"agentlightning.agl_key={KEY}",
                "agl_lab.runner.enabled=false",
            ],
        )
        wait_for(lambda: _steps_trained(run_dir) >= 1, 300, "the first step", [trainer, runner], [logs[3], logs[2]])
        os.killpg(servers[0].pid, signal.SIGKILL)  # the trainer's server, while it starts step 2
        servers[0].wait()
        wait_for(lambda: trainer.poll() is not None, 420, "the training to finish", [runner, servers[1]], logs[1:3])
        train_log = logs[3].read_text()
        assert trainer.returncode == 0, train_log[-4000:]
    finally:
        stop_groups(procs, 30)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = {m["step"]: m for m in metrics if "training/n_rerun_rollouts" in m}
    assert sorted(train_records) == list(range(1, STEPS + 1)), metrics
    assert [train_records[s]["execution/server_failovers"] for s in (1, STEPS)] == [0, 1]  # a metric
    recording = read_recording(run_dir)
    ids = [c["rollout_id"] for doc in recording.values() for c in doc["rollouts"]]
    assert len(ids) == len(set(ids)) == STEPS * ROLLOUTS_PER_STEP
    for step, doc in recording.items():
        assert len(doc["rollouts"]) == ROLLOUTS_PER_STEP and {c["step"] for c in doc["rollouts"]} == {step - 1}
        assert all(c["state"] == "succeeded" for c in doc["rollouts"])
    assert "Traceback" not in train_log, train_log[-4000:]
    assert f"failing over to {urls[1]}" in train_log, train_log[-4000:]  # agl_lab.client's warning
