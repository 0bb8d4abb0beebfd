"""agl_lab.sweep / `agl-lab sweep`: a grid × seeds of real `agl-lab train` runs, each in its own
directory named after its setting, then one `compare` table (issue 36)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from agl_lab import runs
from agl_lab.logger import read_metrics
from agl_lab.sweep import (
    _normalise,
    _plan,
    _Pool,
    grid_settings,
    named_settings,
    parse_axes,
    setting_dir,
    sweep,
    sweep_main,
)
from tests.processes import spawn_cli, wait_for
from tests.trainer_runs import SMALL

INVARIANT = "agl_lab.engine_options.batch_invariant=true"


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

    assert (
        json.loads((run_dir := out / "lr1e-3" / "seed0").joinpath("finished.json").read_text())["argv"].count(INVARIANT)
        == 1
    )  # the sweep made the runs batch-invariant (a seed is one run on any load)

    same = _command(
        "configs/cpu_tiny.yaml",
        run_dir,
        [INVARIANT, *SMALL, "actor_rollout_ref.actor.optim.lr=1e-3", "agl_lab.seed=0"],
        1,
    )
    assert _finished(run_dir, same) and not _finished(run_dir, [*same, "trainer.test_freq=1"])


@pytest.mark.parametrize(
    "args, line",
    [
        (["data.train_batch_size="], "data.train_batch_size= has no value: give data.train_batch_size=VALUE"),
        (["actor_rollout_ref.rollout.n=4,"], "actor_rollout_ref.rollout.n=4,: an empty value in the axis"),
        (["=4"], "'=4' names no key"),
        (["actor_rollout_ref.rollout.n=4,8", "--seeds", "0,0"], "--seeds '0,0' repeats seed 0: give each seed once"),
        (["--name", "n4"], "--name 'n4': give NAME:key=value"),
        (["--name", "n4:rollout"], "--name 'n4:rollout': give NAME:key=value"),
        (["a.b=1,2", "--name", "n4:a.b=4"], "give grid axes (a.b) or --name settings, not both"),
    ],
)
def test_a_wrong_grid_is_one_line_naming_the_key_or_flag(tmp_path, capsys, args, line):
    assert sweep_main(["configs/cpu_tiny.yaml", *args, "--out", str(tmp_path / "out")]) == 2
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"agl-lab sweep: {line}") and "\n" not in printed, printed
    assert not (tmp_path / "out").exists()  # nothing ran


def test_named_settings_the_order_and_the_one_setting_name(tmp_path):
    named = named_settings(["n4:actor_rollout_ref.rollout.n=4", "n8:actor_rollout_ref.rollout.n=8", "n8:data.x=4"])
    assert named == {"n4": ["actor_rollout_ref.rollout.n=4"], "n8": ["actor_rollout_ref.rollout.n=8", "data.x=4"]}
    seed_first = [(n, s) for n, s, _ in _plan("c.yaml", named, [0, 1], [], tmp_path)]
    assert seed_first == [("n4", 0), ("n8", 0), ("n4", 1), ("n8", 1)]  # every arm of seed 0 first
    by_setting = [(n, s) for n, s, _ in _plan("c.yaml", named, [0, 1], [], tmp_path, "setting-first")]
    assert by_setting == [("n4", 0), ("n4", 1), ("n8", 0), ("n8", 1)]
    assert _normalise(None, "configs/cpu_tiny.yaml") == {"cpu_tiny": []}  # named like the others, not default/


def _train_processes(marker: str) -> list[int]:
    """Pids of live `agl_lab.cli train` processes whose command line names `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "status").read_text()
        except (OSError, ValueError):
            continue
        text = [part.decode(errors="replace") for part in cmdline]
        if "train" in text and any(marker in part for part in text) and "\nState:\tZ" not in state:
            found.append(int(proc.name))
    return found


@pytest.mark.timeout(900)
def test_sigterm_stops_every_run_and_the_relaunch_logs_each_step_once(tmp_path):
    """SIGTERM to a parallel sweep: every `agl-lab train` it started stops and none is left; the
    same command again resumes the stopped runs, and each run's log holds every step once.
    8 steps: the signal comes once both runs logged a step, so a run that started late must not
    have let the other finish first (7 steps of margin on a loaded machine)."""
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        "configs/cpu_tiny.yaml",
        "actor_rollout_ref.actor.optim.lr=1e-3,1e-4",
        *SMALL,
        "trainer.save_freq=1",
        "--seeds",
        "0",
        "--parallel",
        "2",
        "--steps",
        "8",
        "--out",
        str(out),
        "--last",
        "8",
    ]
    log = tmp_path / "sweep.log"
    proc = spawn_cli(argv, log)
    metrics = [out / d / "seed0" / "metrics.jsonl" for d in ("lr1e-3", "lr1e-4")]
    wait_for(
        lambda: all(m.exists() and m.read_text().strip() for m in metrics), 600, "a step of both runs", [proc], [log]
    )
    assert len(_train_processes(str(out))) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    assert _train_processes(str(out)) == []  # nothing orphaned: the sweep waited for its runs
    printed = log.read_text()
    assert "sweep: SIGTERM: stopping 2 running run(s)" in printed and "run the same command again" in printed
    stopped = [runs.run_state(m.parent) for m in metrics]
    assert stopped == ["unfinished", "unfinished"], printed[-3000:]

    assert sweep_main(argv[1:]) == 0  # the relaunch: resumed from each run's checkpoint
    for m in metrics:
        assert [r["step"] for r in read_metrics(m)] == list(range(1, 9)), m
        assert runs.run_state(m.parent) == "finished" and "resumed from" in (m.parent / "train.log").read_text()
    result = sweep(
        "configs/cpu_tiny.yaml",
        {"lr=1e-3": ["actor_rollout_ref.actor.optim.lr=1e-3"], "lr=1e-4": ["actor_rollout_ref.actor.optim.lr=1e-4"]},
        seeds=[0],
        overrides=[*SMALL, "trainer.save_freq=1"],
        out=out,
        steps=8,
        last=8,
    )
    assert list(result.runs["log"]) == ["already done"] * 2
    assert list(result.table["training/reward n"]) == [8, 8]  # seeds × steps in the window: no copy counted


@pytest.mark.timeout(900)
def test_a_sweep_killed_with_sigkill_takes_its_run_along_and_the_relaunch_resumes_it(tmp_path):
    """SIGKILL gives the sweep no chance to pass anything on: its run gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and stops; the relaunch resumes it and logs each step once."""
    out = tmp_path / "sweep"
    argv = ["sweep", "configs/cpu_tiny.yaml", *SMALL, "trainer.save_freq=1", "--steps", "4", "--out", str(out)]
    log = tmp_path / "sweep.log"
    proc = spawn_cli(argv, log)
    metrics = out / "cpu_tiny" / "seed0" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 600, "the run's first step", [proc], [log])
    proc.kill()
    proc.wait()
    wait_for(lambda: not _train_processes(str(out)), 300, "the run to stop with its sweep")
    assert runs.run_state(metrics.parent) == "unfinished"
    assert sweep_main([*argv[1:], "--last", "4"]) == 0
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 5))


def test_the_progress_lines_eta_says_the_run_walls_include_their_warm_starts(tmp_path, capsys):
    jobs = [("a", seed, tmp_path / f"s{seed}") for seed in range(4)]
    pool = _Pool(jobs, {}, parallel=2, verbose=True)
    pool.pending = jobs[1:]
    pool.walls = [60.0, 180.0]  # the first run fitted the warm start, the second loaded it
    pool._progress()
    line = capsys.readouterr().out.strip()
    assert line.endswith("3 left · ETA ~3.0 min (2.0 min a run, warm starts included, 2 at a time)"), line


def test_runs_are_made_batch_invariant_on_the_local_engine_unless_told_otherwise():
    from agl_lab.sweep import _invariance

    assert _invariance("configs/cpu_tiny.yaml", {"a": []}, SMALL) == [INVARIANT]
    # set by the user (fixed or in a setting): left as given, never doubled
    off = "agl_lab.engine_options.batch_invariant=false"
    assert _invariance("configs/cpu_tiny.yaml", {"a": [off]}, SMALL) == []
    assert _invariance("configs/cpu_tiny.yaml", {"a": []}, [*SMALL, off]) == []
    # verl's replicas batch by their own rules: nothing added (the key would only warn there)
    assert _invariance("configs/cpu_tiny.yaml", {"a": []}, [*SMALL, "agl_lab.engine=verl"]) == []
