"""The `agl-lab` command: serve | runner | engine | train | replay | sweep.

    agl-lab serve  --port 8080 --key KEY --model-name NAME [--store sqlite:///f.db]
    agl-lab runner --server URL --key KEY --agent module:function|module:Class [--concurrency N]
    agl-lab engine --port 8001 [--model-path DIR]
    agl-lab train  configs/cpu_tiny.yaml [--run-dir DIR] [--steps N | --until STEP] [--resume] [key=value ...]
    agl-lab replay RUN_DIR [--step N] [key=value ...]
    agl-lab sweep  CONFIG key=v1,v2 ... --seeds 0,1,2 [--zip] [--parallel N] [--out DIR]

`serve`, `runner` and `engine` live beside the code they run; `train` is here. Each is imported only
when it runs, so `agl-lab serve` never imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

SUBCOMMANDS = {
    "serve": ("agl_lab.server.embedded", "serve_main", "run the rollout store + LLM gateway"),
    "runner": ("agl_lab.runner_cli", "runner_main", "claim and run rollouts of a server (agents on any host)"),
    "engine": ("agl_lab.engines.serving.openai_server", "engine_main", "serve the local model OpenAI-style"),
    "train": ("agl_lab.cli", "train_main", "train from a YAML config"),
    "replay": ("agl_lab.replay", "replay_main", "replay a recorded step (what-if with key=value)"),
    "sweep": ("agl_lab.sweep", "sweep_main", "train a grid × seeds, then one compare table"),
    "eval": ("agl_lab.evaluation", "eval_main", "pass@k of a model, checkpoint or run on a task"),
}


def _usage() -> str:
    lines = ["usage: agl-lab {" + ",".join(SUBCOMMANDS) + "} [options]", ""]
    lines += [f"  {name:<7} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"agl-lab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except SystemExit as exc:  # `raise SystemExit("agl-lab X: what to fix")`: a user's error, exit 2
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)
        return 2


def train_main(argv: list[str]) -> int:
    """`agl-lab train CONFIG [--run-dir DIR] [--steps N | --until STEP] [--resume [CHECKPOINT]] [key=value ...]`.

    `--steps N` trains N steps *more* than where the run starts (after `--resume` from step 5,
    `--steps 6` ends at step 11); `--until STEP` trains until global step STEP (5 → 11 with
    `--until 11`; nothing when the checkpoint is already there). Without either, the run ends
    at `trainer.total_training_steps`. Ctrl-C stops between two steps' work: no traceback, the
    reward curve is written and the last line names the last checkpoint and the command that
    resumes from it (exit status 130). SIGTERM (Slurm, Kubernetes, `docker stop`, systemd) is the
    same clean stop: agents' process groups are terminated (killed after a grace period), the
    same lines are printed, exit status 143.

    A run directory holds one run (`agl_lab.runs`): a directory that already holds one is
    refused (exit 2) unless `--resume` continues it, and `finished.json` is written last, only
    when the run ended normally. A resume starts the log over from the checkpoint's step (from
    step 0 when there is none), so `metrics.jsonl` never logs a step twice.
    """
    import time

    from agl_lab import config as config_mod
    from agl_lab import runs
    from agl_lab.checkpoints import CheckpointDiskFull
    from agl_lab.engines.verl.api import StartupProblem  # stdlib imports only
    from agl_lab.trainer import Trainer

    args = _train_parser().parse_intermixed_args(_bare_resume(argv))  # overrides may come before or after options
    cfg = _train_config(args)
    if cfg is None:
        return 2
    if (problem := _run_dir_problem(args.run_dir or cfg.agl_lab.run_dir, args.resume)) is not None:
        print(f"agl-lab train: {problem}")
        return 2
    _checkpoints_in_run_dir(cfg, args.run_dir or cfg.agl_lab.run_dir)
    t0 = time.time()
    trainer = None
    previous = _stop_on_sigterm()
    try:
        try:
            built = Trainer(cfg, run_dir=args.run_dir)
        except (config_mod.ConfigError, ValueError, KeyError, ModuleNotFoundError) as e:  # what the config names
            print(f"agl-lab train: {_one_line(e)}")
            return 2
        except StartupProblem as e:  # the verl engine's start-up check (before Ray): what is missing here
            print(f"agl-lab train: {_one_line(e)}")
            return 2
        with built as trainer:
            _say_what_runs(trainer, cfg)
            try:
                resumed = trainer.resume()  # also checks trainer.resume_mode, found after the engine is built
            except config_mod.ConfigError as e:
                print(f"agl-lab train: {_one_line(e)}", flush=True)
                return 2
            _start_over_unless(trainer, resumed)
            steps = args.steps if args.until is None else max(args.until - trainer.global_step, 0)
            _say_span(trainer, resumed, steps)
            history = trainer.fit(steps, progress=False)
            _summarise(trainer.run_dir, history, time.time() - t0)
        # Critical: written last, so a run stopped anywhere before this line reads as unfinished
        runs.mark_finished(
            trainer.run_dir,
            {"step": trainer.global_step, "argv": runs.public_argv(argv), "wall_s": time.time() - t0},
        )
    except KeyboardInterrupt as e:
        _interrupted(trainer, argv, args.resume, time.time() - t0, terminated=isinstance(e, Terminated))
        return 143 if isinstance(e, Terminated) else 130
    except CheckpointDiskFull as e:  # names the disk, the free space, the fix and the latest checkpoint
        print(f"agl-lab train: {e.strerror}", flush=True)
        return 1
    finally:
        _restore_sigterm(previous)
    return 0


def _checkpoints_in_run_dir(cfg: Any, run_dir: Any) -> None:
    """A run dir named by the user (`--run-dir`, `agl_lab.run_dir`) holds its own checkpoints:
    `trainer.default_local_dir` left at verl's default becomes `<run_dir>/checkpoints`.

    Critical: with verl's shared `checkpoints/{project}/{experiment}`, a second seed started in a
    fresh run dir would auto-resume (`trainer.resume_mode: auto`) from the first seed's checkpoint.
    Without a named run dir the verl layout stays, so a bare `--resume` finds the last run's."""
    from omegaconf import OmegaConf

    from agl_lab.config import default_config

    def unresolved(c: Any) -> Any:
        return OmegaConf.to_container(c.trainer, resolve=False).get("default_local_dir")

    if run_dir is None:
        return
    if unresolved(cfg) == unresolved(default_config()):  # verl's checkpoints/{project}/{experiment}
        cfg.trainer.default_local_dir = os.path.join(str(run_dir), "checkpoints")


def _run_dir_problem(run_dir: Any, resume: str | None) -> str | None:
    """Why `agl-lab train` must not write into `run_dir` (one line with the fix), None when it may:
    a directory holding a run takes only `--resume`, which continues that run."""
    from agl_lab import runs

    if run_dir is None or resume is not None:
        return None
    state = runs.run_state(run_dir)
    if state == "finished":
        step = (runs.finished(run_dir) or {}).get("step", "?")
        return (
            f"{run_dir} holds a finished run (step {step}): resume it with --resume to extend it, "
            "or pick another --run-dir"
        )
    if state == "unfinished":
        return (
            f"{run_dir} holds an unfinished run (steps up to {max(runs.logged_steps(run_dir))} logged): "
            "continue it with --resume (from its latest checkpoint, else from step 0), or pick another --run-dir"
        )
    return None


def _start_over_unless(trainer: Any, resumed: Any) -> None:
    """The run trains again: not finished until it ends, and with no checkpoint resumed it starts
    over at step 0 with an empty log (a resumed Trainer already dropped the steps after its
    checkpoint), so no step is logged twice."""
    from agl_lab import runs

    runs.clear_finished(trainer.run_dir)
    if resumed is not None or trainer.global_step > 0:
        return
    dropped = trainer.metrics_logger.drop_after(-1)
    trainer.recorder.drop_after(-1)
    if dropped:
        print(
            f"agl-lab train: no checkpoint to resume from: {trainer.run_dir}'s {dropped} logged "
            "records are dropped and the run starts again at step 1",
            flush=True,
        )


def _train_parser() -> Any:
    """`agl-lab train`'s arguments."""
    import argparse

    parser = argparse.ArgumentParser(prog="agl-lab train", description="Train from a YAML config.")
    parser.add_argument("config", help="YAML config, e.g. configs/cpu_tiny.yaml")
    parser.add_argument("--run-dir", default=None, help="where metrics.jsonl and plots go")
    span = parser.add_mutually_exclusive_group()
    span.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train N more steps from where the run starts (a resumed run: from its checkpoint)",
    )
    span.add_argument(
        "--until",
        type=int,
        default=None,
        metavar="STEP",
        help="train until global step STEP (default: trainer.total_training_steps)",
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="CHECKPOINT",
        help="continue from the latest checkpoint under trainer.default_local_dir, "
        "or from CHECKPOINT (…/global_step_N)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    return parser


def _train_config(args: Any) -> Any:
    """The run's config from `agl-lab train`'s arguments; None after printing what is wrong (exit 2)."""
    from agl_lab import config as config_mod

    for name in ("steps", "until"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            print(f"agl-lab train: --{name} must be >= 0, got {getattr(args, name)}")
            return None
    try:
        return config_mod.load_config(args.config, list(args.overrides) + resume_overrides(args.resume))
    except config_mod.ConfigError as e:
        print(f"agl-lab train: {e}")
        return None
    except Exception as e:
        if (problem := _yaml_problem(e)) is None:
            raise
        print(f"agl-lab train: {args.config} (or an override) is not valid YAML: {problem}")
        return None


def _say_what_runs(trainer: Any, cfg: Any) -> None:
    """The start line: run dir, engine, model, what runs; the server's URL when runners can reach it."""
    print(
        f"agl-lab train: run dir {trainer.run_dir} · engine {cfg.agl_lab.engine} · "
        f"model {trainer.engine.model_name} · {_what_runs(trainer, cfg)}",
        flush=True,
    )
    if int(cfg.trainer.save_freq or 0) > 0:
        print(f"agl-lab train: checkpoints {cfg.trainer.default_local_dir}", flush=True)
    if trainer.execution.server is not None:  # runners on other hosts: agl-lab runner --server URL
        print(f"agl-lab train: server {trainer.base_url}", flush=True)


def _say_span(trainer: Any, resumed: Any, steps: int | None) -> None:
    """Where a resumed run starts, and the steps it will train (or that there is nothing to train)."""
    start = trainer.global_step
    if resumed is not None:
        print(f"agl-lab train: resumed from {resumed} at step {start}", flush=True)
    if steps is not None or resumed is not None:
        end = start + steps if steps is not None else trainer.total_steps
        print(
            f"agl-lab train: steps {start + 1}–{end}"
            if end > start
            else f"agl-lab train: already at step {start} (≥ {end}): nothing to train",
            flush=True,
        )


def _what_runs(trainer: Any, cfg: Any) -> str:
    """The start line's account of what runs: the agent class or agent that replaced the task's
    agent, the data files that replaced its tasks, else the task (`agl_lab.task.name`)."""
    from agl_lab import config as config_mod

    parts = []
    agent_class = cfg.agentlightning.local.get("agent_class")
    if agent_class:
        parts.append(f"agent {agent_class}")
    elif cfg.agl_lab.get("agent"):
        parts.append(f"agent {cfg.agl_lab.agent}")
    train_files, _ = config_mod.task_files(cfg)
    if train_files is not None:
        parts.append(f"data {train_files}")
    if trainer.task is not None and (train_files is None or not parts[:1]):
        parts.insert(0, f"task {cfg.agl_lab.task.name}")
    return " · ".join(parts)


def _one_line(e: BaseException) -> str:
    """The error as one line: a KeyError's message unquoted, a missing module named with the fix."""
    if isinstance(e, ModuleNotFoundError):
        return (
            f"no module named {e.name!r}: agl_lab.agent, agl_lab.task.name ('module:attr') and "
            "agentlightning.local.agent_class must name a module importable from the current directory "
            "or PYTHONPATH"
        )
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(text).split())


def _yaml_problem(e: BaseException) -> str | None:
    """The YAML syntax error in `e` (or its cause) as one line, None when `e` is none."""
    import yaml

    while e is not None and not isinstance(e, yaml.YAMLError):
        e = e.__cause__ or e.__context__
    return None if e is None else " ".join(str(e).split())


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread like Ctrl-C's KeyboardInterrupt, so the same
    `with Trainer(...)` exit stops the runner (agents' process groups terminated, then killed)
    and the same resume line is printed."""


def _stop_on_sigterm():
    """Turn SIGTERM into `Terminated` in the main thread (a second one is ignored while the
    first stop runs). Returns the previous handler (None off the main thread: nothing installed)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    from agl_lab import runs

    def on_sigterm(signum, frame):
        if runs.defer_stop(signum):  # a step's checkpoint, recording and log land together first
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    return signal.signal(signal.SIGTERM, on_sigterm)


def _restore_sigterm(previous) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _bare_resume(argv: list[str]) -> list[str]:
    """`--resume key=value` (and `--resume config.yaml`) is a bare `--resume` followed by an
    override (or the config), not a checkpoint: argparse would take it as the optional
    CHECKPOINT. A checkpoint is a directory; an override holds "=" and names no file."""
    import os

    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        following = out[i + 1]
        if arg != "--resume" or following.startswith("-"):
            continue
        if ("=" in following and not os.path.exists(following)) or os.path.isfile(following):
            out[i] = "--resume=auto"
    return out


def resume_overrides(resume: str | None) -> list[str]:
    """The overrides of `--resume` (None: not given; "auto": the latest checkpoint; else a
    checkpoint directory, which must exist — ConfigError naming --resume otherwise)."""
    from pathlib import Path

    from agl_lab.config import ConfigError

    if resume is None:
        return []
    if resume == "auto":
        return ["trainer.resume_mode=auto"]
    if not (Path(resume) / "trainer_state.pt").exists():  # checkpoints.STATE_FILE (that module imports torch)
        raise ConfigError(
            f"--resume {resume!r} is not a checkpoint directory (…/global_step_N holding "
            "trainer_state.pt): give one, or a bare --resume for the latest under "
            "trainer.default_local_dir"
        )
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={resume}"]


def _interrupted(trainer, argv: list[str], resume_arg: str | None, wall: float, terminated: bool = False) -> None:
    """Ctrl-C / SIGTERM: the reward curve so far, the last checkpoint and the command that resumes from it."""
    import shlex

    from agl_lab import checkpoints

    print(f"\n{'terminated (SIGTERM)' if terminated else 'interrupted'} after {wall / 60:.1f} min", end="", flush=True)
    if trainer is None:
        print(" (before the Trainer started)", flush=True)
        return
    print(f" at step {trainer.global_step}", flush=True)
    try:
        png = trainer.plot_metrics(trainer.run_dir / "reward_curve.png")
    except Exception as e:  # a plot must not hide the resume line
        png, why = None, f" (the curve could not be drawn: {e})"
    else:
        why = ""
    print(f"reward curve: {png}" if png is not None else f"reward curve: none, no training step ended{why}", flush=True)
    latest = checkpoints.checkpoint_root(trainer.cfg) / checkpoints.LATEST
    if not latest.exists():
        print(
            f"last checkpoint: none under {checkpoints.checkpoint_root(trainer.cfg)} (trainer.save_freq="
            f"{trainer.cfg.trainer.save_freq}); nothing to resume from",
            flush=True,
        )
        return
    step = int(latest.read_text().strip())
    rest, skip = [], False
    for a in argv:  # the same command without its --resume [CHECKPOINT]: the line adds `--resume`
        if skip and a == resume_arg:
            skip = False
            continue
        skip = a == "--resume"
        if not skip and not a.startswith("--resume="):
            rest.append(a)
    print(
        f"last checkpoint: step {step} ({latest.parent / f'global_step_{step}'}) — resume with: "
        f"agl-lab train {shlex.join(rest)} --resume",
        flush=True,
    )


def _summarise(run_dir, history: list[dict], wall: float) -> None:
    """The run's last line: steps, minutes, mean training reward first k → last k steps."""
    rewards = [h["training/reward"] for h in history if "training/reward" in h]
    if not rewards:
        print(f"\ndone: no training steps in {wall / 60:.1f} min · metrics {run_dir / 'metrics.jsonl'}", flush=True)
        return
    png = run_dir / "reward_curve.png"  # written by fit()
    k = min(10, max(len(rewards) // 2, 1))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    skipped = sum(int(h.get("training/skipped_steps", 0)) for h in history)  # no update: each warned why
    print(
        f"\ndone: {len(rewards)} steps in {wall / 60:.1f} min · mean training reward "
        f"first {k} steps {first:.3f} → last {k} steps {last:.3f} · "
        + (f"{skipped} of {len(rewards)} steps skipped (no update; see their warnings) · " if skipped else "")
        + f"curve {png} · metrics {run_dir / 'metrics.jsonl'}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
