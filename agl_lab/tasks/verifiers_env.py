"""`agl_lab.task.name=verifiers:<env>` is refused, with the reason (docs/environments.md).

verifiers 0.4.0 (PyPI) was tried in a scratch environment for the `envs` extra (pure Python,
wheels only, nothing fetched at run time) and does not fit it:

- its declared dependencies cannot live beside agl_lab's: `openai<3.0` (agl_lab's environment
  has openai 3.x), `math-verify`, whose antlr4 4.13 replaces the 4.9.3 omegaconf needs (the reason
  gem-llm is installed with --no-deps), `renderers[multimodal]`, which upgrades transformers, and
  `mcp==2.0.0`; in all about 80 packages, with Prime's sandbox, tunnel and run clients;
- installed with --no-deps instead, `import verifiers.v1` needs more than ten further packages
  (prime-pydantic-config, renderers, anthropic, prime-sandboxes, connectrpc, pyqwest, protobuf-py, …);
- its 0.4 stack (`verifiers.v1`) runs an episode itself — a taskset, a harness started in a
  runtime (a subprocess, Docker, Prime sandboxes) and an interception server in front of the
  model — rather than giving an environment an agent steps through; the `load_environment` /
  rubric / MultiTurnEnv API of the 0.1 releases is gone from it.

The refusal is one line (`agl-lab train` exits 2). A verifiers-style environment (a dataset and a
reward function) is an agl_lab `Task` of a few lines, named as `module:attr`.
"""

from __future__ import annotations

from typing import Any

PREFIX = "verifiers:"
REASON = (
    "verifiers 0.4.0 cannot install into agl_lab's environment from wheels: it requires openai<3 (agl_lab has 3.x), "
    "math-verify (whose antlr4 4.13 breaks omegaconf) and a transformers upgrade, ~80 packages with Prime's "
    "sandbox and tunnel clients, and its v1 environments run their own harness and model proxy"
)


def verifiers_task(env: str, options: Any = None) -> Any:
    """Always a ConfigError naming the package and why (the module docstring has the details)."""
    from agl_lab.config import ConfigError

    raise ConfigError(
        f"agl_lab.task.name={PREFIX}{env} is refused: {REASON}; write the environment as an agl_lab Task "
        "(agl_lab.task.name=<module>:<attr>, docs/environments.md)"
    )
