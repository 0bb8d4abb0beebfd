"""OpenEnv environments in process as tasks: `agl_lab.task.name=openenv:<module>:<Class>` (docs/environments.md).

OpenEnv (PyPI `openenv-core`, the `envs` extra; the environment API TRL supports) defines an
environment as a subclass of `openenv.core.env_server.interfaces.Environment[Action, Observation,
State]` with `reset(seed) -> Observation` and `step(action) -> Observation`, the observation
carrying `done` and `reward` (pydantic models). Its wheel ships the API, not environments: the
published ones run as HTTP/Docker servers or are fetched from the Hugging Face Hub (`AutoEnv`),
neither of which agl_lab does at run time. agl_lab runs an `Environment` subclass **in process**,
named by its import path, one fresh instance per rollout (`Class(**agl_lab.task.config)`):

    system     SYSTEM_PROMPT
    user       the reset observation as text       ┐ one model call per step; the reply text
    assistant  the reply → Action(<its text field>) │ fills the action's one required str field;
    user       the step's observation as text       ┘ the history grows append-only

An observation as text: its one string field, else `key: value` lines of its fields (`done`,
`reward` and `metadata` left out). Each step's `observation.reward` (None: 0.0) is a `turn_reward`
event `{turn, reward, terminated, truncated}` — mid-episode wherever the environment rewards a
step — and the rollout's reward is their sum. The episode ends on `done` or after
`agl_lab.task.max_turns` calls. A task dict is `{task_id, env_ref, seed, max_turns, env_config}`;
the episode is `reset(seed=seed)`, so a GRPO group plays one episode start.
"""

from __future__ import annotations

import importlib
import typing
from typing import Any

PREFIX = "openenv:"
MAX_TOKENS = 48
MODEL_NAME = "auto"
SYSTEM_PROMPT = "You are acting in an environment. Follow its instructions exactly and reply with your action."
_NOT_TEXT = ("done", "reward", "metadata")


def import_openenv() -> Any:
    """OpenEnv's `Environment` base class; ModuleNotFoundError naming the extra when it is missing."""
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError as e:
        raise ModuleNotFoundError(
            f"agl_lab.task.name=openenv:... needs openenv-core and its pure-Python dependencies ({e}): "
            "`./lab test` installs them, or `pip install --no-deps -r requirements-envs.txt` (docs/environments.md)",
            name=e.name,
        ) from e
    return Environment


def environment_class(ref: str) -> type:
    """The `Environment` subclass `module:Class` names; KeyError / ValueError saying what to fix."""
    base = import_openenv()
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise KeyError(f"agl_lab.task.name={PREFIX}{ref}: write {PREFIX}<module>:<Environment subclass>")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{PREFIX}{ref} is {obj!r}, not a subclass of openenv.core.env_server.interfaces.Environment")
    return obj


def action_of(env_cls: type) -> tuple[type, str]:
    """(the Action class, its text field): the first type argument of `Environment[...]` in the
    class's bases, whose one required `str` field takes the reply text."""
    base = import_openenv()
    for klass in env_cls.__mro__:
        for orig in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(orig) is base and typing.get_args(orig):
                action = typing.get_args(orig)[0]
                fields = [
                    name
                    for name, info in getattr(action, "model_fields", {}).items()
                    if info.is_required() and info.annotation is str
                ]
                if isinstance(action, type) and len(fields) == 1:
                    return action, fields[0]
                raise ValueError(
                    f"{PREFIX}{env_cls.__module__}:{env_cls.__name__}: its action {action!r} needs exactly one "
                    f"required str field for the reply text (has {fields})"
                )
    raise ValueError(
        f"{PREFIX}{env_cls.__module__}:{env_cls.__name__} does not subclass Environment[ActionClass, ...]: "
        "agl_lab reads the action class from that type argument"
    )


def observation_text(observation: Any) -> str:
    """The observation as text: its one string field, else `key: value` lines of its fields."""
    fields = {k: v for k, v in observation.model_dump().items() if k not in _NOT_TEXT}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def play(task: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """One episode through the gateway: `{rewards, turns, terminated, truncated, messages}`."""
    from agl_lab.tasks.lookup import openai_client

    client = openai_client(ctx)
    env_cls = environment_class(task["env_ref"])
    action_cls, text_field = action_of(env_cls)
    env = env_cls(**dict(task.get("env_config") or {}))
    observation = env.reset(seed=int(task["seed"]))
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": observation_text(observation)},
    ]
    emit, cancelled = getattr(ctx, "emit", None), getattr(ctx, "cancelled", None)
    rewards: list[float] = []
    done = False
    max_turns = int(task["max_turns"])
    try:
        for turn in range(max_turns):
            if cancelled is not None and cancelled.is_set():
                break
            resp = client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0
            )
            reply = resp.choices[0].message.content or ""
            observation = env.step(action_cls(**{text_field: reply}))
            done = bool(observation.done)
            rewards.append(float(observation.reward or 0.0))
            if callable(emit):
                truncated = not done and turn == max_turns - 1
                emit("turn_reward", {"turn": turn, "reward": rewards[-1], "terminated": done, "truncated": truncated})
            messages.append({"role": "assistant", "content": reply})
            if done:
                break
            messages.append({"role": "user", "content": observation_text(observation)})
    finally:
        env.close()
    truncated = not done and len(rewards) == max_turns
    return {"rewards": rewards, "turns": len(rewards), "terminated": done, "truncated": truncated, "messages": messages}


def openenv_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """One OpenEnv episode; the rollout's reward is the sum of its step rewards (None when cancelled first)."""
    from agl_lab.tasks.gem_games import finish_episode

    return finish_episode(play(task, ctx), ctx)


def openenv_task(ref: str, options: Any = None) -> Any:
    """The `Task` for the in-process OpenEnv environment `module:Class`: tasks are seeds, the agent `openenv_agent`."""
    from agl_lab.tasks import Task
    from agl_lab.tasks.gem_games import episode_options, episode_tasks

    env_cls = environment_class(ref)
    action_of(env_cls)  # refused now, not in the first rollout
    max_turns, config, fixed_seed = episode_options(options, f"keyword arguments of {env_cls.__name__}()")
    try:
        env_cls(**config).close()
    except TypeError as e:
        raise ValueError(f"agl_lab.task.config does not fit {env_cls.__name__}(): {e}") from e

    options = (max_turns, config, fixed_seed)

    def make(n: int, seed: int, split: str) -> list[dict[str, Any]]:
        return episode_tasks(
            n, seed, split, prefix=f"openenv-{env_cls.__name__}", env={"env_ref": ref}, options=options
        )

    return Task(
        name=f"openenv.{ref.replace(':', '.')}",
        description=f"the OpenEnv environment {ref!r} in process, one model call per step, step rewards summed "
        "(agl_lab/tasks/openenv_env.py).",
        agent=openenv_agent,
        train_tasks=lambda n, seed=0: make(n, seed, "train"),
        val_tasks=lambda n, seed=0: make(n, seed, "val"),
    )
