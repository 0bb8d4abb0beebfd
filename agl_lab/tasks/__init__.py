"""Tasks: the built-in `lookup` and your own, registered under a name a config can use.

A task is what a config names (`agl_lab.task.name: lookup`); `get_task(name)` returns its
`Task`: the datasets, the default agent (plus named variants), the reward and the
demonstration transcripts the warm start fits. Every agent is a plain `agent(task, ctx)`
written with the `openai` SDK against `ctx.base_url` — the same code would run unchanged
against any OpenAI-compatible endpoint, which is the point of the gateway.

    spec = get_task("lookup")
    tasks = spec.train_tasks(64, seed=0)
    reward = spec.agent(tasks[0], ctx)          # ctx: agl_lab.agent.AgentContext
    spec.agents["history_editing"]              # a merge-breaking variant (merge_breakers.py)

Your own task (a warm start then works for it as for `lookup`):

    register_task(Task(name="echo", agent=echo_agent,
                       train_tasks=lambda n, seed: [...],       # or a list of task dicts
                       val_tasks=[...],
                       demonstrations=[[{"role": "system", ...}, {"role": "assistant", ...}], ...]))
    Trainer.from_config("configs/cpu_tiny.yaml", overrides=["agl_lab.task.name=echo"])

`get_task("module:attr")` also imports a `Task` (or a function returning one) by name, so
`agl-lab train configs/cpu_tiny.yaml agl_lab.task.name=my_tasks:echo` works without code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, str]]


def _as_generator(value: Any, field_name: str) -> Callable[[int, int], list]:
    """A `(n, seed) -> list` generator from a generator or a fixed list (cycled to n items)."""
    if value is None or callable(value):
        return value
    if isinstance(value, (list, tuple)):
        items = list(value)

        def generate(n: int, seed: int = 0) -> list:
            if not items:
                return []
            return [items[i % len(items)] for i in range(n)]

        generate.__doc__ = f"the {len(items)} given {field_name}, cycled"
        return generate
    raise TypeError(f"Task.{field_name} must be a function (n, seed) -> list or a list, got {type(value).__name__}")


@dataclass(frozen=True)
class Task:
    """Everything the trainer and the notebooks need to know about one task.

    | field            | type / signature                      | meaning                                  |
    |------------------|---------------------------------------|------------------------------------------|
    | name             | str                                   | registry key (`agl_lab.task.name`)       |
    | agent            | (task, ctx) -> float | None           | the default agent                        |
    | train_tasks      | (n, seed) -> list[dict] | list[dict]   | training tasks (a list is cycled to n)   |
    | val_tasks        | (n, seed) -> list[dict] | list | None | validation tasks (None: no validation)   |
    | reward           | (task, answer) -> float | None        | task success of a final answer (optional)|
    | demonstrations   | (n, seed) -> list[Messages] | list     | transcripts the warm start fits, in order|
    | description      | str                                   | one paragraph for humans                 |
    | agents           | dict[str, agent]                      | named agents over the same data          |
    | warm_start_steps | int                                   | recommended warm-start steps             |

    A demonstration is a chat transcript (`[{"role", "content"}, ...]`); the warm start
    trains on its assistant turns only. Lists are accepted wherever a generator is and are
    cycled, so `train_tasks=my_list` gives `n_train` tasks from `my_list` in order.
    """

    name: str
    agent: Callable[[Any, Any], float | None]
    train_tasks: Any
    val_tasks: Any = None
    reward: Callable[[dict[str, Any], Any], float] | None = None
    demonstrations: Any = None
    description: str = ""
    agents: dict[str, Callable[[Any, Any], float | None]] = field(default_factory=dict)
    warm_start_steps: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"Task.name must be a non-empty string without ':', got {self.name!r}")
        if not callable(self.agent):
            raise TypeError(
                f"Task {self.name!r}: agent must be a function agent(task, ctx), got {type(self.agent).__name__}"
            )
        for name in ("train_tasks", "val_tasks", "demonstrations"):
            object.__setattr__(self, name, _as_generator(getattr(self, name), name))
        if self.train_tasks is None:
            raise ValueError(f"Task {self.name!r}: train_tasks is required (a list of task dicts or (n, seed) -> list)")
        if self.val_tasks is None:
            object.__setattr__(self, "val_tasks", lambda n, seed=0: [])


def _lookup_spec() -> Task:
    from agl_lab.tasks import lookup, merge_breakers

    return Task(
        name="lookup",
        description=lookup.__doc__.strip().split("\n\n")[0],
        train_tasks=lookup.train_tasks,
        val_tasks=lookup.val_tasks,
        agent=lookup.lookup_agent,
        reward=lookup.reward,
        demonstrations=lookup.demonstrations,
        agents={
            "append_only": merge_breakers.append_only_agent,
            "history_editing": merge_breakers.history_editing_agent,
            "reasoning_dropping": merge_breakers.reasoning_dropping_agent,
        },
        warm_start_steps=lookup.WARM_START_STEPS,
    )


def _calc_spec() -> Task:
    from agl_lab.tasks import calc

    return Task(
        name="calc",
        description=calc.__doc__.strip().split("\n\n")[0],
        train_tasks=calc.train_tasks,
        val_tasks=calc.val_tasks,
        agent=calc.calc_agent,
        reward=calc.reward,
        demonstrations=calc.demonstrations,
    )


def _calc_chain_spec() -> Task:
    from agl_lab.tasks import calc

    return Task(
        name="calc_chain",
        description="`(a op b) op c` through a one-operator calculator: two calls, the second on the "
        "first's result (agl_lab/tasks/calc.py).",
        train_tasks=calc.chain_train_tasks,
        val_tasks=calc.chain_val_tasks,
        agent=calc.calc_agent,
        reward=calc.reward,
        demonstrations=calc.chain_demonstrations,
    )


_BUILTIN: dict[str, Callable[[], Task]] = {"lookup": _lookup_spec, "calc": _calc_spec, "calc_chain": _calc_chain_spec}
_REGISTRY: dict[str, Task] = {}


def register_task(task: Task, *, replace: bool = True) -> Task:
    """Register `task` under `task.name` (a config's `agl_lab.task.name`); returns it.

    Re-registering a name replaces the earlier task (a re-run notebook cell), unless
    `replace=False`. A built-in name cannot be taken.
    """
    if not isinstance(task, Task):
        raise TypeError(f"register_task expects an agl_lab.tasks.Task, got {type(task).__name__}")
    if task.name in _BUILTIN:
        raise ValueError(f"{task.name!r} is a built-in task; give yours another name")
    if not replace and task.name in _REGISTRY:
        raise ValueError(f"a task named {task.name!r} is already registered (pass replace=True)")
    _REGISTRY[task.name] = task
    return task


def task_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTRY})


def _import_task(spec: str) -> Task:
    import importlib

    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, Task):
        obj = obj()
    if not isinstance(obj, Task):
        raise TypeError(
            f"task {spec!r} is a {type(obj).__name__}; name an agl_lab.tasks.Task or a function returning one"
        )
    return register_task(obj)


FIELD_PREFIXES = ("reasoning_gym:", "gem:", "textarena:", "openenv:", "verifiers:")


def _field_task(name: str, options: Any) -> Task:
    """A task from a hub of the field by name (agl_lab/tasks/rgym.py, gem_games.py, textarena_games.py,
    openenv_env.py; verifiers_env.py refuses verifiers with the reason)."""
    prefix, _, rest = name.partition(":")
    if not rest:
        raise KeyError(f"agl_lab.task.name={name!r} names no {prefix} environment: write {prefix}:<name>")
    if prefix == "reasoning_gym":
        from agl_lab.tasks.rgym import reasoning_gym_task

        return reasoning_gym_task(rest, options)
    if prefix == "textarena":
        from agl_lab.tasks.textarena_games import textarena_task

        return textarena_task(rest, options)
    if prefix == "openenv":
        from agl_lab.tasks.openenv_env import openenv_task

        return openenv_task(rest, options)
    if prefix == "verifiers":
        from agl_lab.tasks.verifiers_env import verifiers_task

        return verifiers_task(rest, options)
    from agl_lab.tasks.gem_games import gem_task

    return gem_task(rest, options)


def get_task(name: Any, options: Any = None) -> Task:
    """The task registered under `name` (or `name` itself when it is a `Task`, the task from the
    field that `"reasoning_gym:<dataset>"`, `"gem:<env id>"`, `"textarena:<game id>"` or
    `"openenv:<module>:<Class>"` names, or the `Task` that
    `"module:attr"` names); KeyError naming the known tasks otherwise. `options` (`agl_lab.task`:
    size, seed, config, max_turns) shape the tasks from the field (docs/environments.md)."""
    if isinstance(name, Task):
        return name
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN:
        return _BUILTIN[name]()
    if isinstance(name, str) and name.startswith(FIELD_PREFIXES):
        return _field_task(name, options)
    if isinstance(name, str) and ":" in name:
        return _import_task(name)
    raise KeyError(
        f"unknown task {name!r}; known tasks are {task_names()} (set agl_lab.task.name to one "
        "of them, register yours with agl_lab.tasks.register_task(Task(...)), or name it "
        "as 'module:attr')"
    )


def agent_and_task(cfg: Any, agent: Any, task: Any, *, has_tasks: bool) -> tuple[Any, Task | None]:
    """Who runs, and the task that supplies what nothing else does.

    The agent: `agent` (a function, a `"module:function"` string, an AGL agent class), else
    `agl_lab.agent`, else the task's; none at all when `agentlightning.local.agent_class` names
    the AGL agent class the runner starts per rollout. The task (`task`, else
    `agl_lab.task.name`) is loaded when it is given or when it must supply the agent or, without
    `has_tasks` (no dataset, no `data.train_files`), the tasks.
    """
    from agl_lab.agent import agl_agent_class_spec, load_agent

    lab, agent_class = cfg.agl_lab, cfg.agentlightning.local.agent_class
    if agent is None and lab.get("agent"):
        agent = load_agent(str(lab.agent))  # `agl_lab.agent=module:function` (CLI)
    if isinstance(agent, type):
        agent = agl_agent_class_spec(agent)  # an AGL agent class: Class().run() in a subprocess
    if task is not None or (not agent_class and (agent is None or not has_tasks)):
        task = get_task(task if task is not None else str(lab.task.name), lab.task)
    if agent is None and task is not None and not agent_class:
        agent = task.agent
    return agent, task


__all__ = ["Task", "agent_and_task", "get_task", "register_task", "task_names"]
