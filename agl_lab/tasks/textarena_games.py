"""TextArena games as tasks: `agl_lab.task.name=textarena:<game id>` (docs/environments.md).

TextArena (PyPI `textarena`, the `envs` extra) registers ~700 text games behind `ta.make(id)`,
`reset(num_players, seed)`, `get_observation() -> (player, text)`, `step(action) -> (done, info)`
and `close() -> (rewards, game_info)`. agl_lab plays its **single-player** games (GuessTheNumber,
Mastermind, TowerOfHanoi, Countdown, Minesweeper, FrozenLake, Sudoku, LightsOut, Bandit, …);
a game for two or more players is refused when its task is made. `textarena_agent` plays one
episode through the gateway:

    system     SYSTEM_PROMPT
    user       the reset observation (the game's instructions)   ┐ one model call per step; the
    assistant  the move (the reply text, passed to step)          │ history grows append-only
    user       what the game said since the last move             ┘ (token-preserving mode merges)

TextArena's default wrappers accumulate the whole game log into each observation; the next user
message is only its new part (it starts with the game's echo of the move, `[Player] [5]`).
The default wrappers also put a move without `[...]` in brackets, so a reply is always a move.

Rewards are **end-only**: a single-player game sets its reward once, when it ends (GuessTheNumber:
1 for the number; on its second invalid move or at its own turn limit, how close the last valid
guess was, 1 - |guess - target| / 19, 0.0 with none). Each step is a `turn_reward` event `{turn,
reward, terminated, truncated}` — 0.0 until the last — and the rollout's reward is the game's
reward, 0.0 when `agl_lab.task.max_turns` calls end the episode before the game does (truncated).

`reset(seed)` calls `random.seed(seed)` on Python's global RNG, so resets run under GEM's lock
with the global RNG state put back afterwards (gem_games._global_rng_kept): one rule for both hubs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)

PREFIX = "textarena:"
DEFAULT_MAX_TURNS = 8
MAX_TOKENS = 48
MODEL_NAME = "auto"
SYSTEM_PROMPT = "You are playing a game. Follow its instructions exactly and reply with your move."
# Single-player games that make, reset and step as installed (tests/test_hubs.py plays each); 55
# of the registry's non-variant ids are single-player and playable here (docs/environments.md).
SINGLE_PLAYER_GAMES = (
    "GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "Countdown-v0", "Minesweeper-v0-small", "FrozenLake-v0",
    "Sudoku-v0-easy", "LightsOut-v0", "Bandit-v0", "2048-v0-easy", "Sokoban-v0", "FifteenPuzzle-v0", "Blackjack-v0",
)  # fmt: skip


def import_textarena() -> Any:
    """The `textarena` module; ModuleNotFoundError naming the extra when it is not installed."""
    try:
        import textarena
    except ImportError as e:
        raise ModuleNotFoundError(
            f"agl_lab.task.name=textarena:... needs textarena and its pure-Python dependencies ({e}): "
            "`./lab test` installs them, or `pip install --no-deps -r requirements-envs.txt` (docs/environments.md)",
            name=e.name,
        ) from e
    return textarena


def game_ids() -> list[str]:
    """Every game id TextArena registers (single- and multi-player)."""
    import_textarena()
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


def _text(observation: Any) -> str:
    """An observation as text: the default wrappers give a string, `-raw` ids a list of
    (sender, message, type) tuples."""
    if isinstance(observation, str):
        return observation
    return "\n".join(str(item[1]) if isinstance(item, (tuple, list)) else str(item) for item in observation or [])


def make_env(task: dict[str, Any]) -> tuple[Any, str]:
    """A fresh single-player game for a task dict, reset to its seed: (env, first observation)."""
    from agl_lab.tasks.gem_games import _global_rng_kept

    env = import_textarena().make(task["env_id"], **dict(task.get("env_config") or {}))
    with _global_rng_kept():
        env.reset(num_players=1, seed=int(task["seed"]))
    _, observation = env.get_observation()
    return env, _text(observation)


def _new_part(observation: str, before: str) -> str:
    """What the game said since `before` (the whole observation when it does not extend it)."""
    new = observation[len(before) :] if observation.startswith(before) else observation
    return new.strip("\n") or observation


def _game_reward(value: Any) -> tuple[float, str | None]:
    """The player's end reward as a float, and None; (0.0, the value's repr) for a value that is no
    number (TextArena 0.7.4's Countdown passes its invalid-move reason as the reward: the arguments of
    set_invalid_move swapped). The caller records that fallback (an event, the task_result, a warning)."""
    try:
        return float(value), None
    except (TypeError, ValueError):
        return 0.0, repr(value)


def play(task: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """One episode through the gateway: `{rewards, turns, terminated, truncated, reward, messages}`."""
    from agl_lab.tasks.lookup import openai_client

    client = openai_client(ctx)
    env, observation = make_env(task)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": observation.strip("\n")}]
    emit, cancelled = getattr(ctx, "emit", None), getattr(ctx, "cancelled", None)
    rewards: list[float] = []
    done, final, fallback = False, 0.0, None
    max_turns = int(task.get("max_turns") or DEFAULT_MAX_TURNS)
    for turn in range(max_turns):
        if cancelled is not None and cancelled.is_set():
            break
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
        )
        action = resp.choices[0].message.content or ""
        done, _ = env.step(action)
        if done:  # Critical: the game's reward exists only once it has ended (end-only)
            game_rewards, _ = env.close()
            final, fallback = _game_reward((game_rewards or {}).get(0, 0.0))
            if fallback is not None:
                _log.warning("%s: the game's end reward %s is no number; counted 0.0", task.get("env_id"), fallback)
                if callable(emit):
                    emit("reward_fallback", {"turn": turn, "value": fallback, "reward": 0.0})
        rewards.append(final if done else 0.0)
        if callable(emit):
            truncated = not done and turn == max_turns - 1
            emit("turn_reward", {"turn": turn, "reward": rewards[-1], "terminated": done, "truncated": truncated})
        messages.append({"role": "assistant", "content": action})
        if done:
            break
        _, now = env.get_observation()
        now = _text(now)
        messages.append({"role": "user", "content": _new_part(now, observation)})
        observation = now
    truncated = not done and len(rewards) == max_turns
    return {"rewards": rewards, "turns": len(rewards), "terminated": done, "truncated": truncated,
            "reward": final, "reward_fallback": fallback, "messages": messages}  # fmt: skip


def textarena_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """One TextArena episode; the rollout's reward is the game's end reward (None when cancelled first).
    Its `task_result` says `reward_fallback`: whether that reward was no number and counted 0.0."""
    from agl_lab.tasks.gem_games import finish_episode

    episode = play(task, ctx)
    return finish_episode(episode, ctx, reward_fallback=episode["reward_fallback"] is not None)


def _reads_nltk(game_id: str) -> bool:
    """Whether the game's package mentions NLTK, whose word lists these games fetch (`nltk.download`)
    when they are imported: read from its source files, so nothing is imported or fetched."""
    ta = import_textarena()
    from textarena.envs.registration import ENV_REGISTRY

    entry = ENV_REGISTRY[game_id].entry_point
    if not isinstance(entry, str):
        return False
    parts = entry.split(":")[0].split(".")[1:-1]  # textarena.envs.Wordle.env → envs/Wordle
    folder = Path(ta.__file__).parent.joinpath(*parts)
    return any("nltk" in path.read_text(errors="replace") for path in folder.rglob("*.py"))


def _refuse_unplayable(game_id: str, config: dict[str, Any]) -> None:
    """ValueError (`agl-lab train`: one line, exit 2) when the game cannot be played here: it reads
    NLTK data (a download), it is for two or more players, or it fails to make or reset as installed."""
    name = f"agl_lab.task.name={PREFIX}{game_id}"
    if _reads_nltk(game_id):
        raise ValueError(
            f"{name}: the game reads NLTK word lists, which it downloads when imported (agl_lab fetches "
            "nothing at run time); pick another game"
        )
    from agl_lab.tasks.gem_games import _global_rng_kept

    try:
        env = import_textarena().make(game_id, **config)
        with _global_rng_kept():
            env.reset(num_players=1, seed=0)
    except AssertionError as e:  # "The number of players has to be 2, received 1"
        raise ValueError(
            f"{name}: not a single-player game ({e}); agl_lab plays TextArena's single-player games"
        ) from e
    except Exception as e:
        raise ValueError(
            f"{name}: TextArena cannot make and reset this game as installed: {type(e).__name__}: {e}"
        ) from e
    from textarena.state import SinglePlayerState

    if not isinstance(env.state, SinglePlayerState):
        raise ValueError(f"{name}: not a single-player game; agl_lab plays TextArena's single-player games")


def textarena_task(game_id: str, options: Any = None) -> Any:
    """The `Task` for TextArena's `game_id`: tasks are seeds (one game each), the agent `textarena_agent`."""
    from agl_lab.tasks import Task

    if game_id not in game_ids():
        raise KeyError(
            f"TextArena has no game {game_id!r} (agl_lab.task.name={PREFIX}{game_id}); single-player games "
            f"agl_lab plays: {', '.join(SINGLE_PLAYER_GAMES)}, … (textarena_games.game_ids() lists every id)"
        )
    from agl_lab.tasks.gem_games import episode_options, episode_tasks

    max_turns, config, fixed_seed = episode_options(options, "a TextArena game's keyword arguments")
    _refuse_unplayable(game_id, config)

    options = (max_turns, config, fixed_seed)

    def make(n: int, seed: int, split: str) -> list[dict[str, Any]]:
        return episode_tasks(n, seed, split, prefix=f"ta-{game_id}", env={"env_id": game_id}, options=options)

    return Task(
        name=f"textarena.{game_id}",
        description=f"TextArena's {game_id!r}, one model call per move, the game's end reward "
        "(agl_lab/tasks/textarena_games.py).",
        agent=textarena_agent,
        train_tasks=lambda n, seed=0: make(n, seed, "train"),
        val_tasks=lambda n, seed=0: make(n, seed, "val"),
    )
