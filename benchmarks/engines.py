"""Seconds per training step: the local engine vs the verl engine on CPU, same config and seed.

    python benchmarks/engines.py                      # configs/cpu_verl.yaml, 6 steps each, ~3 min
    python benchmarks/engines.py --steps 10 data.train_batch_size=16
    .venv-vllm/bin/python benchmarks/engines.py       # + a third row: verl with vLLM replicas

The engines run `agl_lab.Trainer.step()` on the same config (configs/cpu_verl.yaml; the local
run only overrides `agl_lab.engine=local`), the same seed, the same warm-started tiny model
and the same task, one after the other in this process. Where vLLM is importable (the
.venv-vllm environment) a third row runs verl with its own vLLM replicas (configs/cpu_vllm.yaml:
cpu_verl.yaml with `rollout.name: vllm` and the vLLM settings; it also records sampling
logprobs and uses verl's remove-padding path, as the GPU config does); `--engines` picks rows. The first step of each is a warm-up
and left out; the table gives the median seconds per step over the others and the share of
the step spent in each phase, from the step's own `timing_s/*` metrics:

| column        | metrics                                                                        |
|---------------|--------------------------------------------------------------------------------|
| rollout       | `timing_s/gen`: engine resume, agents through the gateway, abort                 |
| old/ref lp    | `timing_s/old_log_prob` + `timing_s/ref`: verl's workers (verl), in process (local) |
| update        | `timing_s/update_actor`: the policy update (verl: Ray → FSDP2 worker)            |
| weight sync   | `timing_s/update_weights`: trained weights → the serving model                  |
| other         | the rest: batch building, advantages, sleeping the replicas, logging             |

Start-up (Ray, worker spawn, `init_model`) is printed separately: it is paid once per run.
Numbers on a shared machine are noisy: the `uptime` load is printed with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu_verl.yaml"
#: row → (config file, overrides of that row)
ENGINES = {
    "local": (CONFIG, ["agl_lab.engine=local"]),
    "verl": (CONFIG, []),
    "verl-vllm": (CONFIG.with_name("cpu_vllm.yaml"), []),
}
PHASES = {
    "rollout": ("timing_s/gen",),
    "old/ref lp": ("timing_s/old_log_prob", "timing_s/ref"),
    "update": ("timing_s/update_actor",),
    "weight sync": ("timing_s/update_weights",),
}


def run_engine(engine: str, steps: int, overrides: list[str], run_dir: str) -> dict:
    """Build a Trainer for row `engine`, run `steps` steps → {startup_s, step_s: [...], shares: {...}}."""
    from agl_lab.trainer import Trainer

    config, own = ENGINES[engine]
    t0 = time.perf_counter()
    trainer = Trainer.from_config(str(config), [*own, *overrides], console=False, run_dir=os.path.join(run_dir, engine))
    startup = time.perf_counter() - t0
    try:
        history = [trainer.step() for _ in range(steps)]
    finally:
        trainer.close()
    measured = history[1:] or history  # the first step warms caches up
    shares: dict[str, float] = {}
    for name, keys in PHASES.items():
        shares[name] = statistics.mean(sum(float(m.get(k, 0.0)) for k in keys) / m["timing_s/step"] for m in measured)
    shares["other"] = 1.0 - sum(shares.values())
    rewards = [float(m.get("training/reward", float("nan"))) for m in history]
    return {
        "startup_s": startup,
        "step_s": [m["timing_s/step"] for m in measured],
        "shares": shares,
        "rewards": rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per engine (the first is a warm-up)")
    parser.add_argument(
        "--engines",
        default=None,
        help="comma-separated rows of " + ", ".join(ENGINES) + " (default: all that can run here)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for every engine")
    args = parser.parse_args()
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    engines = args.engines.split(",") if args.engines else [e for e in ENGINES if e != "verl-vllm" or has_vllm]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray_tmp = tempfile.mkdtemp(prefix="aglb", dir="/tmp")  # Ray's socket paths must stay short
    os.environ.setdefault("RAY_TMPDIR", ray_tmp)
    overrides = [f"trainer.total_training_steps={args.steps}", *args.overrides]
    results = {engine: run_engine(engine, args.steps, overrides, ray_tmp) for engine in engines}

    configs = ", ".join(f"{e}: {ENGINES[e][0].name}" for e in engines)
    print(f"\n{configs}; {args.steps} steps per engine (first left out), overrides: {args.overrides or 'none'}")
    print(f"load average (uptime): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs\n")
    header = ["engine", "start-up s", "s/step (median)", *PHASES, "other"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for engine, r in results.items():
        cells = [
            engine,
            f"{r['startup_s']:.1f}",
            f"{statistics.median(r['step_s']):.2f}",
            *(f"{100 * r['shares'][name]:.0f}%" for name in [*PHASES, "other"]),
        ]
        print("| " + " | ".join(cells) + " |")
    if "local" in results:
        base = statistics.median(results["local"]["step_s"])
        for engine in [e for e in results if e != "local"]:
            print(f"\n{engine} / local seconds per step: {statistics.median(results[engine]['step_s']) / base:.2f}x")
    for engine, r in results.items():
        print(f"{engine} mean training reward per step: {' '.join(f'{x:.2f}' for x in r['rewards'])}")


if __name__ == "__main__":
    main()
