"""Re-create the replay cassette in tests/fixtures/cassette/: a short recorded run of the demo.

    python scripts/make_cassette.py

Runs `agl-lab train configs/cpu_tiny.yaml` for 2 steps on a small batch (4 lookup tasks × 4
rollouts, so a step has zero-advantage groups and alignment drops to replay) and keeps what a
replay reads: `config.yaml`, `metrics.jsonl` and `recording/`. tests/test_replay.py replays
each step against the numbers recorded here, so a change to batch building or the algorithms
that moves any of them fails with the diff. Re-run this script when such a change is meant.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASSETTE = ROOT / "tests" / "fixtures" / "cassette"
OVERRIDES = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=3",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.logger=[console]",
    "agl_lab.task.n_val=0",
    "trainer.experiment_name=cassette",
]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "agl_lab.cli",
            "train",
            "configs/cpu_tiny.yaml",
            "--run-dir",
            str(run),
            "--steps",
            "2",
            *OVERRIDES,
            f"trainer.default_local_dir={tmp}/ckpt",
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
        shutil.rmtree(CASSETTE, ignore_errors=True)
        CASSETTE.mkdir(parents=True)
        for name in ("config.yaml", "metrics.jsonl"):
            shutil.copy(run / name, CASSETTE / name)
        shutil.copytree(run / "recording", CASSETTE / "recording")
    size = sum(p.stat().st_size for p in CASSETTE.rglob("*") if p.is_file())
    print(f"cassette written to {CASSETTE.relative_to(ROOT)} ({size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
