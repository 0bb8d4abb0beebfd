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

Each variant is timed `repeat` times from the same weights; the best is reported (a shared machine).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from agl_lab.engines.base import logprob_gap
from agl_lab.engines.local import LocalEngine

VARIANTS = ("full", "lora", "lora + bypass")


def matmul_flops(n: int = 1024, repeat: int = 10) -> float:
    """FLOP/s of a float32 [n, n] @ [n, n] with torch's current threads (best of `repeat`)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_variant(name: str, model_dir: str, data, args) -> dict[str, float | str]:
    lora = {"lora_rank": args.rank, "lora_alpha": 2 * args.rank} if name.startswith("lora") else None
    engine = LocalEngine(model_dir, device="cpu", max_model_len=2048, lora=lora,
                         actor={"ppo_mini_batch_size": args.rollouts, "ppo_micro_batch_size_per_gpu": args.micro,
                                "loss_mode": "vanilla", "lr": args.lr},
                         log_prob_micro_batch_size=args.micro, bypass_mode=name.endswith("bypass"))
    try:
        start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        prepare_s, update_s = [], []
        for _ in range(args.repeat):  # each repeat from the same weights and a fresh optimizer
            engine.model.load_state_dict(start)
            engine.optimizer.state.clear()
            batch = copy.deepcopy(data)
            t0 = time.perf_counter()
            batch, _ = engine.prepare(batch)  # old logprobs: recomputed, or the sampling ones in bypass mode
            prepare_s.append(time.perf_counter() - t0)
            gap = logprob_gap(batch).get("training/rollout_logprobs_diff_max", float("nan"))
            if name.endswith("bypass"):  # what the skipped pass would have shown
                gap = logprob_gap(_with_recomputed(engine, batch)).get("training/rollout_logprobs_diff_max",
                                                                       float("nan"))
            t1 = time.perf_counter()
            metrics = engine.update(batch)
            update_s.append(time.perf_counter() - t1)
        n_params = sum(p.numel() for p in engine.model.parameters() if not _is_adapter(p, engine))
        trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    finally:
        engine.close()
    tokens = int(data.batch["attention_mask"].sum())
    flops = (4 if lora else 6) * n_params * tokens
    prep, upd = min(prepare_s), min(update_s)  # best of `repeat`: the machine is shared
    return {"variant": name, "trainable params": trainable, "old logprobs s": round(prep, 2),
            "actor update s": round(upd, 2), "total s": round(prep + upd, 2),
            "update GFLOP/s": round(flops / upd / 1e9, 1), "pg_loss": metrics["actor/pg_loss"],
            "lp_diff_max": gap}


def _is_adapter(p: torch.Tensor, engine: LocalEngine) -> bool:
    return engine.lora_params is not None and p.requires_grad


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
    args = parser.parse_args(argv)

    import pandas as pd

    from agl_lab.models import preset_dir
    from benchmarks.update import rollout_batch

    model_dir = str(preset_dir(args.preset))
    engine = LocalEngine(model_dir, device="cpu", max_model_len=2048)
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
    print(f"{args.preset}: {len(data)} rows from {args.rollouts} rollouts in {rollout_s:.1f} s, "
          f"{int(data.batch['attention_mask'].sum())} attended tokens; torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for name in VARIANTS:
        rows.append(run_variant(name, model_dir, data, args))
        print(rows[-1], f"load {os.getloadavg()[0]:.2f}", flush=True)
    table = pd.DataFrame(rows).set_index("variant")
    peak = matmul_flops() / 1e9
    table["vs matmul"] = (table["update GFLOP/s"] / peak).round(2)
    print(f"\nplain float32 matmul (1024²): {peak:.1f} GFLOP/s\n")
    print(table.to_string())


if __name__ == "__main__":
    main()
