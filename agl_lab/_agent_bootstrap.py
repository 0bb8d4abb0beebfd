"""Entry point of an agent subprocess: `python -m agl_lab._agent_bootstrap module:Class`.

The runner starts one such process per rollout (its own session, stdin closed) with the
Agent Lightning environment (`AGL_OPENAI_BASE_URL`, `AGL_EVENT_URL`, `AGL_KEY` and the
rollout's `env_map`). This module is the whole AGL agent contract:

    agent_class = "pkg.module:Class" | "pkg.module.Class"
    Class()        # no-argument constructor
    .run()         # sync, or returns an awaitable that is awaited
    exit 0         # the runner marks the rollout succeeded; anything else -> failed

On an exception the traceback goes to stderr (the runner quotes its tail in the rollout's
`error_message`) and the exit code is 1; a `sys.exit(n)` inside the agent keeps its code.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import traceback
from typing import Any

USAGE = "usage: python -m agl_lab._agent_bootstrap module:Class  (or module.Class)"


def split_agent_class(spec: str) -> tuple[str, str]:
    """`"pkg.mod:Outer.Inner"` -> `("pkg.mod", "Outer.Inner")`; `"pkg.mod.Cls"` -> `("pkg.mod", "Cls")`."""
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"agent_class {spec!r} must be 'module:Class' or 'module.Class' (e.g. 'examples.calc_x.calc_agent.Agent')"
        )
    return module_name, attr_path


def load_agent_class(spec: str) -> type:
    """Import the class named by `spec` and check that it can be an agent."""
    module_name, attr_path = split_agent_class(spec)
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise AttributeError(f"agent_class {spec!r}: {obj.__name__!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    if not inspect.isclass(obj):
        raise TypeError(
            f"agent_class {spec!r} names a {type(obj).__name__}, not a class; it must name a "
            "class with a no-argument constructor and a run() method"
        )
    if not callable(getattr(obj, "run", None)):
        raise TypeError(f"agent_class {spec!r} has no run() method; the runner calls Class().run()")
    return obj


async def _await(awaitable: Any) -> Any:
    return await awaitable


def run_agent(spec: str) -> None:
    """Instantiate the agent class with no arguments and run it to completion."""
    result = load_agent_class(spec)().run()
    if inspect.isawaitable(result):
        asyncio.run(_await(result))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        run_agent(argv[0])
    except Exception:  # SystemExit / KeyboardInterrupt keep their own exit codes
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
