"""The rollout phase of a SmolLM2 `calc` step: the batch's shared prefix computed once, the decode loop on every core.

One engine serves every variant; each run plays the same GRPO batch — `--groups` tasks × `--n`
rollouts, the multi-turn `calc` agent through the token-preserving gateway — starting from an
empty prefix cache, as after a weight update:

    baseline        every row admitted in a prefill computes its whole uncached prompt; decode on 1 thread
    + shared        the admitted rows' common prefix computed once (`BatchScheduler._share_prefix`)
    + threads       the decode loop on torch's threads (`agl_lab.torch_threads`, every core for SmolLM2)
    both

Columns: wall seconds of the phase, prompt tokens computed (`rollout/prefill_tokens`) and served
by the cache (`rollout/cached_tokens`), decode steps (`rollout/decode_steps`), tokens generated,
model calls. Sampling is not seeded by the agent, so the completions (and hence the decode work)
differ a little between runs; the variants take turns for `--repeat` rounds and the best is shown.

    python benchmarks/rollout_phase.py [--groups 4] [--n 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.token_preserving`, run as a script

VARIANTS = {  # name → (share_prefix, decode threads: None = torch's count in this process)
    "baseline": (False, 1),
    "+ shared": (True, 1),
    "+ threads": (False, None),
    "both": (True, None),
}


@contextlib.contextmanager
def serving(preset: str, task: str, groups: int, n: int) -> Iterator[tuple[Any, Any, list[dict], Any]]:
    """(server, task spec, tasks, scheduler): one LocalEngine on CPU behind the token-preserving
    gateway, `groups` tasks × `n` rollouts of `task`; stopped on exit. benchmarks/serial_tail.py uses it too."""
    from agl_lab.engines.local import LocalEngine
    from agl_lab.models import preset_dir
    from agl_lab.protocol import Model
    from agl_lab.server.embedded import EmbeddedServer
    from agl_lab.tasks import get_task

    engine = LocalEngine(str(preset_dir(preset)), device="cpu", max_model_len=2048)
    server = EmbeddedServer(default_proxy={"model_name": engine.model_name}, token_preserving=True)
    spec = get_task(task)
    try:
        server.store.upsert_models([Model(model=engine.model_name, endpoint=engine.endpoints()[0])])
        server.set_tokenizer(engine.model_name, engine.tokenizer)
        yield server, spec, [t for t in spec.train_tasks(groups, 0) for _ in range(n)], engine.server.scheduler
    finally:
        server.stop()
        engine.close()


def timed_phase(server: Any, spec: Any, tasks: list[dict], sched: Any, r: int) -> tuple[list, float, dict]:
    """One rollout phase from an empty prefix cache: (completed rollouts, wall seconds, the
    scheduler's numeric stats it added)."""
    from benchmarks.token_preserving import run_step

    sched.prefix_cache.clear()  # as after a weight update
    before = dict(sched.stats)
    t0 = time.perf_counter()
    completed = run_step(server, spec.agent, tasks, r)
    wall = time.perf_counter() - t0
    return (
        completed,
        wall,
        {k: sched.stats[k] - before[k] for k in sched.stats if isinstance(sched.stats[k], (int, float))},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--task", default="calc")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="rollouts per task (a GRPO group)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)

    import pandas as pd

    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with serving(args.preset, args.task, args.groups, args.n) as (server, spec, tasks, sched):
        for r in range(args.repeat):
            for name, (share, threads) in VARIANTS.items():
                sched.share_prefix, sched.num_threads = share, threads or torch.get_num_threads()
                completed, wall, d = timed_phase(server, spec, tasks, sched, r)
                runs[name].append(
                    {
                        "variant": name,
                        "decode threads": sched.num_threads,
                        "seconds": round(wall, 2),
                        "prefill tokens": int(d["prefill_tokens"]),
                        "cached tokens": int(d["cached_tokens"]),
                        "shared prefills": int(d["shared_prefills"]),
                        "decode steps": int(d["steps"]),
                        "tokens generated": int(d["tokens"]),
                        "model calls": sum(len(c.triplets) for c in completed),
                    }
                )
                print(f"round {r + 1}: {name}: {wall:.1f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    best = [min(rs, key=lambda row: row["seconds"]) for rs in runs.values()]
    table = pd.DataFrame(best).set_index("variant")
    table["vs baseline"] = (table.loc["baseline", "seconds"] / table["seconds"]).round(2)
    print(f"\n{args.groups} tasks × {args.n} rollouts of `{args.task}`, {args.preset}; best of {args.repeat} rounds\n")
    print(table.to_string())
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
