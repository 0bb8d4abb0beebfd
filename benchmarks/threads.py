"""Torch threads on a shared CPU: the tiny model's warm start and a GRPO step, 1 vs N threads.

Each setting runs in its own process (torch's intra-op pool is sized once per process), on a
quiet machine and with `--load K` busy-looping competitor processes (`benchmarks.children.busy_loops`)
standing in for the other work of a shared machine:

    warm start   `fit_transcripts` on the `lookup` demonstrations (no cache), seconds per step
    grpo step    `Trainer.step()` of configs/cpu_tiny.yaml (warm-started model cached), seconds

    python benchmarks/threads.py [--threads 1 2] [--load 0 2] [--warm-steps 30] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import busy_loops  # noqa: E402

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
threads, warm_steps, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import torch
torch.set_num_threads(threads)
from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.tasks import get_task
from agl_lab.engines.warmstart import fit_transcripts
model, tok = load_model_and_tokenizer()
demos = get_task("lookup").demonstrations(warm_steps * 16, 0)
t0 = time.perf_counter()
fit_transcripts(model, tok, demos, warm_steps, 0)
warm = (time.perf_counter() - t0) / warm_steps
from agl_lab import Trainer
with Trainer.from_config("configs/cpu_tiny.yaml", overrides=[
        f"agl_lab.torch_threads={threads}", "trainer.logger=[]",
        "agl_lab.run_dir=/tmp/agl_threads_bench"]) as t:
    t.step()  # the first step includes start-up
    t0 = time.perf_counter()
    for _ in range(steps):
        t.step()
    step = (time.perf_counter() - t0) / steps
print(json.dumps({"threads": threads, "warm_s_per_step": warm, "grpo_step_s": step}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy competitor processes")
    ap.add_argument("--warm-steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"{'load':>4} {'threads':>7} {'warm s/step':>11} {'grpo step s':>11}")
    for load in args.load:
        with busy_loops(load):
            for threads in args.threads:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(threads), str(args.warm_steps), str(args.steps)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{load:>4} {threads:>7} {r['warm_s_per_step']:>11.3f} {r['grpo_step_s']:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
