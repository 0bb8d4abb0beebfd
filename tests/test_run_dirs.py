"""A run directory holds one run (agl_lab.runs): `agl-lab train` refuses to write a second run
into it, a resume never logs a step twice, `finished.json` is written last, and `read_metrics` /
`compare` refuse a log whose steps repeat (issues 49 and 53). Real `train_main`, tiny model."""

from __future__ import annotations

import json

import pytest

from agl_lab import runs
from agl_lab.cli import train_main
from agl_lab.comparison import compare
from agl_lab.logger import read_metrics
from tests.trainer_runs import SMALL


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]


def test_a_log_whose_steps_repeat_is_refused_or_kept_last_with_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("agl_lab:\n  seed: 0\n")
    first = [{"step": 0, "val/reward": 0.1}] + [{"step": s, "training/reward": s / 10} for s in (1, 2, 3)]
    again = [{"step": s, "training/reward": s} for s in (1, 2, 3)]  # a second run appended to the first
    _write(run / "metrics.jsonl", first + again)
    assert runs.repeated_steps(first + again) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"logs step\(s\) 1, 2, 3 more than once .*repeated='keep_last'"):
        read_metrics(run / "metrics.jsonl")
    with pytest.raises(ValueError, match="more than once"):
        compare([run], last=3)
    with pytest.warns(UserWarning, match="kept each step's last copy"):
        kept = read_metrics(run / "metrics.jsonl", repeated="keep_last")
    assert kept == first[:1] + again  # the validation before step 1 is no copy of a training step
    with pytest.warns(UserWarning):
        table = compare([run], last=3, repeated="keep_last")
    assert table["training/reward n"].iloc[0] == 3 and table["training/reward mean"].iloc[0] == 2.0
    # a validation logged beside a training record of the same step shares no metric: no repeat
    assert runs.repeated_steps([{"step": 3, "training/reward": 1.0}, {"step": 3, "val/reward": 0.5}]) == []
    # the finished marker names its command without the key (a run directory may be shared)
    assert runs.public_argv(["c.yaml", "agentlightning.agl_key=s3cret", "a.b=1"]) == [
        "c.yaml",
        "agentlightning.agl_key=<redacted>",
        "a.b=1",
    ]


def _args(tmp_path, run: str, *extra: str) -> list[str]:
    return [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / run),
        *SMALL,
        "trainer.save_freq=1",
        f"trainer.default_local_dir={tmp_path / run / 'checkpoints'}",
        *extra,
    ]


@pytest.mark.timeout(600)
def test_train_refuses_a_directory_holding_a_run_and_resume_logs_each_step_once(tmp_path, capsys):
    run = tmp_path / "a"
    assert train_main(_args(tmp_path, "a", "--until", "1")) == 0
    assert runs.finished(run)["step"] == 1 and _steps(run) == [1]
    capsys.readouterr()

    assert train_main(_args(tmp_path, "a", "--until", "1")) == 2  # a finished run: not appended to
    assert capsys.readouterr().out.strip() == (
        f"agl-lab train: {run} holds a finished run (step 1): resume it with --resume to extend it, "
        "or pick another --run-dir"
    )
    assert _steps(run) == [1]

    assert train_main(_args(tmp_path, "a", "--resume", "--until", "2")) == 0  # extended from its checkpoint
    assert _steps(run) == [1, 2] and runs.finished(run)["step"] == 2

    # a run stopped after two logged steps and no checkpoint: unfinished
    stopped = tmp_path / "b"
    stopped.mkdir()
    _write(stopped / "metrics.jsonl", [{"step": 1, "training/reward": 0.0}, {"step": 2, "training/reward": 0.0}])
    assert runs.run_state(stopped) == "unfinished"
    capsys.readouterr()
    assert train_main(_args(tmp_path, "b", "--until", "1")) == 2
    assert "holds an unfinished run (steps up to 2 logged): continue it with --resume" in capsys.readouterr().out
    assert train_main(_args(tmp_path, "b", "--resume", "--until", "1")) == 0  # nothing to resume: over from 0
    assert "no checkpoint to resume from" in capsys.readouterr().out
    assert _steps(stopped) == [1] and runs.run_state(stopped) == "finished"


def test_a_stop_signal_inside_a_steps_end_waits_for_the_block_to_finish():
    # agl-lab train's SIGTERM handler asks runs.defer_stop: a checkpoint never lands without its log line
    import os
    import signal

    from agl_lab import runs

    class Stopped(Exception):
        pass

    def handler(signum, frame):
        if runs.defer_stop(signum):
            return
        raise Stopped

    previous = signal.signal(signal.SIGUSR1, handler)
    done = []
    try:
        with pytest.raises(Stopped):
            with runs.step_end():
                os.kill(os.getpid(), signal.SIGUSR1)
                for _ in range(1000):  # the handler has run (deferred) by now: nothing raised here
                    done.append(1)
                done.append("logged")
        assert done[-1] == "logged"  # the block finished before the stop
        with pytest.raises(Stopped):  # outside a step's end, the stop is at once
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(10**6):
                pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
