"""GEM environments as tasks: `agl_lab.task.name=gem:<env id>` (docs/environments.md).

GEM (PyPI `gem-llm`, the `envs` extra; "a Gym for generalist LLMs") registers text environments
(`game:GuessTheNumber-v0-easy`, `game:Mastermind-v0-easy`, `rg:basic_arithmetic`, …) behind
`gem.make(env_id)`, `reset(seed) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)`. `gem_agent` plays one
episode through the gateway:

    system     SYSTEM_PROMPT
    user       the reset observation                       ┐ one model call per step; the
    assistant  the action (the reply text, passed to step)  │ history grows append-only, so
    user       the step's observation (+ info["suffix"])    │ token-preserving mode merges
    assistant  …                                            ┘ the turns into one row

It ends on terminated or truncated, or after `agl_lab.task.max_turns` calls (default
DEFAULT_MAX_TURNS). Each step's reward is a `turn_reward` event `{turn, reward, terminated,
truncated}`; the rollout's reward is their sum. A task dict is `{task_id, env_id, seed,
max_turns, env_config}`: the episode is `reset(seed=seed)`, so a GRPO group plays one game.

GEM's `reset(seed)` seeds Python's global `random` (and numpy's) before the game draws its state,
so resets are serialized under a lock: the runner plays rollouts in threads.

The task's demonstrations (for `agl_lab.model.warm_start_steps`) are episodes played with the
environment's own `sample_random_action()`: the tiny model from random weights learns the move
format from them (every GEM game ends the episode on a malformed move) and then plays several turns.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

from agl_lab.quiet import root_logging_kept

PREFIX = "gem:"
DEFAULT_MAX_TURNS = 8
MAX_TOKENS = 48
MODEL_NAME = "auto"
SYSTEM_PROMPT = "You are playing a game. Follow its instructions exactly and reply with your move."
VAL_SEED_OFFSET = 1_000_003
CHECKED_ENVS = ("game:GuessTheNumber-v0-easy",)

_RESET_LOCK = threading.Lock()


def import_gem() -> Any:
    """The `gem` module; ModuleNotFoundError naming the extra when gem-llm is not installed.

    Use it outside a Trainer too (a script, a notebook cell): gem imports reasoning_gym, which
    imports `pycosat` (no wheel for Python 3.11), so a bare `import gem` fails where pycosat is
    missing; this puts agl_lab's placeholder in place first, and `import gem` works after it."""
    from agl_lab.tasks.rgym import import_reasoning_gym

    import_reasoning_gym()  # gem imports reasoning_gym (its rg: environments) at import
    try:
        with root_logging_kept():  # gem's __init__ calls logging.basicConfig(level=INFO)
            import gem
    except ImportError as e:
        raise ModuleNotFoundError(
            f"agl_lab.task.name=gem:... needs gem-llm and its pure-Python dependencies ({e}): `./lab test` "
            "installs them, or `pip install --no-deps -r requirements-envs.txt` (docs/environments.md)",
            name=e.name,
        ) from e
    return gem


def env_ids() -> list[str]:
    """Every environment id GEM registers."""
    import_gem()
    from gem.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


def make_env(task: dict[str, Any]) -> tuple[Any, str, dict[str, Any]]:
    """A fresh environment for a task dict, reset to its seed: (env, observation, info)."""
    gem = import_gem()
    env = gem.make(task["env_id"], **dict(task.get("env_config") or {}))
    with _global_rng_kept():
        observation, info = env.reset(seed=int(task["seed"]))
    return env, str(observation), dict(info or {})


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Under the reset lock, and with Python's and numpy's global RNG states put back afterwards:
    GEM's reset(seed) reseeds them, which must not reach the rest of the process."""
    import numpy as np

    with _RESET_LOCK:
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def play(task: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """One episode through the gateway: `{rewards, turns, terminated, truncated, messages}`."""
    from agl_lab.tasks.lookup import openai_client

    client = openai_client(ctx)
    env, observation, _ = make_env(task)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": observation},
    ]
    emit = getattr(ctx, "emit", None)
    cancelled = getattr(ctx, "cancelled", None)
    rewards: list[float] = []
    terminated = truncated = False
    for turn in range(int(task.get("max_turns") or DEFAULT_MAX_TURNS)):
        if cancelled is not None and cancelled.is_set():
            break
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
        )
        action = (resp.choices[0].message.content if resp.choices else None) or ""
        observation, reward, terminated, truncated, info = env.step(action)
        rewards.append(float(reward))
        if callable(emit):
            emit(
                "turn_reward",
                {"turn": turn, "reward": float(reward), "terminated": bool(terminated), "truncated": bool(truncated)},
            )
        messages.append({"role": "assistant", "content": action})
        if terminated or truncated:
            break
        suffix = (info or {}).get("suffix")
        messages.append({"role": "user", "content": f"{observation}\n{suffix}" if suffix else str(observation)})
    return {
        "rewards": rewards,
        "turns": len(rewards),
        "terminated": bool(terminated),
        "truncated": bool(truncated),
        "messages": messages,
    }


def demonstration(task: dict[str, Any]) -> list[dict[str, str]]:
    """One episode of a task played with the environment's own `sample_random_action()` (a
    well-formed, mostly poor move): the transcript a warm start fits so a model from random
    weights (the tiny one) learns the move format and plays more than one turn."""
    env = import_gem().make(task["env_id"], **dict(task.get("env_config") or {}))
    with _global_rng_kept():  # the whole episode: sample_random_action draws from the seeded global RNG
        observation, _ = env.reset(seed=int(task["seed"]))
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(observation)}]
        for _ in range(int(task.get("max_turns") or DEFAULT_MAX_TURNS)):
            action = str(env.sample_random_action())
            observation, _, terminated, truncated, info = env.step(action)
            messages.append({"role": "assistant", "content": action})
            if terminated or truncated:
                break
            suffix = (info or {}).get("suffix")
            messages.append({"role": "user", "content": f"{observation}\n{suffix}" if suffix else str(observation)})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages


def gem_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """One GEM episode; the rollout's reward is the sum of its turn rewards (None when cancelled first)."""
    return finish_episode(play(task, ctx), ctx)


def finish_episode(episode: dict[str, Any], ctx: Any, **extra: Any) -> float | None:
    """The reward of a played episode, the sum of its turn rewards (None when cancelled before its first
    turn), recorded as a `task_result` event `{reward, turns, terminated, truncated, **extra}`; the
    agents of gem, textarena and openenv end with it."""
    if not episode["rewards"]:
        return None
    total = float(sum(episode["rewards"]))
    emit = getattr(ctx, "emit", None)
    if callable(emit):
        emit("task_result", {"reward": total, **{k: episode[k] for k in ("turns", "terminated", "truncated")}, **extra})
    return total


def episode_tasks(
    n: int, seed: int, split: str, *, prefix: str, env: dict[str, str], options: tuple[int, dict[str, Any], int | None]
) -> list[dict[str, Any]]:
    """`n` task dicts `{task_id, <env key>, seed, max_turns, env_config}` of one split ("train", "val",
    "demo"), one game seed each; `options` is (max_turns, config, fixed seed or None) as checked by
    `episode_options`. Shared by gem, textarena and openenv."""
    max_turns, config, fixed_seed = options
    offset = {"train": 0, "val": VAL_SEED_OFFSET, "demo": 2 * VAL_SEED_OFFSET}[split]
    base = (fixed_seed if fixed_seed is not None else seed) + offset
    return [
        {
            "task_id": f"{prefix}-{split}-{base}-{i:05d}",
            **env,
            "seed": (base * 100_003 + i) % 2**31,  # numpy's seed range
            "max_turns": max_turns,
            "env_config": config,
        }
        for i in range(n)
    ]


def episode_options(options: Any, config_means: str) -> tuple[int, dict[str, Any], int | None]:
    """(max_turns, config, seed) from `agl_lab.task` (a mapping or None), checked; gem, textarena and openenv read theirs with it."""
    get = (lambda key: options.get(key)) if options is not None else (lambda key: None)
    max_turns, config, seed = get("max_turns"), get("config"), get("seed")
    max_turns = DEFAULT_MAX_TURNS if max_turns is None else max_turns
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"agl_lab.task.max_turns must be a positive integer, got {max_turns!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"agl_lab.task.seed must be an integer or null, got {seed!r}")
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else (config or {})
    if not isinstance(config, dict):
        raise ValueError(f"agl_lab.task.config must be a mapping ({config_means}), got {config!r}")
    return max_turns, dict(config), seed


def gem_task(env_id: str, options: Any = None) -> Any:
    """The `Task` for GEM's `env_id`: tasks are seeds (one game each), the agent `gem_agent`."""
    from agl_lab.tasks import Task

    ids = env_ids()
    if env_id not in ids:
        games = [i for i in ids if i.startswith("game:")]
        raise KeyError(
            f"GEM has no environment {env_id!r} (agl_lab.task.name={PREFIX}{env_id}); its games: {', '.join(games)}"
        )
    max_turns, config, fixed_seed = episode_options(options, "a GEM env's keyword arguments")
    json.dumps(config)  # the task dict travels as JSON

    options = (max_turns, config, fixed_seed)

    def make(n: int, seed: int, split: str) -> list[dict[str, Any]]:
        return episode_tasks(n, seed, split, prefix=f"gem-{env_id}", env={"env_id": env_id}, options=options)

    def demonstrations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
        return [demonstration(t) for t in make(n, seed, "demo")]

    return Task(
        name=f"gem.{env_id.replace(':', '.')}",
        demonstrations=demonstrations,
        description=f"GEM's {env_id!r}, one model call per step, turn rewards summed (agl_lab/tasks/gem_games.py).",
        agent=gem_agent,
        train_tasks=lambda n, seed=0: make(n, seed, "train"),
        val_tasks=lambda n, seed=0: make(n, seed, "val"),
    )
