"""A recording that cannot be written never kills training nor leaves a hole in metrics.jsonl
(issue 41, finding 5): a warning, the `recording/failed` metric, no `.tmp` left; `--resume`
afterwards leaves metrics, checkpoints and recordings consistent.

Real Trainer (tiny model, gateway, runner, checkpoints); the failure is real: the recording's
final path is taken by a directory, so the write of its `.tmp` succeeds and the rename fails.
"""

from __future__ import annotations

import json
import logging

import pytest

from agl_lab.recording import DIRNAME, recorded_steps, step_path
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


def _logged(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_a_recording_that_cannot_be_written_is_a_warning_and_resume_stays_consistent(tmp_path, caplog):
    run, ck = tmp_path / "run", tmp_path / "ck"
    overrides = [*SMALL, "trainer.save_freq=1", f"trainer.default_local_dir={ck}"]
    step_path(run, 2).mkdir(parents=True)  # step 2's recording cannot land
    with caplog.at_level(logging.WARNING, logger="agl_lab.recording"):
        with Trainer.from_config(
            "configs/cpu_tiny.yaml", [*overrides, "trainer.total_training_steps=3"], run_dir=run, console=False
        ) as tr:
            tr.fit()
    assert [r["step"] for r in _logged(run)] == [1, 2, 3]  # no hole
    assert [r["recording/failed"] for r in _logged(run)] == [0.0, 1.0, 0.0]
    assert _logged(run)[1]["recording/bytes"] == 0
    assert any("step_000002.json.gz could not be written" in r.getMessage() for r in caplog.records)
    assert not list((run / DIRNAME).glob(".*.tmp"))  # the partial file is gone
    assert recorded_steps(run) == [1, 3] and (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    step_path(run, 2).rmdir()
    with Trainer.from_config(
        "configs/cpu_tiny.yaml",
        [*overrides, "trainer.total_training_steps=4", "trainer.resume_mode=auto"],
        run_dir=run,
        console=False,
    ) as tr:
        tr.fit()
    assert [r["step"] for r in _logged(run)] == [1, 2, 3, 4]
    assert recorded_steps(run) == [1, 3, 4] and (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
