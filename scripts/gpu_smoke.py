"""GPU smoke run of the local engine: a few bf16 steps of the demo task on one CUDA device.

    scripts/gpu_smoke.sh                 # the wrapper: picks .venv/bin/python, bounds the time
    python scripts/gpu_smoke.py --steps 4 --max-diff 0.25

What it checks. The local engine serves (OpenAI server, KV-cached decoding) and trains
(full forward) the *same* module, so in float32 the sampling logprobs of every rollout and
the logprobs the update recomputes before the first optimiser step agree to ~1e-6. In
bfloat16 the two forward paths round differently; this run measures how far apart they
are on the GPU (`training/rollout_logprobs_diff_{mean,max}` = |log π_train − log π_serve|
over the response tokens of each step's batch, verl's `training/rollout_probs_diff_max` in
probability space) and prints PASS when every step stays within bf16 tolerance, together
with the step times. A one-step float32 run on the same GPU is the reference: it must match
to `--max-diff-fp32`, which separates "bf16 rounding" from "the pipeline feeds the trainer
other tokens than were sampled" (a bug that shows as large diffs in any precision).

Thresholds (bf16 keeps 8 significant bits, a relative rounding error of 2**-8 ≈ 0.4 %): a
logit of magnitude |z| ≲ 15 moves by up to ~0.06 per rounding, and log-softmax can double
that, so `--max-diff 0.25` bounds the worst token and `--max-mean-diff 0.02` the average.

Needs: one CUDA GPU; Python 3.11 with torch (CUDA build), transformers and agl_lab's
dependencies — *including verl 0.9.1*: agl_lab's learning core (DataProto, the GRPO
advantage, the policy-loss registry) is verl's own code even on the local engine, and
importing `verl.trainer.ppo.ray_trainer` pulls Ray, tensordict, torchdata, datasets, peft,
accelerate and codetiming. vLLM is *not* needed, nor a network: the tiny model and its
tokenizer are built in code. The preflight lists exactly what is missing and how to add it.

Exit codes: 0 PASS · 1 FAIL (logprobs differ beyond tolerance, or a step failed) ·
2 missing packages · 3 no CUDA device.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# import name → pip requirement; verl's own requirements (its METADATA) are the second block
NEEDED = {
    "torch": "torch", "transformers": "transformers>=5.5.3,<5.11", "tokenizers": "tokenizers",
    "omegaconf": "omegaconf", "yaml": "pyyaml", "numpy": "numpy", "pandas": "pandas", "pydantic": "pydantic>=2",
    "fastapi": "fastapi", "uvicorn": "uvicorn", "httpx": "httpx", "aiohttp": "aiohttp", "orjson": "orjson",
    "openai": "openai", "cachetools": "cachetools", "matplotlib": "matplotlib", "tqdm": "tqdm",
    "verl": "verl==0.9.1", "ray": "ray[default]>=2.41", "tensordict": "tensordict>=0.8,<=0.10,!=0.9.0",
    "torchdata": "torchdata", "datasets": "datasets", "peft": "peft", "accelerate": "accelerate",
    "codetiming": "codetiming", "dill": "dill", "hydra": "hydra-core", "pyarrow": "pyarrow>=19",
}
# what agl_lab's local path imports from verl (checked by importing, after the specs are found)
VERL_MODULES = ("verl", "verl.trainer.ppo.core_algos", "verl.trainer.ppo.ray_trainer",
                "verl.trainer.ppo.metric_utils", "verl.utils.debug.metrics", "verl.workers.config")

SMALL = [  # a short run of configs/cpu_tiny.yaml: 8 tasks × 4 rollouts per step, one mini-batch
    "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "agl_lab.task.n_train=64", "agl_lab.task.n_val=0", "agl_lab.runner.concurrency=32",
    "agl_lab.rollout.wait_timeout_seconds=120", "agl_lab.wandb.mode=disabled",
]

# ------------------------------------------------------------------------------------------
# Preflight: say everything that is missing at once, then stop
# ------------------------------------------------------------------------------------------


def missing_packages() -> list[str]:
    missing = [req for name, req in NEEDED.items() if importlib.util.find_spec(name) is None]
    if missing:
        return missing
    for module in ("agl_lab", *VERL_MODULES):  # present but broken (a missing sub-dependency)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            name = getattr(exc, "name", None) or str(exc)
            return [f"{name} (needed by `import {module}`: {exc})"]
    return []


def cuda_problem() -> str | None:
    import torch

    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"no CUDA device visible to torch {torch.__version__} ({built}); run this on a machine "
                "with an NVIDIA GPU and a CUDA build of torch")
    return None


def preflight(dry_run: bool) -> int:
    sys.path.insert(0, str(ROOT))
    have_torch = importlib.util.find_spec("torch") is not None
    cuda = None if dry_run or not have_torch else cuda_problem()
    missing = missing_packages()
    if cuda:
        print(f"gpu_smoke: FAIL — {cuda}", flush=True)
    if missing:
        reqs = " ".join(f"'{r}'" for r in missing if " " not in r and r != "torch")
        print("gpu_smoke: FAIL — missing Python packages:\n  " + "\n  ".join(missing), flush=True)
        if "torch" in missing:
            print("  torch: install the CUDA build that matches this machine's driver (pytorch.org)", flush=True)
        print("  agl_lab's local engine imports verl's learning core (DataProto, GRPO advantage, policy-loss\n"
              "  registry), so verl 0.9.1 and its dependencies are needed even without vLLM. This script\n"
              "  runs agl_lab from this checkout and installs nothing; add the packages, keeping your torch:",
              flush=True)
        if reqs:
            print(f"    pip install {reqs}\n"
                  "  without network here, fetch wheels on a machine that has it (same Python 3.11, same OS):\n"
                  f"    pip download -d wheels {reqs}\n"
                  f"    pip install --no-index --find-links wheels {reqs}     # on this machine\n"
                  "  (drop any torch/nvidia-* wheels `pip download` pulled in: keep the CUDA torch you have)",
                  flush=True)
    if missing:
        return 2
    return 3 if cuda else 0


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def make_trainer(device: str, dtype: Any, steps: int, warm_start: int, run_dir: Path):
    """A Trainer on configs/cpu_tiny.yaml on `device`, its engine's weights in `dtype`."""
    from agl_lab.config import load_config
    from agl_lab.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "cpu_tiny.yaml",
                      [*SMALL, f"agl_lab.model.device={device}", f"agl_lab.model.warm_start_steps={warm_start}",
                       f"trainer.total_training_steps={steps}"])
    trainer = Trainer(cfg, run_dir=run_dir, console=False)
    model = trainer.engine.model
    if next(model.parameters()).dtype != dtype:  # the engine serves and trains this very module
        with trainer.engine.weights_lock:
            model.to(dtype)
    return trainer


def run_steps(trainer, steps: int, label: str) -> list[dict[str, Any]]:
    print(f"{label}\n  step  reward   lp_diff_mean  lp_diff_max  probs_diff_max  rows   step_s  rollout_s  update_s",
          flush=True)
    history = []
    for _ in range(steps):
        m = trainer.step()
        history.append(m)
        print(f"  {len(history) - 1:>4}  {m.get('training/reward', float('nan')):6.3f}   "
              f"{m.get('training/rollout_logprobs_diff_mean', float('nan')):12.2e}  "
              f"{m.get('training/rollout_logprobs_diff_max', float('nan')):11.2e}  "
              f"{m.get('training/rollout_probs_diff_max', float('nan')):14.2e}  "
              f"{m.get('training/n_sample_trained', 0):4d}  {m.get('timing_s/step', 0):7.2f}  "
              f"{m.get('timing_s/gen', 0):9.2f}  {m.get('timing_s/update', 0):8.2f}", flush=True)
    return history


def verdict(history: list[dict[str, Any]], max_diff: float, max_mean: float) -> tuple[bool, str]:
    """PASS when every step has the diff metrics and stays within both tolerances."""
    worst = [m.get("training/rollout_logprobs_diff_max") for m in history]
    means = [m.get("training/rollout_logprobs_diff_mean") for m in history]
    if any(v is None for v in worst + means):
        return False, ("a step has no rollout_logprobs_diff metric: sampling logprobs did not reach the batch "
                       "(agl_lab.server.include_log_probs must be true)")
    ok = max(worst) < max_diff and max(means) < max_mean
    return ok, (f"max |Δlogp| {max(worst):.3g} {'<' if max(worst) < max_diff else '>='} {max_diff:g}, "
                f"mean {max(means):.3g} {'<' if max(means) < max_mean else '>='} {max_mean:g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="bf16 training steps (default 4)")
    parser.add_argument("--warm-start", type=int, default=150,
                        help="supervised warm-start steps, so logits are peaked as in a trained model (default 150)")
    parser.add_argument("--max-diff", type=float, default=0.25, help="bf16 bound on max |Δlogp| (default 0.25)")
    parser.add_argument("--max-mean-diff", type=float, default=0.02, help="bf16 bound on mean |Δlogp| (default 0.02)")
    parser.add_argument("--max-diff-fp32", type=float, default=1e-3, help="float32 reference bound (default 1e-3)")
    parser.add_argument("--no-reference", action="store_true", help="skip the one-step float32 reference run")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="exercise this script on CPU (bf16 on CPU): NOT the GPU check, always exits 1")
    args = parser.parse_args(argv)

    code = preflight(args.dry_run_on_cpu)
    if code:
        return code
    import torch
    import transformers
    import verl

    device = "cpu" if args.dry_run_on_cpu else "cuda"
    name = "CPU (dry run)" if args.dry_run_on_cpu else torch.cuda.get_device_name(0)
    print(f"gpu_smoke: local engine on {name} · torch {torch.__version__} (CUDA {torch.version.cuda}) · "
          f"transformers {transformers.__version__} · verl {verl.__version__}", flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="agl_lab_gpu_smoke_") as tmp:
        with make_trainer(device, torch.bfloat16, args.steps, args.warm_start, Path(tmp) / "bf16") as trainer:
            print(f"  tiny model, bfloat16, warm start {args.warm_start} steps: ready in {time.time() - t0:.1f} s",
                  flush=True)
            history = run_steps(trainer, args.steps, "bfloat16 (serving = OpenAI server, training = full forward):")
        ok, detail = verdict(history, args.max_diff, args.max_mean_diff)
        ref_ok = True
        if not args.no_reference:
            with make_trainer(device, torch.float32, 1, args.warm_start, Path(tmp) / "fp32") as trainer:
                ref = run_steps(trainer, 1, "float32 reference (same device, one step):")
            ref_ok, ref_detail = verdict(ref, args.max_diff_fp32, args.max_diff_fp32)
            print(f"  reference: {'match' if ref_ok else 'MISMATCH'} ({ref_detail})", flush=True)
    steps_s = [m["timing_s/step"] for m in history]
    print(f"step time: first {steps_s[0]:.2f} s, then mean {sum(steps_s[1:]) / max(len(steps_s) - 1, 1):.2f} s · "
          f"total wall {time.time() - t0:.1f} s", flush=True)
    passed = ok and ref_ok
    print(f"RESULT: {'PASS' if passed else 'FAIL'} — serving vs training logprobs in bfloat16: {detail}"
          + ("" if ref_ok else " · the float32 reference does not match either: the tokens trained are not "
             "the tokens sampled"), flush=True)
    if args.dry_run_on_cpu:
        print("gpu_smoke: this was a CPU dry run of the script, not the GPU check", flush=True)
        return 1
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
