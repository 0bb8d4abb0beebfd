"""Beyond one machine, all of it together on this one (docs/many-machines.md): a PostgreSQL store,
two `agl-lab serve` processes sharing it, three `agl-lab runner` processes spread across the two
servers (the first dies by SIGKILL while it holds rollouts), and `agl-lab train` with
`agl_lab.server.embedded=false` pointed at one of the servers.

Checked from the run's outputs (metrics.jsonl, run_dir/recording, the store read through the
*other* server's API): no rollout lost or duplicated — every rollout the trainer created
reached a terminal state exactly once and each step trained each of its rollouts once; the
killed runner's rollouts ran again as attempt "1" and were trained once; the run exits 0.

Real processes, real HTTP on loopback, a real PostgreSQL (tests/postgres.py), the tiny model.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from agl_lab.client import AglClient
from tests.conftest import scaled
from tests.processes import free_port, healthy, spawn_cli, stop_groups, wait_for
from tests.trainer_runs import SMALL, read_recording

ROOT = Path(__file__).resolve().parents[1]
KEY = "many-machines-key"
STEPS = 3
LEASE_SECONDS = scaled(8)  # the killed runner's rollouts run again within the step; long enough that a survivor
# stalled on this crowded host (trainer, 2 servers, PostgreSQL, 3 runners on 2 cores) keeps its claims (a tenth of it a beat)
ROLLOUTS_PER_STEP = 4 * 2  # data.train_batch_size=4 × actor_rollout_ref.rollout.n=2 (SMALL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_servers_on_postgresql_three_runners_one_killed_and_train_lose_nothing(postgres_database, tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    run_dir = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def spawn(name: str, argv: list[str], **env: str) -> subprocess.Popen:
        logs.append(tmp_path / f"{name}.log")
        procs.append(spawn_cli(argv, logs[-1], **env))
        return procs[-1]

    try:
        # --- two servers on one PostgreSQL database (the model name and temperature the engine uses)
        for i, url in enumerate(urls):
            spawn(
                f"serve{i}",
                [
                    "serve",
                    "--port",
                    url.rsplit(":", 1)[1],
                    "--key",
                    KEY,
                    "--store",
                    postgres_database,
                    "--model-name",
                    "agl-lab-tiny",
                    "--train-temperature",
                    "1.0",
                    "--lease-seconds",
                    str(LEASE_SECONDS),
                    "--max-attempts",
                    "3",
                ],
            )
        wait_for(lambda: all(healthy(u) for u in urls), 120, "both servers", procs, logs)

        # --- the doomed runner on server 0, alone at first: kill -9 (by itself, so it surely holds
        # rollouts) as its 3rd rollout starts; with concurrency 2 it holds that one and whichever
        # other was still in flight
        doomed = spawn(
            "runner_doomed",
            [
                "runner",
                "configs/cpu_tiny.yaml",
                "--server",
                urls[0],
                "--key",
                KEY,
                "--agent",
                "tests.agents_for_tests:killed_lookup_agent",
                "--concurrency",
                "2",
                "--poll-interval",
                "0.05",
            ],
            AGL_TEST_KILL_AT_ROLLOUT="3",
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
                f"agentlightning.agl_base_url={urls[0]}",
                f"agentlightning.agl_key={KEY}",
                "agl_lab.runner.enabled=false",
            ],
        )
        wait_for(lambda: doomed.poll() is not None, 300, "the doomed runner to die", [trainer], [logs[-1]])
        assert doomed.returncode == -signal.SIGKILL, logs[2].read_text()[-3000:]
        # --- the lease expires on the servers' sweepers: the rollouts it held go back to the queue
        # (seen through the other server), still at attempt "0", their next claim attempt "1"
        with AglClient(urls[1], key=KEY) as client:

            def requeued() -> list:
                return [
                    r for r in client.list_rollouts(["queuing"]) if "lease expired" in (r.status.error_message or "")
                ]

            # nothing else runs rollouts yet: once none is running, the re-queued ones are all it held
            wait_for(
                lambda: not client.list_rollouts(["running"]) and requeued(),
                60,
                "the killed runner's rollouts to be re-queued",
                [trainer],
                [logs[-1]],
            )
            held = sorted(r.rollout_id for r in requeued())
            assert 1 <= len(held) <= 2 and all(
                r.status.last_attempt_id == "0" and "re-queued as attempt 1" in r.status.error_message
                for r in requeued()
            )
        # --- the two survivors, one on each server
        spawn("runner_a", ["runner", "configs/cpu_tiny.yaml", "--server", urls[0], "--key", KEY, "--concurrency", "4"])
        spawn("runner_b", ["runner", "configs/cpu_tiny.yaml", "--server", urls[1], "--key", KEY, "--concurrency", "4"])
        wait_for(
            lambda: trainer.poll() is not None,
            420,
            "the training to finish",
            [p for p in procs if p is not trainer and p is not doomed],
            [lg for p, lg in zip(procs, logs) if p is not trainer and p is not doomed],
        )
        train_log = logs[3].read_text()
        assert trainer.returncode == 0, train_log[-4000:]

        # --- the store, read through the server the trainer did not talk to: the trainer deletes each
        # rollout once it has read it in full, and the terminal log counts every terminal transition
        with AglClient(urls[1], key=KEY) as client:
            left = client.list_rollouts(["queuing", "running", "succeeded", "failed"])
            n_terminal = client.terminal_page(0).total_terminal
    finally:
        stop_groups(procs, 30)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = {m["step"]: m for m in metrics if "training/n_rerun_rollouts" in m}
    assert sorted(train_records) == list(range(1, STEPS + 1)), metrics
    recording = read_recording(run_dir)
    assert sorted(recording) == list(range(1, STEPS + 1))

    # no rollout lost or duplicated: STEPS × 8 rollouts (the database was empty before), none left
    # queuing or running, STEPS × 8 terminal transitions in the store, STEPS × 8 distinct ones trained
    assert left == [], [(r.rollout_id, r.status) for r in left]
    assert n_terminal == STEPS * ROLLOUTS_PER_STEP
    ids = [c["rollout_id"] for doc in recording.values() for c in doc["rollouts"]]
    assert len(ids) == len(set(ids)) == STEPS * ROLLOUTS_PER_STEP
    # each step trained each of its own rollouts once (sync: no carry-over), all succeeded
    for step, doc in recording.items():
        assert len(doc["rollouts"]) == ROLLOUTS_PER_STEP and {c["step"] for c in doc["rollouts"]} == {step - 1}
        assert all(c["state"] == "succeeded" for c in doc["rollouts"])

    # the killed runner's rollouts ran again as attempt "1" (status.last_attempt_id when the
    # trainer read them: metadata.attempt_id) and were trained once, from attempt 1's events only
    rollouts = {c["rollout_id"]: c for doc in recording.values() for c in doc["rollouts"]}
    rerun = sorted(rid for rid, c in rollouts.items() if c["metadata"].get("attempt_id") == "1")
    assert rerun == held
    assert all("attempt_id" not in c["metadata"] for rid, c in rollouts.items() if rid not in held)
    for rid in held:
        assert rollouts[rid]["events"] and {e["attempt_id"] for e in rollouts[rid]["events"]} == {"1"}
        assert rollouts[rid]["triplets"]
    assert sum(m["training/n_rerun_rollouts"] for m in train_records.values()) == len(held)
    assert all(m["training/n_failed_rollouts"] == 0 for m in train_records.values())
    assert "Traceback" not in train_log, train_log[-4000:]

    # the killed runner finished 1 or 2 rollouts (it started 3 or 4); the survivors, one on
    # each server, ran all the rest (the re-runs included) and stopped cleanly on SIGTERM
    survivors = [(tmp_path / f"{name}.log").read_text() for name in ("runner_a", "runner_b")]
    assert all(p.returncode == 0 for p in procs[4:]), survivors
    done = [int(text.split("stopped (SIGTERM): ")[1].split(" done")[0]) for text in survivors]
    assert 1 <= STEPS * ROLLOUTS_PER_STEP - sum(done) <= 2, (done, survivors)
    # both ran some: server 1 served the engine the trainer registered through server 0 (the
    # model registry is in PostgreSQL); 8 rollouts a step, at most 4 at once on each runner
    assert all(d > 0 and "0 failed" in text for d, text in zip(done, survivors)), survivors
