"""Built-in multi-turn tasks and agents: the demo, the tests and the notebooks run on these.

A task is what a config names (`agl_lab.task: lookup`); `get_task(name)` returns its
`TaskSpec`: the datasets, the default agent (plus named variants), the reward and the
synthetic transcripts the warm start fits. Every agent is a plain `agent(task, ctx)`
written with the `openai` SDK against `ctx.base_url` — the same code would run unchanged
against any OpenAI-compatible endpoint, which is the point of the gateway.

    spec = get_task("lookup")
    tasks = spec.train_tasks(64, seed=0)
    reward = spec.agent(tasks[0], ctx)          # ctx: agl_lab.runner.AgentContext
    spec.agents["history_editing"]              # a merge-breaking variant (merge_breakers.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class TaskSpec:
    """Everything the trainer and the notebooks need to know about one built-in task.

    | field             | signature                                  | meaning                         |
    |-------------------|--------------------------------------------|---------------------------------|
    | name              | str                                        | registry key                    |
    | description       | str                                        | one paragraph for humans        |
    | train_tasks       | (n, seed) -> list[dict]                    | deterministic training tasks    |
    | val_tasks         | (n, seed) -> list[dict]                    | disjoint stream of val tasks    |
    | agent             | (task, ctx) -> float | None                | the default agent               |
    | reward            | (task, answer) -> float                    | task success of a final answer  |
    | demo_transcripts  | (n, seed) -> list[Messages]                | noisy transcripts (warm start)  |
    | agents            | dict[str, agent]                           | named agents over the same data |
    | warm_start_steps  | int                                        | recommended warm-start steps    |
    """

    name: str
    description: str
    train_tasks: Callable[[int, int], list[dict[str, Any]]]
    val_tasks: Callable[[int, int], list[dict[str, Any]]]
    agent: Callable[[Any, Any], float | None]
    reward: Callable[[dict[str, Any], Any], float]
    demo_transcripts: Callable[[int, int], list[Messages]]
    agents: dict[str, Callable[[Any, Any], float | None]] = field(default_factory=dict)
    warm_start_steps: int = 0


def _lookup_spec() -> TaskSpec:
    from agl_lab.tasks import lookup, merge_breakers

    return TaskSpec(
        name="lookup",
        description=lookup.__doc__.strip().split("\n\n")[0],
        train_tasks=lookup.train_tasks,
        val_tasks=lookup.val_tasks,
        agent=lookup.lookup_agent,
        reward=lookup.reward,
        demo_transcripts=lookup.demo_transcripts,
        agents={
            "append_only": merge_breakers.append_only_agent,
            "history_editing": merge_breakers.history_editing_agent,
            "reasoning_dropping": merge_breakers.reasoning_dropping_agent,
        },
        warm_start_steps=lookup.WARM_START_STEPS,
    )


def _calc_spec() -> TaskSpec:
    from agl_lab.tasks import calc

    return TaskSpec(
        name="calc",
        description=calc.__doc__.strip().split("\n\n")[0],
        train_tasks=calc.train_tasks,
        val_tasks=calc.val_tasks,
        agent=calc.calc_agent,
        reward=calc.reward,
        demo_transcripts=calc.demo_transcripts,
    )


_REGISTRY: dict[str, Callable[[], TaskSpec]] = {"lookup": _lookup_spec, "calc": _calc_spec}


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str) -> TaskSpec:
    """The `TaskSpec` registered under `name`; KeyError naming the known tasks otherwise."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown task {name!r}; built-in tasks are {task_names()} "
                       "(set agl_lab.task to one of them)")
    return _REGISTRY[name]()


__all__ = ["TaskSpec", "get_task", "task_names"]
