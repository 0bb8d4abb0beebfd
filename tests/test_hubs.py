"""Environments from the field's hubs by name: TextArena games and OpenEnv environments in process
train a step on the tiny model through `agl-lab train`; verifiers is refused with the reason.

Real packages (textarena, openenv-core, installed by ./lab from requirements-envs.txt), the real
tiny model, gateway and runner. The OpenEnv environment is tests/hub_envs.py's HotCold, written as
OpenEnv's authors document one (its wheel ships no environment: they are servers or Hub downloads).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from agl_lab.cli import train_main
from agl_lab.config import ConfigError
from agl_lab.recording import load_recording
from agl_lab.tasks import get_task
from agl_lab.tasks import openenv_env as oe
from agl_lab.tasks import textarena_games as tg
from tests.fakes import Ctx, ScriptedClient
from tests.trainer_runs import SMALL

HAS_TEXTARENA = importlib.util.find_spec("textarena") is not None
HAS_OPENENV = importlib.util.find_spec("openenv") is not None and importlib.util.find_spec("fastmcp") is not None
needs_textarena = pytest.mark.skipif(not HAS_TEXTARENA, reason="textarena (requirements-envs.txt) is not installed")
needs_openenv = pytest.mark.skipif(not HAS_OPENENV, reason="openenv-core (requirements-envs.txt) is not installed")

GAME = "GuessTheNumber-v0"
HOT_COLD = "openenv:tests.hub_envs:HotCold"
ONE_STEP = [
    *SMALL,
    "trainer.total_training_steps=1",
    "agl_lab.task.max_turns=3",
    "agentlightning.trace_aggregator.trajectory_max_prompt_length=1024",
    "agentlightning.trace_aggregator.trajectory_max_response_length=512",
]


def _train_one_step(tmp_path, capsys, name):
    args = ["configs/cpu_tiny.yaml", "--run-dir", str(tmp_path / "run"), *ONE_STEP, f"agl_lab.task.name={name}"]
    assert train_main(args) == 0
    assert f"task {name}" in capsys.readouterr().out
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["training/n_rollouts"] == 8 and line["training/n_failed_rollouts"] == 0
    return load_recording(tmp_path / "run", 1)


# ------------------------------------------------------------------------------ TextArena


@needs_textarena
def test_a_textarena_game_rewards_at_its_end_only_and_each_user_turn_is_what_the_game_said_since():
    task = get_task(f"textarena:{GAME}", {"max_turns": 20}).train_tasks(1, seed=0)[0]
    moves = [f"[{n}]" for n in range(1, 21)]
    ctx = Ctx(ScriptedClient(moves))
    reward = tg.textarena_agent(task, ctx)
    turns = [d for kind, d in ctx.events if kind == "turn_reward"]
    # counting up from 1 finds the number (1..20) within the game's own 10 turns, or runs out of them
    assert [t["turn"] for t in turns] == list(range(len(turns))) and turns[-1]["terminated"]
    assert all(t["reward"] == 0.0 for t in turns[:-1]) and turns[-1]["reward"] == reward  # end-only
    seen = ScriptedClient(moves)
    episode = tg.play(task, Ctx(seen))
    assert episode["rewards"] == [t["reward"] for t in turns]  # reset(seed): the same game
    for before, after in zip(seen.seen, seen.seen[1:]):  # the history only grows
        assert after[: len(before)] == before
    second = seen.seen[1][-1]["content"]
    assert second.startswith("[Player] [1]") and "You are playing" not in second  # only the new part


@needs_textarena
def test_a_game_end_reward_that_is_no_number_is_an_event_a_task_result_flag_and_a_warning(caplog):
    # TextArena 0.7.4's Countdown hands its invalid-move reason over as the reward (arguments swapped)
    task = get_task("textarena:Countdown-v0", {"max_turns": 3}).train_tasks(1, seed=0)[0]
    ctx = Ctx(ScriptedClient(["no move", "no move", "no move"]))
    with caplog.at_level("WARNING", logger="agl_lab.tasks.textarena_games"):
        assert tg.textarena_agent(task, ctx) == 0.0
    fallbacks = [d for kind, d in ctx.events if kind == "reward_fallback"]
    assert len(fallbacks) == 1 and "Invalid action format" in fallbacks[0]["value"]
    result = [d for kind, d in ctx.events if kind == "task_result"][-1]
    assert result["reward_fallback"] is True and result["reward"] == 0.0
    assert "is no number; counted 0.0" in caplog.text


@needs_textarena
@pytest.mark.parametrize("game", tg.SINGLE_PLAYER_GAMES)
def test_each_single_player_game_the_docs_name_plays_a_scripted_turn(game):
    task = get_task(f"textarena:{game}", {"max_turns": 2}).train_tasks(1, seed=0)[0]
    episode = tg.play(task, Ctx(ScriptedClient(["[1]", "[2]"])))
    assert 1 <= episode["turns"] <= 2 and episode["messages"][1]["content"]


@needs_textarena
def test_textarena_games_that_cannot_be_played_here_are_refused_in_one_line():
    with pytest.raises(ValueError, match="Nim-v0: not a single-player game"):
        get_task("textarena:Nim-v0")
    with pytest.raises(ValueError, match="Wordle-v0: the game reads NLTK word lists"):
        get_task("textarena:Wordle-v0")  # refused from its source, before anything downloads
    with pytest.raises(KeyError, match="GuessTheNumber-v0"):
        get_task("textarena:NoSuchGame-v0")
    with pytest.raises(ValueError, match="agl_lab.task.max_turns"):
        get_task(f"textarena:{GAME}", {"max_turns": 0})


@needs_textarena
@pytest.mark.timeout(900)
def test_agl_lab_train_runs_a_textarena_game_by_name(tmp_path, capsys):
    rec = _train_one_step(tmp_path, capsys, f"textarena:{GAME}")
    for rollout in rec.rollouts:
        turns = [t.turn_reward for t in rollout.triplets]
        assert turns and all(r is not None for r in turns)
        assert all(r == 0.0 for r in turns[:-1])  # end-only


# ------------------------------------------------------------------------------ OpenEnv


@needs_openenv
def test_an_openenv_episode_sends_the_reply_as_the_action_and_records_each_step_reward():
    task = get_task(HOT_COLD, {"max_turns": 12}).train_tasks(1, seed=0)[0]
    client = ScriptedClient(["no idea", *[str(n) for n in range(1, 10)]])
    ctx = Ctx(client)
    total = oe.openenv_agent(task, ctx)
    turns = [d for kind, d in ctx.events if kind == "turn_reward"]
    # one reply without a number, then counting up: -0.1 a miss (mid-episode), 1.0 on the number
    assert [t["reward"] for t in turns] == [-0.1] * (len(turns) - 1) + [1.0] and turns[-1]["terminated"]
    assert total == pytest.approx(1.0 - 0.1 * (len(turns) - 1))
    assert client.seen[1][-1]["content"] == "No number in your reply. Reply with one number."
    assert client.seen[0][-1]["content"].startswith("Guess the hidden number from 1 to 9")


@needs_openenv
def test_openenv_names_that_are_no_in_process_environment_say_what_to_fix():
    with pytest.raises(ValueError, match="not a subclass of openenv"):
        get_task("openenv:tests.hub_envs:Guess")
    with pytest.raises(KeyError, match="write openenv:<module>:<Environment subclass>"):
        get_task("openenv:tests.hub_envs")
    with pytest.raises(ValueError, match="does not fit HotCold"):
        get_task(HOT_COLD, {"config": {"no_such_argument": 1}})
    assert get_task(HOT_COLD, {"config": {"low": 3, "high": 4}}).train_tasks(1)[0]["env_config"] == {
        "low": 3,
        "high": 4,
    }


@needs_openenv
@pytest.mark.timeout(900)
def test_agl_lab_train_runs_an_openenv_environment_in_process_by_name(tmp_path, capsys):
    rec = _train_one_step(tmp_path, capsys, HOT_COLD)
    for rollout in rec.rollouts:
        turns = [t.turn_reward for t in rollout.triplets]
        assert turns and all(r is not None for r in turns)  # one step reward per call, on its call
        assert rollout.final_reward == pytest.approx(sum(turns))


# ------------------------------------------------------------------------------ verifiers


def test_verifiers_is_refused_naming_the_package_and_why(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"verifiers:gsm8k is refused: verifiers 0\.4\.0 .*openai<3"):
        get_task("verifiers:gsm8k")
    args = ["configs/cpu_tiny.yaml", "--run-dir", str(tmp_path / "run"), "agl_lab.task.name=verifiers:gsm8k"]
    assert train_main(args) == 2
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("agl-lab train:")]
    assert len(said) == 1 and "verifiers 0.4.0 cannot install" in said[0], said
