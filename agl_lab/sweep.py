"""A grid × seeds of training runs, one after another or N at a time, then one `compare` table.

    agl-lab sweep configs/cpu_tiny.yaml actor_rollout_ref.rollout.n=4,8 --seeds 0,1,2
    agl-lab sweep configs/cpu_tiny.yaml actor_rollout_ref.rollout.n=4,8 data.train_batch_size=8,4 --zip \\
        --seeds 0,1,2 --parallel 2 --out runs/n4_vs_n8 trainer.total_training_steps=50

    from agl_lab.sweep import sweep
    result = sweep("cpu_tiny", {"n4": ["actor_rollout_ref.rollout.n=4"], "n8": ["actor_rollout_ref.rollout.n=8"]},
                   seeds=[0, 1, 2], out="runs/n4_vs_n8")
    result.table          # agl_lab.compare of the runs, one line per named setting
    result.runs           # one line per run: setting, seed, run_dir, returncode, log

A key with several comma-separated values is a grid axis (the product of the axes, or with
`zip` their values position by position); a key with one value holds for every run. Each run
is its own `agl-lab train` process in `OUT/<setting>/seed<S>` (its console output in
`train.log` there), with `agl_lab.seed=S`. A run whose directory already holds a finished run
of the same command (`sweep_done.json`: return code 0, the same config and overrides) is not
run again, so an interrupted sweep continues where it stopped. Parallel runs share the warm-start cache, which is locked
(`agl_lab.tasks.warmstart.cache_lock`): the first run computes each warm start, the others load it.
`OUT/sweep.json` lists the settings and runs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

DONE_FILE = "sweep_done.json"
RUN_COLUMNS = ["setting", "seed", "run_dir", "returncode", "wall_s", "log"]


@dataclass
class SweepResult:
    """`table`: `agl_lab.compare` of the finished runs by setting; `runs`: one line per run."""

    table: pd.DataFrame
    runs: pd.DataFrame
    out: Path
    settings: dict[str, list[str]] = field(default_factory=dict)

    def _repr_html_(self) -> str:  # the summary table in a notebook
        return self.table._repr_html_()


def parse_axes(args: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
    """`key=v1,v2` → an axis; `key=v` → a fixed override. Returns `(axes, fixed)`.

    A value holding brackets or braces (a list or dict literal) is never split."""
    axes: dict[str, list[str]] = {}
    fixed: list[str] = []
    for arg in args:
        if "=" not in arg:
            raise ValueError(f"{arg!r} is not key=value (a grid axis is key=v1,v2,...)")
        key, value = arg.split("=", 1)
        if "," in value and not re.search(r"[\[\]{}]", value):
            axes[key] = [v.strip() for v in value.split(",")]
        else:
            fixed.append(arg)
    return axes, fixed


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def grid_settings(axes: Mapping[str, Sequence[Any]], zip_axes: bool = False) -> dict[str, list[str]]:
    """Named settings of a grid: `{"n=4,train_batch_size=8": ["…rollout.n=4", "data.train_batch_size=8"]}`.

    The name uses each key's last part (the full key when two axes share one)."""
    keys = list(axes)
    shorts = [_short(k) for k in keys]
    names = [s if shorts.count(s) == 1 else k for k, s in zip(keys, shorts)]
    values = [list(axes[k]) for k in keys]
    if zip_axes:
        lengths = {len(v) for v in values}
        if len(lengths) > 1:
            raise ValueError(
                "zip needs the same number of values on every axis, got "
                + ", ".join(f"{k}: {len(v)}" for k, v in zip(keys, values))
            )
        combos = list(zip(*values))
    else:
        combos = list(itertools.product(*values))
    return {
        ",".join(f"{n}={v}" for n, v in zip(names, combo)): [f"{k}={v}" for k, v in zip(keys, combo)]
        for combo in combos
    }


def setting_dir(name: str) -> str:
    """A directory name for a setting name (`n=4,train_batch_size=8` → `n4-train_batch_size8`)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "", name.replace(",", "-").replace("=", "")) or "default"


def _normalise(settings: Mapping[str, Any] | None) -> dict[str, list[str]]:
    if not settings:
        return {"default": []}
    out: dict[str, list[str]] = {}
    for name, value in settings.items():
        if isinstance(value, Mapping):
            out[str(name)] = [f"{k}={v}" for k, v in value.items()]
        elif isinstance(value, str):
            out[str(name)] = [value]
        else:
            out[str(name)] = [str(v) for v in value]
    return out


def _command(config: str, run_dir: Path, overrides: list[str], steps: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "agl_lab.cli", "train", str(config), "--run-dir", str(run_dir)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    return cmd + overrides


def _finished(run_dir: Path, cmd: list[str]) -> bool:
    """A finished run of this very command (another config or overrides in the same dir runs again)."""
    done = run_dir / DONE_FILE
    if not done.exists():
        return False
    record = json.loads(done.read_text())
    return record.get("returncode") == 0 and record.get("args") == cmd[3:]


def sweep(
    config: str | os.PathLike,
    settings: Mapping[str, Any] | None = None,
    *,
    seeds: Sequence[int] = (0,),
    overrides: Sequence[str] = (),
    out: str | os.PathLike = "runs/sweep",
    parallel: int = 1,
    steps: int | None = None,
    last: int = 10,
    verbose: bool = True,
) -> SweepResult:
    """Run every setting × seed (`agl-lab train` processes, `parallel` at a time) and compare them.

    settings: `{name: overrides}` (a list of `key=value`, or a dict), e.g. from `grid_settings`;
    None: one setting, "default". `overrides` hold for every run. `steps`: `--steps` of each run
    (default: `trainer.total_training_steps`). `last`: the step window of the summary `compare`.
    Returns a SweepResult; a run that failed is in `runs` with its return code and the last line
    of its log, and left out of `table`.
    """
    if parallel < 1:
        raise ValueError(f"parallel={parallel} must be >= 1")
    named = _normalise(settings)
    out = Path(out)
    jobs = _plan(str(config), named, seeds, overrides, out)
    commands = {
        run_dir: _command(str(config), run_dir, [*overrides, *named[name], f"agl_lab.seed={seed}"], steps)
        for name, seed, run_dir in jobs
    }
    records = _run_all(jobs, commands, parallel, verbose)
    runs = pd.DataFrame([records[d] for _, _, d in jobs], columns=RUN_COLUMNS)
    ok = runs[runs["returncode"] == 0]
    table = pd.DataFrame()
    if len(ok):
        from agl_lab.comparison import compare

        table = compare({name: list(group["run_dir"]) for name, group in ok.groupby("setting", sort=False)}, last=last)
        _say(verbose, table.to_string())
    return SweepResult(table=table, runs=runs, out=out, settings=named)


_Job = tuple[str, int, Path]  # setting name, seed, run directory


def _plan(
    config: str, named: dict[str, list[str]], seeds: Sequence[int], overrides: Sequence[str], out: Path
) -> list[_Job]:
    """Every setting × seed with its run directory, written to `out/sweep.json`."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, int(seed), out / setting_dir(name) / f"seed{seed}") for name in named for seed in seeds]
    dirs = [d for _, _, d in jobs]
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"two settings map to one directory under {out}: name them apart ({list(named)})")
    (out / "sweep.json").write_text(
        json.dumps(
            {
                "config": config,
                "overrides": list(overrides),
                "settings": named,
                "seeds": [int(s) for s in seeds],
                "runs": [{"setting": n, "seed": s, "run_dir": str(d)} for n, s, d in jobs],
            },
            indent=2,
        )
    )
    return jobs


def _run_all(jobs: list[_Job], commands: dict[Path, list[str]], parallel: int, verbose: bool) -> dict[Path, dict]:
    """Run the jobs' commands, `parallel` at a time; a run already finished by the same command is
    not run again. Returns each run's record (RUN_COLUMNS) by its directory."""
    records: dict[Path, dict[str, Any]] = {}
    pending = list(jobs)
    running: list[tuple[_Job, subprocess.Popen, float, Any]] = []
    while pending or running:
        while pending and len(running) < parallel:
            name, seed, run_dir = job = pending.pop(0)
            if _finished(run_dir, commands[run_dir]):
                wall = json.loads((run_dir / DONE_FILE).read_text()).get("wall_s")
                records[run_dir] = _record(job, 0, wall, "already done")
                _say(verbose, f"sweep: {name} seed {seed}: already done ({run_dir})")
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "train.log", "w")
            _say(verbose, f"sweep: {name} seed {seed} → {run_dir}")
            proc = subprocess.Popen(commands[run_dir], stdout=log, stderr=subprocess.STDOUT, env=_child_env())
            running.append((job, proc, time.time(), log))
        for item in list(running):
            job, proc, t0, log = item
            name, seed, run_dir = job
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            wall = time.time() - t0
            last_line = _last_line(run_dir / "train.log")
            (run_dir / DONE_FILE).write_text(
                json.dumps({"returncode": proc.returncode, "wall_s": wall, "args": commands[run_dir][3:]})
            )
            records[run_dir] = _record(job, proc.returncode, wall, last_line)
            _say(verbose, f"sweep: {name} seed {seed} ended ({proc.returncode}) in {wall / 60:.1f} min: {last_line}")
        if running:
            time.sleep(0.5)
    return records


def _record(job: _Job, returncode: int, wall_s: float | None, log: str) -> dict[str, Any]:
    name, seed, run_dir = job
    return {
        "setting": name,
        "seed": seed,
        "run_dir": str(run_dir),
        "returncode": returncode,
        "wall_s": wall_s,
        "log": log,
    }


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # the children import the same agl_lab as this process (a source checkout on PYTHONPATH too)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1][:300] if lines else ""


def _say(verbose: bool, line: str) -> None:
    if verbose:
        print(line, flush=True)


def _flag_problem(args: Any) -> str | None:
    """What is wrong with sweep_main's flags (one line naming the flag), None when nothing is."""
    seeds = [s.strip() for s in args.seeds.split(",") if s.strip()]
    if not seeds or not all(s.lstrip("-").isdigit() for s in seeds):
        return f"--seeds {args.seeds!r}: give comma-separated integers, e.g. --seeds 0,1,2"
    if args.parallel < 1:
        return f"--parallel must be >= 1, got {args.parallel}"
    if args.steps is not None and args.steps < 0:
        return f"--steps must be >= 0, got {args.steps}"
    if args.last < 1:
        return f"--last must be >= 1, got {args.last}"
    if Path(args.out).exists() and not Path(args.out).is_dir():
        return f"--out {args.out} is a file: name a directory (default runs/sweep)"
    return None


def _config_problem(config: str, named: Mapping[str, list[str]], fixed: Sequence[str]) -> str | None:
    """The first setting whose config does not load (before any run starts), as one line."""
    from agl_lab import config as config_mod

    for name, overrides in named.items():
        try:
            config_mod.load_config(config, [*fixed, *overrides])
        except Exception as e:  # ConfigError names the key; YAML errors and missing files their cause
            text = " ".join(str(e).split()) or type(e).__name__
            where = "" if name == "default" else f"setting {name}: "
            return f"{where}{text}"
    return None


def sweep_main(argv: list[str]) -> int:
    """`agl-lab sweep CONFIG key=v1,v2 ... [--zip] --seeds 0,1,2 [--parallel N] [--out DIR] [--steps N] [--last K]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab sweep", description="Train a grid × seeds, then compare.")
    parser.add_argument("config", help="YAML config or preset name, e.g. configs/cpu_tiny.yaml or cpu_tiny")
    parser.add_argument("args", nargs="*", help="key=v1,v2 (a grid axis) or key=value (every run)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--zip", action="store_true", help="pair the axes' values position by position")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--out", default="runs/sweep", help="directory of the runs (default runs/sweep)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default total_training_steps)")
    parser.add_argument("--last", type=int, default=10, help="the summary's window: the last K steps")
    args = parser.parse_intermixed_args(argv)
    try:
        axes, fixed = parse_axes(args.args)
        settings = grid_settings(axes, args.zip) if axes else None
    except ValueError as e:
        print(f"agl-lab sweep: {e}")
        return 2
    problem = _flag_problem(args)
    if problem is None:
        problem = _config_problem(args.config, _normalise(settings), fixed)
    if problem is not None:
        print(f"agl-lab sweep: {problem}")
        return 2
    try:
        result = sweep(
            args.config,
            settings,
            seeds=[int(s) for s in args.seeds.split(",") if s.strip()],
            overrides=fixed,
            out=args.out,
            parallel=args.parallel,
            steps=args.steps,
            last=args.last,
        )
    except (ValueError, OSError) as e:  # two settings in one directory, an --out that cannot be made
        print(f"agl-lab sweep: {e}")
        return 2
    failed = result.runs[result.runs["returncode"] != 0]
    for _, row in failed.iterrows():
        print(
            f"agl-lab sweep: {row['setting']} seed {row['seed']} failed ({row['returncode']}): "
            f"{row['log']} (log: {row['run_dir']}/train.log)"
        )
    return 1 if len(failed) else 0
