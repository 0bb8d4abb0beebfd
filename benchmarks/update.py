"""Profile the local engine's update stage on a real model: old logprobs + actor update.

Rollouts run for real (the `calc` task through the token-preserving gateway, as
`configs/cpu_smollm2.yaml` runs them), the batch is built with the config's limits
(`max_prompt_length` 512, `max_response_length` 256: every row padded to 768 columns), and
the two passes of `agl_lab.update.run_update` that cost are timed side by side on the *same*
batch and the same starting weights:

    old logprobs   engine.compute_log_probs (forward only, micro-batches of 4 rows)
    actor update   engine.update (forward + backward per micro-batch, one AdamW step)

with the padding columns no row attends to passed through the model (`--no-trim`, the
engine before it trimmed them) or cut per micro-batch (the default). The loss is the same
either way: the printed `pg_loss` and parameter change of both runs are compared.

    python benchmarks/update.py [--preset smollm2-135m] [--rollouts 16] [--micro 4]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
from unittest import mock

import torch

from agl_lab.batch import build_batch
from agl_lab.engines import local_ppo
from agl_lab.engines.base import logprob_gap
from agl_lab.engines.local import LocalEngine
from agl_lab.protocol import Model
from agl_lab.server.embedded import EmbeddedServer
from agl_lab.tasks import get_task


def rollout_batch(engine: LocalEngine, task: str, n: int, p: int, r: int):
    """`n` real rollouts of `task` through a token-preserving gateway → the built batch."""
    from benchmarks.token_preserving import run_step

    server = EmbeddedServer(default_proxy={"model_name": engine.model_name}, token_preserving=True)
    try:
        server.store.upsert_models([Model(model=engine.model_name, endpoint=engine.endpoints()[0])])
        server.set_tokenizer(engine.model_name, engine.tokenizer)
        spec = get_task(task)
        completed = run_step(server, spec.agent, spec.train_tasks(n, 0), 0)
    finally:
        server.stop()
    return build_batch(
        completed,
        "trajectory",
        max_prompt_length=p,
        max_response_length=r,
        pad_token_id=engine.tokenizer.pad_token_id,
        tokenizer=engine.tokenizer,
    )


def timed_passes(engine: LocalEngine, data, start_state: dict) -> dict[str, float]:
    """Old logprobs then one update from `start_state`; wall seconds and what the update did."""
    engine.model.load_state_dict(start_state)
    engine.optimizer.state.clear()
    batch = copy.deepcopy(data)
    t0 = time.perf_counter()
    batch.batch["old_log_probs"] = engine.compute_log_probs(batch, 1.0)
    t1 = time.perf_counter()
    metrics = engine.update(batch)
    t2 = time.perf_counter()
    change = max((p.detach() - start_state[k]).abs().max().item() for k, p in engine.model.named_parameters())
    gap = logprob_gap(batch)
    return {
        "old logprobs s": round(t1 - t0, 1),
        "actor update s": round(t2 - t1, 1),
        "pg_loss": metrics["actor/pg_loss"],
        "grad_norm": metrics["actor/grad_norm"],
        "max |Δw|": change,
        "lp_diff_max": gap.get("training/rollout_logprobs_diff_max", float("nan")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--task", default="calc")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4, help="ppo_micro_batch_size_per_gpu (rows)")
    parser.add_argument("--max-prompt-length", type=int, default=512)
    parser.add_argument("--max-response-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args(argv)

    from agl_lab.models import preset_dir

    engine = LocalEngine(
        str(preset_dir(args.preset)),
        device="cpu",
        max_model_len=2048,
        actor={
            "ppo_mini_batch_size": args.rollouts,
            "ppo_micro_batch_size_per_gpu": args.micro,
            "loss_mode": "vanilla",
            "lr": args.lr,
        },
        log_prob_micro_batch_size=args.micro,
    )
    try:
        t0 = time.perf_counter()
        built = rollout_batch(engine, args.task, args.rollouts, args.max_prompt_length, args.max_response_length)
        rollout_s = time.perf_counter() - t0
        data = built.data
        mask, resp = data.batch["attention_mask"], data.batch["response_mask"]
        rlen = data.batch["attention_mask"][:, -resp.shape[1] :].sum(-1)
        plen = mask.sum(-1) - rlen
        rewards = data.non_tensor_batch.get("reward")
        print(
            f"{len(data)} rows from {args.rollouts} rollouts in {rollout_s:.1f} s; columns {mask.shape[1]} "
            f"(P {args.max_prompt_length} + R {args.max_response_length}); prompt tokens "
            f"{int(plen.min())}–{int(plen.max())}, response tokens {int(rlen.min())}–{int(rlen.max())}; "
            f"attended {mask.float().mean():.1%} of the cells; torch threads {torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        # advantages: ±1 per row (a GRPO batch with spread rewards), on the loss tokens
        sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(data))])[:, None]
        data.batch["advantages"] = sign * resp.float()
        data.meta_info["temperature"] = 1.0
        if rewards is not None:
            print("rewards:", [round(float(x), 2) for x in rewards])
        start = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        rows = {}
        for trim in (False, True):
            # "padded (before)": the engine before it cut unattended columns (_trim as a no-op)
            untrimmed = mock.patch.object(local_ppo, "_trim", lambda ids, mask, pos, r: (ids, mask, pos, r))
            with contextlib.nullcontext() if trim else untrimmed:
                rows["trimmed" if trim else "padded (before)"] = timed_passes(engine, data, start)
            print(
                ("trimmed" if trim else "padded (before)"),
                rows["trimmed" if trim else "padded (before)"],
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        a, b = rows["padded (before)"], rows["trimmed"]
        print(
            f"speed-up: old logprobs {a['old logprobs s'] / b['old logprobs s']:.2f}x, "
            f"update {a['actor update s'] / b['actor update s']:.2f}x; |Δ pg_loss| "
            f"{abs(a['pg_loss'] - b['pg_loss']):.2e}"
        )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
