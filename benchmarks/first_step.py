"""The first rollout phase against a later one, beside busy loops: warm, and nothing lost (#51 item 1).

One LoRA engine (SmolLM2-135M, r=8 — the configuration whose first phase failed rollouts under
load) serves `--groups` × `--n` multi-turn `calc` rollouts through the embedded gateway, twice:

    first   the engine as built (LoRA merged and weights packed at start: `LocalEngine._warm`)
    later   after a simulated update (lora_B moved in place under the weights lock, then
            `sync_weights`, which merges and packs the new version before serving resumes)

beside `--busy` busy loops (separate processes: the load of the issue's measurement). Columns:
wall seconds, failed rollouts (an agent that raised or a model call the gateway answered with an
error), model calls, calls that reached the engine (`generations`: > calls means a call was sent
twice), decode steps, LoRA merges during the phase (0: none on the decode path), timeout
extensions (`GET /proxy/upstream_stats`), and the runnable threads during the phase (the machine's
load: `RunnableSampler`). Goal: first ≤ 2× later, 0 failed.

    python benchmarks/first_step.py [--groups 4] [--n 4] [--busy 2] [--upstream-timeout 300] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import busy_loops  # noqa: E402


def play_phase(server, engine, agent, tasks: list[dict]) -> dict:
    """Every task's rollout at once through the gateway → the phase's row."""
    from agl_lab.engines.lora import merge_count
    from agl_lab.protocol import RolloutCreate
    from agl_lab.server.gateway import proxy_base_url

    rollouts = server.store.create_rollouts([RolloutCreate(rollout_id=uuid.uuid4().hex, input=t) for t in tasks])
    sched, before_stats = engine.server.scheduler, dict(engine.server.scheduler.stats)
    merges, extensions = merge_count(engine.model), server.gateway.stats["timeout_extensions"]
    requests_before = _SUBMITS["n"]

    def play(rollout) -> bool:
        ctx = SimpleNamespace(base_url=proxy_base_url(server.url, rollout.rollout_id), api_key="EMPTY")
        try:
            agent(rollout.input, ctx)
            return True
        except Exception as exc:  # a failed rollout: counted, named
            print(f"  rollout {rollout.rollout_id[:8]} failed: {type(exc).__name__}: {exc}", flush=True)
            return False

    load, t0 = RunnableSampler(), time.perf_counter()
    with ThreadPoolExecutor(len(rollouts)) as pool:
        ok = list(pool.map(play, rollouts))
    wall = time.perf_counter() - t0
    events = [e for r in rollouts for e in server.store.events(r.rollout_id) if e.event_type == "model_request"]
    failed = {r.rollout_id for r, o in zip(rollouts, ok) if not o}
    failed |= {e.rollout_id for e in events if e.data.get("status") != "ok"}
    return {
        "seconds": round(wall, 1),
        "failed rollouts": len(failed),
        "model calls": len(events),
        "generations": _SUBMITS["n"] - requests_before,
        "decode steps": int(sched.stats["steps"] - before_stats["steps"]),
        "LoRA merges in phase": merge_count(engine.model) - merges,
        "timeout extensions": server.gateway.stats["timeout_extensions"] - extensions,
        "runnable": load.mean(),
    }


class RunnableSampler:
    """The machine's runnable threads during a phase: /proc/loadavg's running count, sampled every
    `period` s by a thread (the sampler itself not counted). A phase of seconds ends before the
    1-minute load average sees the busy loops; this is the load the phase ran under."""

    def __init__(self, period: float = 0.25):
        self.period, self.samples = period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runnable-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:  # a sample at the start, then one every `period` s until `mean`
            with open("/proc/loadavg") as f:
                self.samples.append(int(f.read().split()[3].split("/")[0]) - 1)
            if self._stop.wait(self.period):
                return

    def mean(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(sum(self.samples) / len(self.samples), 1)


_SUBMITS = {"n": 0}  # requests the engine's scheduler received (a call sent twice counts twice)


def _instrument_submits(engine) -> None:
    """Count every request the scheduler receives (a resent call is a second one)."""
    sched = engine.server.scheduler
    submit = sched.submit

    def counted(*args, **kwargs):
        _SUBMITS["n"] += 1
        return submit(*args, **kwargs)

    sched.submit = counted


def simulated_update(engine, seed: int) -> None:
    """Move every lora_B in place (as an optimizer step does) and sync: a new weight version."""
    gen = torch.Generator().manual_seed(seed)
    with engine.weights_lock, torch.no_grad():
        for name, p in engine.model.named_parameters():
            if ".lora_B." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    engine.sync_weights()


def play_both_phases(args: argparse.Namespace) -> tuple[list[dict], float]:
    """A fresh engine's first phase, then a later one after a simulated update → (rows, build seconds)."""
    from agl_lab.engines.local import LocalEngine
    from agl_lab.models import preset_dir
    from agl_lab.protocol import Model
    from agl_lab.server.embedded import EmbeddedServer
    from agl_lab.tasks import get_task

    t0 = time.perf_counter()
    engine = LocalEngine(
        args.model_path or str(preset_dir(args.preset)),
        device="cpu",
        max_model_len=args.max_model_len,
        lora={"lora_rank": args.lora_rank, "lora_alpha": 2 * args.lora_rank},
    )
    built = time.perf_counter() - t0
    _instrument_submits(engine)
    limits = {} if args.upstream_timeout is None else {"upstream_timeout_seconds": args.upstream_timeout}
    server = EmbeddedServer(default_proxy={"model_name": engine.model_name}, token_preserving=True, **limits)
    spec = get_task("calc")
    rows = []
    try:
        server.store.upsert_models([Model(model=engine.model_name, endpoint=engine.endpoints()[0])])
        server.set_tokenizer(engine.model_name, engine.tokenizer)
        for phase in ("first", "later"):
            if phase == "later":
                simulated_update(engine, seed=1)
            tasks = [t for t in spec.train_tasks(args.groups, len(rows)) for _ in range(args.n)]
            row = {"phase": phase, **play_phase(server, engine, spec.agent, tasks)}
            rows.append(row)
            print(row, flush=True)
    finally:
        server.stop()
        engine.close()
    return rows, built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--model-path", help="an HF model directory instead of the preset")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="rollouts per task (a GRPO group)")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the engine")
    parser.add_argument("--upstream-timeout", type=float, default=None, help="the gateway's (default: its own)")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args(argv)

    import pandas as pd

    with busy_loops(args.busy, settle=0) as loops:  # beside the engine's build and warm-up too
        print(f"busy loops (pids): {' '.join(str(p.pid) for p in loops) or '-'}", flush=True)
        rows, built = play_both_phases(args)
    table = pd.DataFrame(rows).set_index("phase")
    ratio = table.loc["first", "seconds"] / table.loc["later", "seconds"]
    print(
        f"\n{args.groups} tasks × {args.n} rollouts of `calc`, {args.model_path or args.preset} + LoRA r={args.lora_rank}, "
        f"beside {args.busy} busy loops; engine built (and warmed) in {built:.1f} s\n"
    )
    print(table.to_string())
    print(
        f"\nfirst / later: {ratio:.2f} (goal ≤ 2); failed rollouts in the first phase: {table.loc['first', 'failed rollouts']}"
    )


if __name__ == "__main__":
    main()
