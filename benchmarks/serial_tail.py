"""The serial tail of a SmolLM2 `calc` rollout phase (#51 items 2-3): one client pool, stop sequences.

The set-up of `benchmarks/rollout_phase.py` (one engine, the token-preserving gateway, the
multi-turn `calc` agent, `--groups` tasks × `--n` rollouts, an empty prefix cache per run), with
its fastest engine settings (shared prefix, every core), in three variants taking turns:

    before          a new `openai.OpenAI` per rollout; every call up to 48 tokens, no stop
    + one pool      `agent.shared_openai_client`: one HTTP pool per process, a copy per rollout
    + stop & cap    `calc.call_options`: calls stop at `</tool_call>`, the answer call capped at 16

Columns: wall seconds of the phase, decode steps, tokens generated, the critical path (the
slowest rollout's decode steps in series: `records.critical_path_metrics`; before 2026-12-05 its
completion tokens, one more per call), the mean decode
batch (decode rows / steps: `BatchScheduler.stats["decode_rows"]`), seconds spent making clients,
model calls, and merge breaks. Agent calls are unseeded (#51 item 5), so
completions differ between runs: the variants take turns for `--repeat` rounds, means shown.

    python benchmarks/serial_tail.py [--groups 2] [--n 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.token_preserving`, run as a script

VARIANTS = {"before": (False, False), "+ one pool": (True, False), "+ stop & cap": (True, True)}


def _patched(shared_pool: bool, stop: bool, made: list[float]) -> tuple[Any, Any]:
    """(openai_client, call_options) of a variant; `made` collects the seconds spent making clients."""
    import openai

    from agl_lab.agent import shared_openai_client
    from agl_lab.tasks import calc

    def client(ctx: Any) -> Any:
        t0 = time.perf_counter()
        if shared_pool:
            made_client = shared_openai_client(ctx.base_url, ctx.api_key)
        else:  # what every rollout did before: a client (and its HTTP pool) of its own
            made_client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key or "EMPTY")
        made.append(time.perf_counter() - t0)
        return made_client

    options = calc.call_options if stop else (lambda task, n_results: {"max_tokens": calc.MAX_TOKENS})
    return client, options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--n", type=int, default=4, help="rollouts per task (a GRPO group)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)

    import pandas as pd
    import torch

    from agl_lab.batch import merge_triplets
    from agl_lab.records import critical_path_metrics
    from agl_lab.tasks import calc, lookup
    from benchmarks.rollout_phase import serving, timed_phase

    rows: list[dict] = []
    with serving(args.preset, "calc", args.groups, args.n) as (server, spec, tasks, sched):
        sched.share_prefix, sched.num_threads = True, torch.get_num_threads()
        for r in range(args.repeat):
            for name, (shared_pool, stop) in VARIANTS.items():
                made: list[float] = []
                lookup.openai_client, calc.call_options = _patched(shared_pool, stop, made)
                completed, wall, d = timed_phase(server, spec, tasks, sched, r)
                path = critical_path_metrics(completed)
                breaks = sum(len(merge_triplets(c.triplets)[1]) for c in completed)
                rows.append(
                    {
                        "variant": name,
                        "seconds": wall,
                        "decode steps": d["steps"],
                        "tokens generated": d["tokens"],
                        "critical path (decode steps)": path["rollout/critical_path_decode_steps"],
                        "mean decode batch": d["decode_rows"] / max(d["steps"], 1),
                        "client s / rollout": sum(made) / max(len(made), 1),
                        "calls": sum(len(c.triplets) for c in completed),
                        "merge breaks": breaks,
                    }
                )
                print(f"round {r + 1}: {name}: {wall:.1f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    table = pd.DataFrame(rows).groupby("variant", sort=False).mean().round(3)
    print(f"\n{args.groups} tasks × {args.n} rollouts of `calc`, {args.preset}; mean of {args.repeat} rounds\n")
    print(table.to_string())
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
