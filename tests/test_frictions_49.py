"""Issue #49 item 5, the medium frictions a researcher met: the flat-reward warning names credit
assignment when the task had signal before, warnings number steps as the console does (from 1),
and `gem` imports outside a Trainer through `agl_lab.tasks.gem_games.import_gem()`."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import re
import subprocess
import sys
import threading

import pytest

from agl_lab.config import load_config
from agl_lab.records import CompletedRollout
from agl_lab.tasks.lookup import lookup_agent
from agl_lab.trainer import Trainer
from agl_lab.watch import FlatRewardWatch, for_run
from tests.trainer_runs import SMALL

# ---------------------------------------------------------------------------------------------
# The flat-reward warning after a collapse
# ---------------------------------------------------------------------------------------------


def _rollouts(rewards_by_group: dict[str, list[float]]) -> list[CompletedRollout]:
    return [
        CompletedRollout(rollout_id=f"{g}{k}", data_id=g, step=0, sample_idx=k, state="succeeded", final_reward=r)
        for g, rewards in rewards_by_group.items()
        for k, r in enumerate(rewards)
    ]


def _collapse(watch: FlatRewardWatch, first: dict[str, list[float]]) -> str:
    """Step 1 with `first`, then three steps where every rollout scores 1.0: the warning."""
    assert watch.observe_rollouts(1, _rollouts(first)) is None
    assert watch.observe_rollouts(2, _rollouts({"a": [1.0, 1.0], "b": [1.0, 1.0]})) is None
    assert watch.observe_rollouts(3, _rollouts({"a": [1.0, 1.0], "b": [1.0, 1.0]})) is None
    return watch.observe_rollouts(4, _rollouts({"a": [1.0, 1.0], "b": [1.0, 1.0]}))


def test_a_collapse_under_return_names_credit_assignment(caplog):
    with caplog.at_level(logging.WARNING, logger="agl_lab.watch"):
        message = _collapse(FlatRewardWatch(3, turn_credit="return"), {"a": [0.0, 1.0], "b": [1.0, 1.0]})
    assert message.startswith("steps 2–4: every rollout got reward 1.000, 3 steps in a row")
    assert "different rewards within a group up to step 1" in message and "collapsed onto one outcome" in message
    assert "possible cause is credit assignment (agl_lab.algorithm.turn_credit=return" in message
    assert "turn_credit=rollout" in message
    assert "make rewards vary within a group" not in message  # the task is not what failed
    assert [r.getMessage() for r in caplog.records] == [message]


def test_a_collapse_under_rollout_credit_says_the_task_had_signal_but_not_credit():
    message = _collapse(FlatRewardWatch(3), {"a": [0.0, 1.0], "b": [1.0, 1.0]})
    assert "up to step 1" in message and "credit assignment" not in message


def test_a_task_that_never_gave_signal_keeps_the_task_advice():
    # step 1's rewards differ across groups only: every group had advantage 0, no signal yet
    message = _collapse(FlatRewardWatch(3, turn_credit="return"), {"a": [0.0, 0.0], "b": [1.0, 1.0]})
    assert "make rewards vary within a group" in message
    assert "credit assignment" not in message and "collapsed" not in message


def test_the_trainer_watch_knows_the_runs_turn_credit():
    overrides = [
        "agentlightning.trace_aggregator.level=transition",
        "algorithm.enable_rollout_level_advantage=false",
        "agl_lab.algorithm.turn_credit=return",
    ]
    assert for_run(load_config("configs/cpu_tiny.yaml", overrides), None, engine_given=True).turn_credit == "return"
    assert for_run(load_config("configs/cpu_tiny.yaml"), None, engine_given=True).turn_credit == "rollout"


# ---------------------------------------------------------------------------------------------
# Warnings number steps as the console does
# ---------------------------------------------------------------------------------------------


def _half_failing_agent():
    counter, lock = itertools.count(), threading.Lock()

    def agent(task, ctx):
        reward = lookup_agent(task, ctx)
        with lock:
            k = next(counter)
        if k % 2 == 0:
            raise RuntimeError("the tool server went away after the model call")
        return reward

    return agent


def test_the_first_steps_warnings_say_step_1(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        with Trainer.from_config(
            "configs/cpu_tiny.yaml", overrides=SMALL, agent=_half_failing_agent(), run_dir=tmp_path, console=False
        ) as tr:
            tr.step()
            assert tr.global_step == 1  # the console's line of this step reads "step    1"
    numbered = [r.getMessage() for r in caplog.records if re.match(r"step \d+", r.getMessage())]
    # the rollout stage's failure line and the batch's "trained with reward 0" line, at least
    assert len(numbered) >= 2, numbered
    assert all(m.startswith("step 1") for m in numbered), numbered


def test_rows_dropped_for_a_long_prompt_are_said_with_the_key_to_raise(tmp_path, caplog):
    # met rerunning the #49 study: GuessTheNumber at transition level under cpu_tiny's 256-token
    # prompts dropped every row, and the only line was "no trainable rows left after the marked drop"
    overrides = [*SMALL, "agentlightning.trace_aggregator.trajectory_max_prompt_length=8"]
    with caplog.at_level(logging.WARNING, logger="agl_lab.rollout_problems"):
        with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path, console=False) as tr:
            metrics = tr.step()
    (line,) = [r.getMessage() for r in caplog.records if "prompt is longer" in r.getMessage()]
    n = metrics["training/n_dropped_prompt_too_long"]
    assert n == metrics["training/n_sample"] > 0  # every prompt of lookup is over 8 tokens
    assert metrics["training/skipped_steps"] == 1
    assert line == (
        f"step 1: {n} of {n} rows dropped: their prompt is longer than "
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=8 (training/n_dropped_prompt_too_long); "
        "raise it to train on them"
    )


# ---------------------------------------------------------------------------------------------
# gem outside a Trainer
# ---------------------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("gem") is None, reason="gem-llm not installed (the envs extra)")
def test_import_gem_outside_a_trainer_plays_a_game():
    done = _python(
        "from agl_lab.tasks.gem_games import import_gem; gem = import_gem(); import gem as again; "
        "assert again is gem; env = gem.make('game:GuessTheNumber-v0-easy'); obs, info = env.reset(seed=1); "
        "print('ok', type(obs).__name__)"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok str"


@pytest.mark.skipif(
    importlib.util.find_spec("gem") is None or importlib.util.find_spec("pycosat") is not None,
    reason="needs gem-llm installed and pycosat missing (the case the docs describe)",
)
def test_a_bare_import_gem_fails_on_pycosat_as_the_docs_say():
    done = _python("import gem")
    assert done.returncode != 0 and "No module named 'pycosat'" in done.stderr


# ---------------------------------------------------------------------------------------------
# A run that waits for another's warm start says so
# ---------------------------------------------------------------------------------------------


def test_a_run_waiting_on_the_warm_start_lock_says_so(tmp_path, capsys):
    import fcntl

    from agl_lab.engines.warmstart import cache_lock

    path = tmp_path / "warmstart-x.pt"
    entered = threading.Event()
    with open(tmp_path / "warmstart-x.pt.lock", "a") as other:  # "another process" holds the lock
        fcntl.flock(other, fcntl.LOCK_EX)

        def wait() -> None:
            with cache_lock(path):
                entered.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert not entered.wait(1.0)  # it waits for the holder…
        fcntl.flock(other, fcntl.LOCK_UN)
    waiter.join(10)
    assert entered.is_set()
    err = capsys.readouterr().err  # …and said why, once
    assert err.count("waiting for another process computing warmstart-x.pt") == 1
    with cache_lock(path):  # a free lock: nothing said
        pass
    assert capsys.readouterr().err == ""


def test_the_runs_last_line_says_how_many_steps_were_skipped(tmp_path, capsys):
    # met rerunning the #49 study: four skipped steps ended in "done: 4 steps … reward 0.424 → 0.503"
    from agl_lab.cli import _summarise

    history = [{"training/reward": 0.5, "training/skipped_steps": int(s in (1, 2))} for s in range(4)]
    _summarise(tmp_path, history, 60.0)
    assert "· 2 of 4 steps skipped (no update; see their warnings) ·" in capsys.readouterr().out
    _summarise(tmp_path, [{"training/reward": 0.5, "training/skipped_steps": 0}], 60.0)
    assert "skipped" not in capsys.readouterr().out
