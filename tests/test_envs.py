"""Environments from the field: reasoning-gym datasets and GEM games as tasks by name.

Real packages (reasoning-gym, gem-llm, installed by ./lab from requirements-envs.txt), the real
tiny model, gateway and runner; `agl-lab train` by name for both.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from agl_lab import Trainer
from agl_lab.cli import train_main
from agl_lab.recording import load_recording
from agl_lab.tasks import get_task, rgym
from agl_lab.tasks.gem_games import gem_agent, play
from tests.fakes import Ctx, ScriptedClient
from tests.trainer_runs import SMALL

if importlib.util.find_spec("reasoning_gym") is None or importlib.util.find_spec("gem") is None:
    pytest.skip("the envs extra (requirements-envs.txt) is not installed", allow_module_level=True)

GAME = "game:GuessTheNumber-v0-easy"
GEM_KEYS = [
    "agentlightning.trace_aggregator.trajectory_max_prompt_length=1024",
    "agentlightning.trace_aggregator.trajectory_max_response_length=512",
    "agl_lab.task.max_turns=3",
    "agl_lab.model.warm_start_steps=60",  # the move format, from random-move episodes (gem_games.demonstration)
    # 16 episodes: after this short warm start about 1 in 3 gets past its first move (a malformed move
    # ends a GEM game), so at least one multi-turn episode is all but certain
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
]


# ------------------------------------------------------------------------------ reasoning-gym


@pytest.mark.parametrize("dataset", rgym.CHECKED_DATASETS)
def test_a_reasoning_gym_dataset_gives_tasks_and_its_own_verifier_scores_the_extracted_answer(dataset):
    task = get_task(f"reasoning_gym:{dataset}", {"size": 5, "seed": 3})
    train, val = task.train_tasks(7, seed=0), task.val_tasks(2, seed=0)
    assert len(train) == 7 and train[5]["question"] == train[0]["question"]  # size 5, cycled
    assert val[0]["question"] != train[0]["question"] or val[0]["seed"] != train[0]["seed"]
    json.dumps(train)  # the store takes the task dicts as JSON
    t = train[1]
    assert rgym.score(t, f"Let me think.\nAnswer: {t['answer']}") == 1.0
    assert rgym.score(t, "Answer: definitely not this") < 1.0


def test_answer_extraction_takes_the_last_answer_line_then_boxed_then_the_last_line():
    assert rgym.extract_answer("Answer: 3\nwait\nAnswer: 5 ") == "5"
    assert rgym.extract_answer("so \\boxed{12} it is") == "12"
    assert rgym.extract_answer("4\n 9 \n\n") == "9"
    assert rgym.extract_answer("") == ""


def test_the_dataset_config_reaches_the_generator_and_bad_names_and_keys_say_what_to_fix():
    task = get_task(
        "reasoning_gym:basic_arithmetic", {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    )
    for t in task.train_tasks(6, seed=0):
        assert t["question"].count("+") + t["question"].count("-") + t["question"].count("*") <= 2
    with pytest.raises(KeyError, match="no dataset 'no_such_set'"):
        get_task("reasoning_gym:no_such_set")
    with pytest.raises(ValueError, match="agl_lab.task.size"):
        get_task("reasoning_gym:basic_arithmetic", {"size": 0})
    with pytest.raises(ValueError, match="agl_lab.task.config"):
        get_task("reasoning_gym:basic_arithmetic", {"config": {"no_such_key": 1}})


def test_every_dataset_but_the_pycosat_ones_imports_and_the_placeholder_names_the_fix():
    names = rgym.dataset_names()
    assert len(names) > 90 and set(rgym.CHECKED_DATASETS) <= set(names)
    if rgym.pycosat_missing():
        with pytest.raises(ModuleNotFoundError, match="needs pycosat") as caught:
            rgym.import_reasoning_gym().create_dataset("zebra_puzzles", size=1, seed=0)[0]
        assert caught.value.name == "pycosat"


@pytest.mark.skipif(importlib.util.find_spec("pycosat") is not None, reason="pycosat is installed here")
def test_a_dataset_that_needs_the_missing_pycosat_is_refused_in_one_line_naming_the_fix(tmp_path, capsys):
    """#53 item 9: `agl-lab train` printed "no module named None: … must name a module importable"."""
    with pytest.raises(ValueError, match=r"reasoning_gym:zebra_puzzles: .*'zebra_puzzles' needs pycosat"):
        get_task("reasoning_gym:zebra_puzzles")
    mixed = {"config": {"datasets": [{"name": "basic_arithmetic", "weight": 1, "config": {}},
                                     {"name": "zebra_puzzles", "weight": 1, "config": {}}]}}  # fmt: skip
    with pytest.raises(ValueError, match="'zebra_puzzles' needs pycosat"):
        get_task("reasoning_gym:composite", mixed)
    args = [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / "run"),
        "agl_lab.task.name=reasoning_gym:zebra_puzzles",
    ]
    assert train_main(args) == 2
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("agl-lab train:")]
    assert len(said) == 1 and "`pip install pycosat` with a C compiler" in said[0], said
    assert "no module named" not in said[0]


@pytest.mark.timeout(900)
def test_agl_lab_train_runs_a_reasoning_gym_dataset_by_name(tmp_path, capsys):
    args = [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / "run"),
        *SMALL,
        "agl_lab.task.name=reasoning_gym:basic_arithmetic",
        "agl_lab.task.size=32",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=512",
        "trainer.total_training_steps=1",
    ]
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert "task reasoning_gym:basic_arithmetic" in out
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1
    assert line["training/n_rollouts"] == 8 and line["training/n_failed_rollouts"] == 0


# ------------------------------------------------------------------------------ GEM


def test_a_gem_episode_records_each_turn_reward_and_sums_them():
    task = get_task(f"gem:{GAME}", {"max_turns": 4}).train_tasks(1, seed=0)[0]
    client = ScriptedClient(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"])
    ctx = Ctx(client)
    total = gem_agent(task, ctx)
    turns = [d for kind, d in ctx.events if kind == "turn_reward"]
    assert 1 <= len(turns) <= 4 and [t["turn"] for t in turns] == list(range(len(turns)))
    assert total == pytest.approx(sum(t["reward"] for t in turns))
    assert turns[-1]["terminated"] or turns[-1]["truncated"] or len(turns) == 4
    # the observation is the next user message: the history only grows
    for before, after in zip(client.seen, client.seen[1:]):
        assert after[: len(before)] == before and after[-1]["role"] == "user"
    again = play(task, Ctx(ScriptedClient(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"])))
    assert again["rewards"] == [t["reward"] for t in turns]  # reset(seed): the same game


def test_importing_gem_leaves_the_root_logger_as_it_was():
    # gem's __init__ calls logging.basicConfig(level=INFO): httpx's INFO line per request would print
    code = (
        "import logging; from agl_lab.tasks.gem_games import import_gem; import_gem(); "
        "root = logging.getLogger(); print(len(root.handlers), logging.getLevelName(root.level))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "WARNING"]


def test_a_bad_gem_id_lists_the_games():
    with pytest.raises(KeyError, match="GuessTheNumber"):
        get_task("gem:game:NoSuchGame-v0")
    with pytest.raises(ValueError, match="agl_lab.task.max_turns"):
        get_task(f"gem:{GAME}", {"max_turns": 0})


@pytest.mark.timeout(900)
def test_a_gem_game_through_the_real_gateway_gives_one_row_per_rollout_with_observations_masked(tmp_path):
    tr = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=[*SMALL, *GEM_KEYS, f"agl_lab.task.name=gem:{GAME}", "agl_lab.server.token_preserving=true"],
        run_dir=tmp_path / "run",
        console=False,
    )
    try:
        rollouts = tr.rollout()
        batch = tr.build_batch(rollouts)
    finally:
        tr.close()
    rows = batch.rows
    assert len(rows) == 16 and rows["rollout_id"].is_unique  # one row per rollout
    multi = rows[rows["n_calls"] > 1]
    assert len(multi) > 0, "no episode took more than one turn"
    assert (multi["observation_tokens"] > 0).all() and (multi["loss_tokens"] > 0).all()
    assert len(batch.breaks) == 0


@pytest.mark.timeout(900)
def test_agl_lab_train_runs_a_gem_game_by_name_with_turn_credit_in_the_default_gateway_mode(tmp_path, capsys):
    args = [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / "run"),
        *SMALL,
        *GEM_KEYS,
        f"agl_lab.task.name=gem:{GAME}",
        "trainer.total_training_steps=1",
        "agentlightning.trace_aggregator.level=transition",
        "data.max_prompt_length=1024",
        "algorithm.enable_rollout_level_advantage=false",
        "agl_lab.algorithm.turn_credit=return",
        "agl_lab.algorithm.turn_gamma=0.9",
    ]
    assert train_main(args) == 0
    assert f"task gem:{GAME}" in capsys.readouterr().out
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["training/n_rollouts"] == 16 and line["training/n_failed_rollouts"] == 0
    assert line["training/turn_credit/n_rollouts_without_turn_rewards"] == 0
    rec = load_recording(tmp_path / "run", 1)
    for rollout in rec.rollouts:
        turns = [t.turn_reward for t in rollout.triplets]
        assert turns and all(r is not None for r in turns)  # one turn reward per call, on its call
        assert rollout.final_reward == pytest.approx(sum(turns))  # the rollout's reward: their sum
    assert any(len(r.triplets) > 1 for r in rec.rollouts), "no episode took more than one turn"
