"""A grid × seeds of training runs, one after another or N at a time, then one `compare` table.

    agl-lab sweep configs/cpu_tiny.yaml actor_rollout_ref.rollout.n=4,8 --seeds 0,1,2
    agl-lab sweep configs/cpu_tiny.yaml actor_rollout_ref.rollout.n=4,8 data.train_batch_size=8,4 --zip \\
        --seeds 0,1,2 --parallel 2 --out runs/n4_vs_n8 trainer.total_training_steps=50
    agl-lab sweep configs/cpu_tiny.yaml --name n4:actor_rollout_ref.rollout.n=4 \\
        --name n8:actor_rollout_ref.rollout.n=8 --name n8:data.train_batch_size=4 --seeds 0,1,2

    from agl_lab.sweep import sweep
    result = sweep("cpu_tiny", {"n4": ["actor_rollout_ref.rollout.n=4"], "n8": ["actor_rollout_ref.rollout.n=8"]},
                   seeds=[0, 1, 2], out="runs/n4_vs_n8")
    result.table          # agl_lab.compare of the runs, one line per named setting
    result.runs           # one line per run: setting, seed, run_dir, returncode, log

A key with several comma-separated values is a grid axis (the product of the axes, or with
`zip` their values position by position); a key with one value holds for every run; `--name
NAME:key=value` names a setting instead (repeat it: a name given twice gathers its overrides).
With no axis and no name, the one setting is named after the config (`cpu_tiny`). Each run is
its own `agl-lab train` process in `OUT/<setting>/seed<S>` (its console output in `train.log`
there), with `agl_lab.seed=S` and its checkpoints in `OUT/<setting>/seed<S>/checkpoints`.
`--order seed-first` (the default) runs every setting of seed 0 before seed 1, so a study
stopped early still has every arm; `setting-first` runs a setting's seeds together.

Whether a run is done is read from its directory (`agl_lab.runs`): `finished.json`, which
`agl-lab train` writes last, with the same command. A relaunch runs exactly what is missing:
a finished run is not run again, an interrupted one (SIGTERM, SIGKILL, a crash) continues with
`--resume` from its latest checkpoint (from step 0 when it has none; its log starts over there,
so no step is logged twice). SIGTERM or Ctrl-C to the sweep is passed to every run, and the
sweep waits for them to stop (a second one kills them); on Linux a run is also sent SIGTERM when
the sweep dies (SIGKILL), so no run outlives it. A progress line after each run says how many
are done, running and left, and an ETA from the runs that finished.

Parallel runs share the warm-start cache, which is locked (`agl_lab.tasks.warmstart.cache_lock`):
the first run computes each warm start, the others load it. `OUT/sweep.json` lists the settings and runs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from agl_lab import runs as run_dirs

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
        if not key.strip():
            raise ValueError(f"{arg!r} names no key: give key=value (a grid axis is key=v1,v2,...)")
        if not value.strip():
            raise ValueError(f"{key}= has no value: give {key}=VALUE, or {key}=V1,V2 for a grid axis")
        if "," in value and not re.search(r"[\[\]{}]", value):
            axes[key] = [v.strip() for v in value.split(",")]
            if not all(axes[key]):
                raise ValueError(f"{key}={value}: an empty value in the axis; give {key}=V1,V2,... with none empty")
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


def named_settings(names: Sequence[str]) -> dict[str, list[str]]:
    """`--name NAME:key=value` flags → `{NAME: [key=value, ...]}` (a name given twice gathers its
    overrides, in order)."""
    out: dict[str, list[str]] = {}
    for flag in names:
        name, sep, override = flag.partition(":")
        if not sep or not name.strip() or "=" not in override or not override.split("=", 1)[0].strip():
            raise ValueError(
                f"--name {flag!r}: give NAME:key=value, e.g. --name n4:actor_rollout_ref.rollout.n=4 "
                "(repeat --name NAME:... for more keys of one setting)"
            )
        out.setdefault(name.strip(), []).append(override)
    return out


def config_name(config: str | os.PathLike) -> str:
    """The one setting's name when none is given: the config's (`configs/cpu_tiny.yaml` → `cpu_tiny`)."""
    return Path(str(config)).name.removesuffix(".yaml").removesuffix(".yml") or "run"


def _normalise(settings: Mapping[str, Any] | None, config: str | os.PathLike) -> dict[str, list[str]]:
    if not settings:
        return {config_name(config): []}
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
    """The run's `agl-lab train` command: up to step `steps` (`--until`, so a resumed run ends
    there too), its checkpoints in its own directory (never shared with another run)."""
    cmd = [sys.executable, "-m", "agl_lab.cli", "train", str(config), "--run-dir", str(run_dir)]
    if steps is not None:
        cmd += ["--until", str(steps)]
    return cmd + overrides + [f"trainer.default_local_dir={run_dir / 'checkpoints'}"]


def _train_argv(cmd: list[str]) -> list[str]:
    """What `agl-lab train` was given as its finished marker keeps it (secrets redacted), less `--resume`."""
    return run_dirs.public_argv([a for a in cmd[4:] if a != "--resume"])


def _finished(run_dir: Path, cmd: list[str]) -> bool:
    """The run directory holds a finished run of this very command. One of another command is
    not run again either: `agl-lab train` refuses it, naming the fix."""
    record = run_dirs.finished(run_dir)
    return record is not None and [a for a in record.get("argv", []) if a != "--resume"] == _train_argv(cmd)


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
    order: str = "seed-first",
    verbose: bool = True,
    batch_invariant: bool = True,
) -> SweepResult:
    """Run every setting × seed (`agl-lab train` processes, `parallel` at a time) and compare them.

    settings: `{name: overrides}` (a list of `key=value`, or a dict), e.g. from `grid_settings`;
    None: one setting, named after the config. `overrides` hold for every run. `steps`: the step
    each run trains to (`--until`; default: `trainer.total_training_steps`). `last`: the step
    window of the summary `compare`. `order`: `seed-first` (every setting of a seed, then the next
    seed) or `setting-first`. `batch_invariant`: on the local engine every run gets
    `agl_lab.engine_options.batch_invariant=true` (unless the overrides set it), so a seed is one
    run on any load and runs pair by seed call for call (docs/engines.md, "Determinism"; it costs
    generation speed). Returns a SweepResult; a run that failed is in `runs` with its
    return code and the last line of its log, and left out of `table`. SIGTERM or Ctrl-C stops
    every run and raises `SweepStopped` once they have stopped.
    """
    if parallel < 1:
        raise ValueError(f"parallel={parallel} must be >= 1")
    named = _normalise(settings, config)
    out = Path(out)
    overrides = [*_invariance(str(config), named, overrides), *overrides] if batch_invariant else list(overrides)
    jobs = _plan(str(config), named, seeds, overrides, out, order)
    commands = {
        run_dir: _command(str(config), run_dir, [*overrides, *named[name], f"agl_lab.seed={seed}"], steps)
        for name, seed, run_dir in jobs
    }
    records = _Pool(jobs, commands, parallel, verbose).run()
    runs = pd.DataFrame([records[d] for _, _, d in jobs], columns=RUN_COLUMNS)
    ok = runs[runs["returncode"] == 0]
    table = pd.DataFrame()
    if len(ok):
        from agl_lab.comparison import compare

        table = compare({name: list(group["run_dir"]) for name, group in ok.groupby("setting", sort=False)}, last=last)
        _say(verbose, table.to_string())
    return SweepResult(table=table, runs=runs, out=out, settings=named)


INVARIANT_KEY = "agl_lab.engine_options.batch_invariant"


def _invariance(config: str, named: dict[str, list[str]], overrides: Sequence[str]) -> list[str]:
    """`[INVARIANT_KEY=true]` when the runs use the local engine and no override sets the key."""
    given = [*overrides, *(o for setting in named.values() for o in setting)]
    if any(str(o).split("=", 1)[0].lstrip("+") == INVARIANT_KEY for o in given):
        return []
    from agl_lab import config as config_mod

    try:
        engine = str(config_mod.load_config(config, list(overrides)).agl_lab.engine)
    except Exception:  # a config that does not load: each run says why, naming the key
        return []
    if engine != "local":
        return []  # verl's replicas batch by their own rules: the key would only warn
    return [f"{INVARIANT_KEY}=true"]


_Job = tuple[str, int, Path]  # setting name, seed, run directory
ORDERS = ("seed-first", "setting-first")


def _plan(
    config: str,
    named: dict[str, list[str]],
    seeds: Sequence[int],
    overrides: Sequence[str],
    out: Path,
    order: str = "seed-first",
) -> list[_Job]:
    """Every setting × seed with its run directory, in `order`, written to `out/sweep.json`."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {', '.join(ORDERS)}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {list(seeds)} repeat a seed: give each seed once")
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(n, s) for s in seeds for n in named] if order == "seed-first" else [(n, s) for n in named for s in seeds]
    jobs = [(name, int(seed), out / setting_dir(name) / f"seed{seed}") for name, seed in pairs]
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
                "order": order,
                "runs": [{"setting": n, "seed": s, "run_dir": str(d)} for n, s, d in jobs],
            },
            indent=2,
        )
    )
    return jobs


class SweepStopped(KeyboardInterrupt):
    """SIGTERM or Ctrl-C reached the sweep; every run it started has stopped. `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Pool:
    """The sweep's runs, `parallel` at a time: start, reap, say the progress, and on SIGTERM or
    SIGINT pass SIGTERM to every running run and wait for it (a second signal kills them)."""

    def __init__(self, jobs: list[_Job], commands: dict[Path, list[str]], parallel: int, verbose: bool):
        self.pending, self.commands, self.parallel, self.verbose = list(jobs), commands, parallel, verbose
        self.total = len(jobs)
        self.running: list[tuple[_Job, subprocess.Popen, float, Any]] = []
        self.records: dict[Path, dict[str, Any]] = {}
        self.walls: list[float] = []  # of the runs that finished in this sweep: the ETA's unit
        self.stop_signal: int | None = None

    def run(self) -> dict[Path, dict]:
        """Every job's record (RUN_COLUMNS) by its run directory; SweepStopped after a signal."""
        previous = self._install()
        try:
            while (self.pending or self.running) and self.stop_signal is None:
                while self.pending and len(self.running) < self.parallel and self.stop_signal is None:
                    self._start(self.pending.pop(0))
                self._reap()
                if self.running and self.stop_signal is None:
                    time.sleep(0.5)
            if self.stop_signal is not None:
                self._stop()
                raise SweepStopped(self.stop_signal)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.records

    def _install(self) -> dict[int, Any]:
        """SIGTERM and SIGINT set `stop_signal` (the main thread only: elsewhere nothing is installed)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum, frame):
            if self.stop_signal is not None:  # the second one: do not wait any longer
                for _, proc, _, _ in self.running:
                    proc.kill()
            self.stop_signal = signum

        return {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}

    def _start(self, job: _Job) -> None:
        name, seed, run_dir = job
        cmd = self.commands[run_dir]
        if _finished(run_dir, cmd):
            wall = (run_dirs.finished(run_dir) or {}).get("wall_s")
            self.records[run_dir] = _record(job, 0, wall, "already done")
            _say(self.verbose, f"sweep: {name} seed {seed}: already done ({run_dir})")
            return
        if run_dirs.run_state(run_dir) == "unfinished":  # stopped before: continue from its checkpoint
            cmd = [*cmd, "--resume"]
            _say(self.verbose, f"sweep: {name} seed {seed} → {run_dir} (resuming the stopped run)")
        else:
            _say(self.verbose, f"sweep: {name} seed {seed} → {run_dir}")
        run_dir.mkdir(parents=True, exist_ok=True)
        log = open(run_dir / "train.log", "a")
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            start_new_session=True,  # Ctrl-C reaches the sweep only, which passes it on once (SIGTERM)
            preexec_fn=_die_with_parent,
        )
        self.running.append((job, proc, time.time(), log))
        self._progress()

    def _reap(self) -> None:
        for item in list(self.running):
            job, proc, t0, log = item
            name, seed, run_dir = job
            if proc.poll() is None:
                continue
            log.close()
            self.running.remove(item)
            wall = time.time() - t0
            last_line = _last_line(run_dir / "train.log")
            self.records[run_dir] = _record(job, proc.returncode, wall, last_line)
            if proc.returncode == 0:
                self.walls.append(wall)
            _say(
                self.verbose, f"sweep: {name} seed {seed} ended ({proc.returncode}) in {wall / 60:.1f} min: {last_line}"
            )
            self._progress()

    def _stop(self) -> None:
        """SIGTERM to every running run (it stops between two steps and prints its resume line),
        then wait for each; their records say they were stopped."""
        name = signal.Signals(self.stop_signal).name
        _say(self.verbose, f"sweep: {name}: stopping {len(self.running)} running run(s) and waiting for them")
        for _, proc, _, _ in self.running:
            if proc.poll() is None:
                proc.terminate()
        for job, proc, t0, log in self.running:
            proc.wait()
            log.close()
            self.records[job[2]] = _record(job, proc.returncode, time.time() - t0, f"stopped by {name}")
        self.running.clear()
        _say(self.verbose, f"sweep: stopped; run the same command again to finish the {self._left()} run(s) left")

    def _left(self) -> int:
        return self.total - sum(1 for r in self.records.values() if r["returncode"] == 0)

    def _progress(self) -> None:
        """`sweep: 3/8 done · 2 running · 3 left · ETA ~6.0 min (1.5 min a run, warm starts included, 2 at a time)`.

        A run's wall time includes its warm start: the first run fits it (the others load it from
        the shared cache), so early on the ETA leans long; the line says so."""
        done = len(self.records)
        running, left = len(self.running), len(self.pending)
        if not running + left:
            eta = "all ended"
        elif self.walls:
            each = sum(self.walls) / len(self.walls)
            eta = f"ETA ~{each * (running + left) / self.parallel / 60:.1f} min ({each / 60:.1f} min a run, "
            eta += f"warm starts included, {self.parallel} at a time)"
        else:
            eta = "ETA after the first run ends"
        _say(self.verbose, f"sweep: {done}/{self.total} done · {running} running · {left} left · {eta}")


def _die_with_parent() -> None:
    """In the child (Linux): SIGTERM when the sweep dies, even by SIGKILL, so no run outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


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
    if repeats := sorted({s for s in seeds if seeds.count(s) > 1}, key=int):
        return f"--seeds {args.seeds!r} repeats seed {', '.join(repeats)}: give each seed once, e.g. --seeds 0,1,2"
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
            where = "" if len(named) == 1 and not overrides else f"setting {name}: "
            return f"{where}{text}"
    return None


def sweep_main(argv: list[str]) -> int:
    """`agl-lab sweep CONFIG key=v1,v2 ... | --name NAME:key=value ... [--zip] --seeds 0,1,2 [--parallel N]
    [--order seed-first|setting-first] [--out DIR] [--steps N] [--last K]`. Exit 0: every run
    finished; 1: a run failed; 2: the command is wrong (one line naming it); 130/143: stopped by
    Ctrl-C / SIGTERM after every run stopped (the same command again resumes them)."""
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab sweep", description="Train a grid × seeds, then compare.")
    parser.add_argument("config", help="YAML config or preset name, e.g. configs/cpu_tiny.yaml or cpu_tiny")
    parser.add_argument("args", nargs="*", help="key=v1,v2 (a grid axis) or key=value (every run)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--zip", action="store_true", help="pair the axes' values position by position")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME:key=value",
        help="a named setting instead of axes (repeat: one key=value each, a name given twice gathers them)",
    )
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="seed-first",
        help="seed-first (default): every setting of a seed before the next seed; setting-first: a setting's seeds together",
    )
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--out", default="runs/sweep", help="directory of the runs (default runs/sweep)")
    parser.add_argument(
        "--steps", type=int, default=None, help="the step each run trains to (default total_training_steps)"
    )
    parser.add_argument("--last", type=int, default=10, help="the summary's window: the last K steps")
    parser.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="do not add agl_lab.engine_options.batch_invariant=true (faster generation; a seed may then "
        "sample differently on a loaded machine)",
    )
    args = parser.parse_intermixed_args(argv)
    try:
        axes, fixed = parse_axes(args.args)
        if axes and args.name:
            raise ValueError(f"give grid axes ({', '.join(axes)}) or --name settings, not both")
        settings = named_settings(args.name) if args.name else grid_settings(axes, args.zip) if axes else None
    except ValueError as e:
        print(f"agl-lab sweep: {e}")
        return 2
    problem = _flag_problem(args)
    if problem is None:
        problem = _config_problem(args.config, _normalise(settings, args.config), fixed)
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
            order=args.order,
            batch_invariant=args.batch_invariant,
        )
    except SweepStopped as e:
        return 128 + e.signum
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
