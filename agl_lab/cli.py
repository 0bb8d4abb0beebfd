"""The `agl-lab` command: serve | engine | train.

    agl-lab serve  --port 8080 --key KEY --model-name NAME [--store sqlite:///f.db]
    agl-lab engine --port 8001 [--model-path DIR]
    agl-lab train  configs/cpu_tiny.yaml [--run-dir DIR] [key=value ...]

Each subcommand lives beside the code it runs; this module only dispatches, so that
`agl-lab serve` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("agl_lab.server.embedded", "serve_main", "run the rollout store + LLM gateway"),
    "engine": ("agl_lab.engines.serving.openai_server", "engine_main", "serve the local model OpenAI-style"),
    "train": ("agl_lab.trainer", "train_main", "train from a YAML config"),
}


def _usage() -> str:
    lines = ["usage: agl-lab {serve,engine,train} [options]", ""]
    lines += [f"  {name:<7} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"agl-lab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = SUBCOMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
