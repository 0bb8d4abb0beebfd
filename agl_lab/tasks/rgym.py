"""reasoning-gym datasets as tasks: `agl_lab.task.name=reasoning_gym:<dataset>` (docs/environments.md).

reasoning-gym (PyPI `reasoning-gym`, the `envs` extra) holds ~100 procedural generators, each with
its own verifier. `reasoning_gym_task(dataset, options)` turns one into a `Task`:

    train tasks   create_dataset(dataset, size=size or n, seed=seed, **config)[i]   (i < n, cycled)
    val tasks     the same with seed + VAL_SEED_OFFSET
    agent         one chat call: SYSTEM_PROMPT + the entry's question → extract_answer(reply)
    reward        dataset.score_answer(extracted, entry), in [0, 1]

`options` are `agl_lab.task.size` (entries in the generator; null: as many as tasks asked for),
`agl_lab.task.seed` (null: `agl_lab.seed`) and `agl_lab.task.config` (the dataset's own config
keys, e.g. `{min_terms: 2, max_terms: 2}` for basic_arithmetic). A task dict carries the dataset,
its arguments and the entry's index — JSON, as the store needs — and the agent regenerates the
entry (`ds[i]` is deterministic in seed and index) so the verifier sees it whole, metadata included.

`agl_lab.task.tools: [calculator]` gives the agent calc's calculator tool (agl_lab/tasks/calc.py: its
`TOOLS`, worked examples, system prompt and call options, stop at `</tool_call>`): `tool_agent` runs
calc's append-only tool loop (at most calc.MAX_TURNS calls) on the entry's question and extracts the
final answer as above. The reward is still the dataset's verifier alone — no credit for calling the
tool; its `task_result` says whether the calculator was called and whether the answer is its last result.

reasoning-gym imports every generator at import time; one of them (zebra_puzzles) imports
`pycosat`, which has no wheel for Python 3.11 and would compile. `import_reasoning_gym()` puts a
placeholder module in its place when it is missing, so every other dataset works. A dataset that
needs it (itself or inside `composite`) is refused when its task is made, with one line naming the
fix; the placeholder raises the same line if a dataset ever calls it anyway.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import types
from typing import Any

PREFIX = "reasoning_gym:"
VAL_SEED_OFFSET = 1_000_003
MAX_TOKENS = 64
MODEL_NAME = "auto"
SYSTEM_PROMPT = "Solve the problem. Reply with the final answer on the last line, written as: Answer: <answer>"
# The datasets tests/test_envs.py drives end to end with what ./lab installs (requirements-envs.txt);
# every one of the ~100 imports, zebra_puzzles needs pycosat (see the module docstring).
CHECKED_DATASETS = ("basic_arithmetic", "letter_counting", "count_primes", "word_sorting")
NEEDS_PYCOSAT = ("zebra_puzzles",)
KNOWN_TOOLS = ("calculator",)

_ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _needs_pycosat(dataset: str) -> str:
    return (
        f"reasoning-gym's {dataset!r} needs pycosat, which is not installed (it has no wheel for this "
        "Python and compiles): `pip install pycosat` with a C compiler, or pick another dataset"
    )


def pycosat_missing() -> bool:
    """Whether `pycosat` is agl_lab's placeholder (after `import_reasoning_gym()`)."""
    return bool(getattr(sys.modules.get("pycosat"), "__agl_lab_placeholder__", False))


def _pycosat_placeholder() -> types.ModuleType:
    module = types.ModuleType("pycosat")
    module.__doc__ = "agl_lab's placeholder for pycosat (not installed: it has no wheel for this Python)"
    module.__agl_lab_placeholder__ = True

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(_needs_pycosat("this dataset"), name="pycosat")

    module.itersolve = module.solve = missing
    return module


def import_reasoning_gym() -> Any:
    """The `reasoning_gym` module (a placeholder `pycosat` when it is missing); ModuleNotFoundError
    naming the extra to install when reasoning-gym itself is not installed."""
    if "pycosat" not in sys.modules:
        try:
            import pycosat  # noqa: F401
        except ImportError:
            sys.modules["pycosat"] = _pycosat_placeholder()
    try:
        import reasoning_gym
    except ImportError as e:
        raise ModuleNotFoundError(
            f"agl_lab.task.name=reasoning_gym:... needs reasoning-gym and its pure-Python dependencies ({e}): "
            "`./lab test` installs them, or `pip install --no-deps -r requirements-envs.txt` (docs/environments.md)",
            name=e.name,
        ) from e
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    return sorted(import_reasoning_gym().factory.DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, config_json: str) -> Any:
    return import_reasoning_gym().create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def dataset_for(task: dict[str, Any]) -> Any:
    """The (cached) reasoning-gym dataset a task dict came from."""
    return _dataset(task["dataset"], int(task["size"]), int(task["seed"]), json.dumps(task["config"], sort_keys=True))


def entry_for(task: dict[str, Any]) -> dict[str, Any]:
    """The dataset entry (question, answer, metadata) a task dict names."""
    return dataset_for(task)[int(task["index"])]


def extract_answer(reply: str) -> str:
    """The answer in a reply: the text after the last `Answer:` (to the end of its line), else the
    last `\\boxed{...}`, else the last non-empty line; "" for an empty reply."""
    text = reply or ""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def score(task: dict[str, Any], reply: str) -> float:
    """The dataset's own verifier on the extracted answer: `score_answer(answer, entry)` in [0, 1]."""
    entry = entry_for(task)
    value = dataset_for(task).score_answer(extract_answer(reply), entry)
    return float(value or 0.0)


def messages_for(task: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]


def reasoning_gym_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """One chat call on the question; the reward is the dataset's verifier on the extracted answer."""
    from agl_lab.tasks.lookup import chat, openai_client

    reply = chat(openai_client(ctx), messages_for(task), max_tokens=MAX_TOKENS, model=MODEL_NAME)
    answer = extract_answer(reply)
    value = score(task, reply)
    emit = getattr(ctx, "emit", None)
    if callable(emit):
        emit("task_result", {"success": value, "answer": answer, "expected": task.get("answer"), "reward": value})
    return value


@functools.lru_cache(maxsize=1)
def _tool_examples() -> tuple[dict[str, Any], ...]:
    """calc's two worked examples, asked the way reasoning-gym's arithmetic asks ("Calculate 3 + 4."):
    with calc's own "What is 3 + 4?" SmolLM2 called the tool in 0 of 32 rgym rollouts."""
    from agl_lab.tasks import calc

    return (
        *calc._worked_example("Calculate 3 + 4.", ["3 + 4"], "call_0"),
        *calc._worked_example("Calculate 6 * 9.", ["6 * 9"], "call_1"),
    )


def tool_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """calc's tool loop on the entry's question (calc's examples and calculator); the reward is the
    dataset's verifier on the extracted final answer, nothing for the tool."""
    from agl_lab.tasks import calc
    from agl_lab.tasks.lookup import openai_client

    messages = [{"role": "system", "content": calc.SYSTEM_PROMPT}, *_tool_examples(), messages_for(task)[1]]
    loop = calc.tool_loop(openai_client(ctx), messages, {"ops": 1}, getattr(ctx, "cancelled", None))
    if loop is None:
        return None
    reply, results, called = loop
    last_result = results[-1] if results else None
    answer = extract_answer(reply) if reply is not None else None
    value = 0.0 if reply is None else score(task, reply)
    emit = getattr(ctx, "emit", None)
    if callable(emit):
        emit(
            "task_result",
            {
                "success": value,
                "answer": answer,
                "expected": task.get("answer"),
                "reward": value,
                "tool_called": called,
                "answer_is_tool_result": last_result is not None and answer == last_result,
            },
        )
    return value


def _tools(tools: Any) -> tuple[str, ...]:
    """`agl_lab.task.tools` checked: a list of KNOWN_TOOLS names (null or []: none)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(tools):
        tools = OmegaConf.to_container(tools, resolve=True)
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)) or any(name not in KNOWN_TOOLS for name in tools):
        raise ValueError(
            f"agl_lab.task.tools must be a list of tool names from {list(KNOWN_TOOLS)} (or []), got {tools!r}"
        )
    return tuple(tools)


def _options(options: Any) -> tuple[int | None, int | None, dict[str, Any]]:
    """(size, seed, config) from `agl_lab.task` (a mapping or None), checked."""
    get = (lambda key: options.get(key)) if options is not None else (lambda key: None)
    size, seed, config = get("size"), get("seed"), get("config")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"agl_lab.task.size must be a positive integer or null, got {size!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"agl_lab.task.seed must be an integer or null, got {seed!r}")
    if config is None:
        config = {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(config, dict):
        raise ValueError(
            f"agl_lab.task.config must be a mapping of the dataset's config keys, got {type(config).__name__}"
        )
    return size, seed, dict(config)


def _refuse_without_pycosat(dataset: str, config: dict[str, Any]) -> None:
    """ValueError (a config problem: `agl-lab train` prints it as one line, exit 2) when `dataset`, or
    a dataset `composite` mixes (`config.datasets[*].name`), needs the pycosat that is missing."""
    if not pycosat_missing():
        return
    mixed = [spec.get("name") for spec in config.get("datasets") or [] if isinstance(spec, dict)]
    needing = [name for name in (dataset, *mixed) if name in NEEDS_PYCOSAT]
    if needing:
        raise ValueError(f"agl_lab.task.name={PREFIX}{dataset}: {_needs_pycosat(needing[0])}")


def reasoning_gym_task(dataset: str, options: Any = None) -> Any:
    """The `Task` for reasoning-gym's `dataset` (see the module docstring for `options`)."""
    from agl_lab.tasks import Task

    rg = import_reasoning_gym()
    if dataset not in rg.factory.DATASETS:
        raise KeyError(
            f"reasoning-gym has no dataset {dataset!r} (agl_lab.task.name={PREFIX}{dataset}); "
            f"some it has: {', '.join(sorted(rg.factory.DATASETS)[:12])}, … "
            "(agl_lab.tasks.rgym.dataset_names() lists all)"
        )
    size, fixed_seed, config = _options(options)
    tools = _tools(options.get("tools") if options is not None else None)
    _refuse_without_pycosat(dataset, config)
    try:
        _dataset(dataset, size or 1, 0, json.dumps(config, sort_keys=True))
    except Exception as e:
        raise ValueError(f"agl_lab.task.config for reasoning-gym's {dataset!r} is rejected: {e}") from e

    def make(n: int, seed: int, split: str) -> list[dict[str, Any]]:
        base = fixed_seed if fixed_seed is not None else seed
        ds_seed = base + (VAL_SEED_OFFSET if split == "val" else 0)
        ds_size = size or max(n, 1)
        ds = _dataset(dataset, ds_size, ds_seed, json.dumps(config, sort_keys=True))
        out = []
        for i in range(n):
            entry = ds[i % ds_size]
            out.append(
                {
                    "task_id": f"rg-{dataset}-{split}-{ds_seed}-{i:05d}",
                    "question": entry["question"],
                    "answer": str(entry["answer"]),
                    "dataset": dataset,
                    "size": ds_size,
                    "seed": ds_seed,
                    "config": config,
                    "index": i % ds_size,
                }
            )
        return out

    with_tools = f" with the {', '.join(tools)} tool" if tools else ""
    return Task(
        name=f"reasoning_gym.{dataset}",
        description=f"reasoning-gym's {dataset!r}{with_tools}, one answer per question, scored by its own "
        "verifier (agl_lab/tasks/rgym.py).",
        agent=tool_agent if tools else reasoning_gym_agent,
        train_tasks=lambda n, seed=0: make(n, seed, "train"),
        val_tasks=lambda n, seed=0: make(n, seed, "val"),
        reward=score,
    )
