r"""Resident memory per step, with the end-of-update heap trim (agl_lab/heap.py) and without.

Issue #51 measured the SmolLM2 `calc` recipe's RSS growing ~0.25 GB a step (3.65 → 4.78 GB
over steps 1–4). Live Python objects and tensors do not grow (this script counts them too):
what grows is glibc's arena, which keeps freed pages for reuse. Each case runs in a fresh
interpreter (RSS is a process's), both in one invocation, and prints one table:

    case   | step | rss_peak_gb | rss_after_gb | live_tensors | step_s

`rss_peak_gb` is the resident size just after the update (before the trim: the step's high-water
mark); `rss_after_gb` after the trim (the same figure when the trim is off). The run trains with
validation off; its metrics are the recipe's own.

    python benchmarks/memory.py [--config configs/cpu_tiny.yaml] [--steps 30] [key=value ...]
    python benchmarks/memory.py --config configs/cpu_smollm2_learn.yaml --steps 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import run_child, tagged  # noqa: E402

CHILD = r"""
import gc, json, sys, time
import torch
from agl_lab import heap
from agl_lab.trainer import Trainer

config, steps, trim, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on", sys.argv[4:]
heap.ENABLED = trim
overrides = [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "trainer.save_freq=-1", *overrides]
with Trainer.from_config(config, overrides=overrides) as trainer:
    for step in range(1, steps + 1):
        t0 = time.time()
        trainer.rollout()
        trainer.build_batch()
        update = trainer.update()
        gc.collect()
        m = update.metrics
        after = m.get("perf/rss_gb", float("nan"))
        peak = after + m.get("perf/heap_trimmed_gb", 0.0)
        tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
        print("ROW " + json.dumps([step, peak, after, tensors, time.time() - t0]), flush=True)
"""


def run_case(config: str, steps: int, trim: bool, overrides: list[str]) -> list[list[float]]:
    args = [config, str(steps), "on" if trim else "off", *overrides]
    return tagged(run_child(CHILD, args, f"memory benchmark case trim={'on' if trim else 'off'}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cpu_tiny.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) for both cases")
    args = p.parse_args(argv)
    print(f"# {args.config}, {args.steps} steps, overrides: {' '.join(args.overrides) or '-'}")
    print(
        f"{'case':<8} | {'step':>4} | {'rss_peak_gb':>11} | {'rss_after_gb':>12} | {'live_tensors':>12} | {'step_s':>6}"
    )
    print("-" * 70)
    for trim in (False, True):
        for step, peak, after, tensors, seconds in run_case(args.config, args.steps, trim, args.overrides):
            case = "trim" if trim else "no-trim"
            print(f"{case:<8} | {step:>4} | {peak:>11.3f} | {after:>12.3f} | {tensors:>12} | {seconds:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
