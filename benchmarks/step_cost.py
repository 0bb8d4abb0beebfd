"""What a training step's update stage costs on a real model: full fine-tune vs LoRA vs LoRA + bypass.

One batch of real rollouts (the `calc` task through the token-preserving gateway, as
`configs/cpu_smollm2.yaml` runs it) is built once; each variant starts from the same base
weights and runs the two passes `agl_lab.update.run_update` pays for, on that same batch:

    full           old logprobs (forward) + actor update (forward + backward, AdamW over all weights)
    lora           the same with verl's LoRA keys (lora_rank, lora_alpha, target_modules=all-linear):
                   backward still flows through every layer, but no weight gradient of the base
                   and AdamW over the adapter only
    lora + bypass  `algorithm.rollout_correction.bypass_mode=true`: the sampling logprobs are the old
                   logprobs, no forward pass; justified when the logprob gap (sampling vs recomputed,
                   printed for every variant) is at float32 noise

The floor: the update's achieved FLOP/s (≈ 6·N·T for a full fine-tune, 4·N·T with LoRA — the
weight-gradient third skipped — for N parameters and T attended tokens) next to a plain torch
matmul's on this machine, measured in the same run with the same threads.

    python benchmarks/step_cost.py [--preset smollm2-135m] [--rollouts 16] [--micro 4] [--rank 8] [--repeat 3]

`--compare work` compares, instead, the work the update does (issue 38), LoRA + bypass as in
configs/cpu_smollm2_learn.yaml, the same batch with half its groups at advantage exactly 0 (the
recorded calc runs had 38–52 % zero rows):

    padded          every micro-batch forwarded, every row's prompt through the body
    + zero-skip     agl_lab.algorithm.skip_zero_advantage (agl_lab/engines/zero_skip.py)
    + shared prefix actor_rollout_ref.actor.use_prefix_grouper (agl_lab/engines/shared_prefix.py)
    both

with the exactness of each against padded (gradients: max |Δg| / max |g|, and bit-equal or not;
|Δ pg_loss|), the tokens through the body (`actor/body_tokens`), FLOPs (4·N·tokens for LoRA)
and their rate next to the matmul's.

The variants take turns for `repeat` rounds, each run from the same weights and a fresh optimizer; the
best of each is reported, and the matmul's best between the rounds (a shared machine: load drifts hit all alike).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

from agl_lab.engines.base import logprob_gap
from agl_lab.engines.local import LocalEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.host`, `benchmarks.update`, run as a script

from benchmarks.host import matmul_rate  # noqa: E402

VARIANTS = ("full", "lora", "lora + bypass")
WORK_VARIANTS = {  # name → (skip_zero_advantage, use_prefix_grouper)
    "padded": (False, False),
    "+ zero-skip": (True, False),
    "+ shared prefix": (False, True),
    "both": (True, True),
}


class Variant:
    """One engine of the comparison, kept alive so the variants can take turns (load drifts hit all alike)."""

    def __init__(self, name: str, model_dir: str | None, args: argparse.Namespace):
        work = WORK_VARIANTS.get(name)
        self.name, self.lora = name, name.startswith("lora") or work is not None
        skip, prefix = work or (False, False)
        self.engine = LocalEngine(
            model_dir,
            device="cpu",
            max_model_len=args.max_model_len,
            lora={"lora_rank": args.rank, "lora_alpha": 2 * args.rank} if self.lora else None,
            actor={
                "ppo_mini_batch_size": args.rollouts,
                "ppo_micro_batch_size_per_gpu": args.micro,
                "loss_mode": "per_rollout_mean" if work else "vanilla",
                "lr": args.lr,
                "skip_zero_advantage": skip,
                "use_prefix_grouper": prefix,
            },
            log_prob_micro_batch_size=args.micro,
            bypass_mode=name.endswith("bypass") or work is not None,
        )
        self.start = {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}
        self.prepare_s: list[float] = []
        self.update_s: list[float] = []

    def run(self, data) -> None:
        """Old logprobs + one update, from the starting weights and a fresh optimizer."""
        engine = self.engine
        engine.model.load_state_dict(self.start)
        engine.optimizer.state.clear()
        batch = copy.deepcopy(data)
        t0 = time.perf_counter()
        batch, _ = engine.prepare(batch)  # old logprobs: recomputed, or the sampling ones in bypass mode
        self.prepare_s.append(time.perf_counter() - t0)
        if self.name in VARIANTS:  # --compare engines: the gap bypass stops measuring
            probe = _with_recomputed(engine, batch) if engine.bypass_mode else batch
            self.gap = logprob_gap(probe).get("training/rollout_logprobs_diff_max", float("nan"))
        t1 = time.perf_counter()
        self.metrics = engine.update(batch)
        self.update_s.append(time.perf_counter() - t1)
        self.grads = torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.requires_grad])

    def row(self, tokens: int) -> dict[str, float | str]:
        params = self.engine.model.parameters
        n_base = sum(p.numel() for p in params() if not (self.lora and p.requires_grad))
        flops = (4 if self.lora else 6) * n_base * tokens  # LoRA: no weight-gradient third for the base
        prep, upd = min(self.prepare_s), min(self.update_s)  # best of the repeats: the machine is shared
        return {
            "variant": self.name,
            "trainable params": sum(p.numel() for p in params() if p.requires_grad),
            "old logprobs s": round(prep, 2),
            "actor update s": round(upd, 2),
            "total s": round(prep + upd, 2),
            "update GFLOP/s": round(flops / upd / 1e9, 1),
            "pg_loss": self.metrics["actor/pg_loss"],
            "lp_diff_max": self.gap,
        }

    def work_row(self, padded: Variant) -> dict[str, float | str]:
        """The `--compare work` row: seconds, body tokens, FLOPs and exactness against `padded`."""
        n_base = sum(p.numel() for p in self.engine.model.parameters() if not p.requires_grad)
        upd, m = min(self.update_s), self.metrics
        body = m["actor/body_tokens"]
        flops = 4 * n_base * body  # LoRA: no weight gradient for the frozen base
        g, g0 = self.grads, padded.grads
        return {
            "variant": self.name,
            "update s": round(upd, 2),
            "vs padded": round(min(padded.update_s) / upd, 2),
            "rows fwd": int(m["actor/diagnostic_rows"]),
            "body tokens": int(body),
            "shared prefix": int(m.get("actor/shared_prefix_tokens", 0)),
            "TFLOP": round(flops / 1e12, 2),
            "GFLOP/s": round(flops / upd / 1e9, 1),
            "grad bit-equal": bool(torch.equal(g, g0)),
            "max|Δg|/max|g|": float((g - g0).abs().max() / g0.abs().max()),
            "pg_loss": m["actor/pg_loss"],  # ≈ −Σ Â at ratio 1: ±1 advantages nearly cancel, so |Δ|, not relative
            "|Δ pg_loss|": abs(m["actor/pg_loss"] - padded.metrics["actor/pg_loss"]),
        }


def _with_recomputed(engine: LocalEngine, batch):
    probe = copy.deepcopy(batch)
    probe.batch["old_log_probs"] = engine.compute_log_probs(probe, float(probe.meta_info.get("temperature", 1.0)))
    return probe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--task", default="calc")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4, help="ppo_micro_batch_size_per_gpu (rows)")
    parser.add_argument("--rank", type=int, default=8, help="lora_rank (lora_alpha = 2·rank)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats per variant (best is reported)")
    parser.add_argument("--max-prompt-length", type=int, default=512)
    parser.add_argument("--max-response-length", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048, help="1024 for --preset tiny")
    parser.add_argument("--compare", choices=("engines", "work"), default="engines")
    parser.add_argument("--n", type=int, default=4, help="rollouts per group (--compare work)")
    args = parser.parse_args(argv)

    import pandas as pd

    from agl_lab.models import preset_dir
    from benchmarks.update import rollout_batch

    model_dir = None if args.preset == "tiny" else str(preset_dir(args.preset))
    engine = LocalEngine(model_dir, device="cpu", max_model_len=args.max_model_len)
    try:
        t0 = time.perf_counter()
        data = rollout_batch(engine, args.task, args.rollouts, args.max_prompt_length, args.max_response_length).data
        rollout_s = time.perf_counter() - t0
    finally:
        engine.close()
    resp = data.batch["response_mask"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(data))])[:, None]
    data.batch["advantages"] = sign * resp.float()  # ±1 per row: a GRPO batch with spread rewards
    data.meta_info["temperature"] = 1.0
    if args.compare == "work":
        _half_the_groups_zero(data, args.n)
    print(
        f"{args.preset}: {len(data)} rows from {args.rollouts} rollouts in {rollout_s:.1f} s, "
        f"{int(data.batch['attention_mask'].sum())} attended tokens; torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    names = WORK_VARIANTS if args.compare == "work" else VARIANTS
    variants = [Variant(name, model_dir, args) for name in names]
    peaks = []
    try:
        for r in range(args.repeat):  # round-robin: each round runs every variant once
            peaks.append(matmul_rate("float32", torch.get_num_threads()))
            for v in variants:
                v.run(data)
                print(
                    f"round {r + 1}: {v.name}: old logprobs {v.prepare_s[-1]:.1f} s, update {v.update_s[-1]:.1f} s "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
        peaks.append(matmul_rate("float32", torch.get_num_threads()))
        tokens = int(data.batch["attention_mask"].sum())
        if args.compare == "work":
            rows = [v.work_row(variants[0]) for v in variants]
        else:
            rows = [v.row(tokens) for v in variants]
        table = pd.DataFrame(rows).set_index("variant")
    finally:
        for v in variants:
            v.engine.close()
    peak = max(peaks)  # GFLOP/s: the best matmul of the run, measured between the rounds
    rate = "GFLOP/s" if args.compare == "work" else "update GFLOP/s"
    table["vs matmul"] = (table[rate] / peak).round(2)
    print(f"\nplain float32 matmul (1024², {torch.get_num_threads()} threads, best of the run): {peak:.1f} GFLOP/s\n")
    print(table.to_string())
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (a shared machine: seconds are best of {args.repeat})")


def _half_the_groups_zero(data, n: int) -> None:
    """Groups of `n` consecutive rollouts: every other group's advantage set to exactly 0 (the
    recorded calc runs: 38–52 % zero rows), the rest ±1 per row, then the per-rollout
    normalisation (D counts every rollout, as the trainer's)."""
    from agl_lab.algorithms.loss import normalize_batch

    rollouts = list(dict.fromkeys(data.non_tensor_batch["rollout_id_list"]))
    group = {r: i // n for i, r in enumerate(rollouts)}
    for row, rid in enumerate(data.non_tensor_batch["rollout_id_list"]):
        if group[rid] % 2 == 1:
            data.batch["advantages"][row] = 0.0
    normalize_batch(data)


if __name__ == "__main__":
    main()
