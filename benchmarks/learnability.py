"""Learnability of the `lookup` task: does GRPO raise the reward of the warm-started tiny model?

A direct experiment, with no server in the loop, so it measures the *task* and the
*hyper-parameters*, not the plumbing. Per step:

  1. sample `batch` tasks, `n` rollouts each (a GRPO group), and play every episode
     multi-turn with HF `generate` (temperature 1, no top-k/top-p): each call is rendered
     with the chat template exactly as the OpenAI server would render the agent's messages;
  2. keep each call's sampled ids and their *true* logprobs (log_softmax of the output logits);
  3. group-normalised advantage A = (r - mean_group) / (std_group + 1e-6), one per rollout;
  4. one AdamW step (grad norm clipped at 1.0, verl's default) on the per-rollout mean
     policy-gradient loss
         L = -(1/N) Σ_rollouts A · (1/T_rollout) Σ_tokens log π(token)
     (on-policy, one update per batch, so the PPO ratio is 1 and clipping is moot).

Prints the reward curve per seed and a summary table: mean reward of the first 10 and
last 10 steps, the ratio and the gain, and the wall time. Exit code 0 when every seed
meets the demo target: last10 >= 2 x first10 and last10 - first10 >= 0.25.

    python benchmarks/learnability.py                       # recommended settings, seeds 0 1 2
    python benchmarks/learnability.py --lr 5e-4 --steps 80 --seeds 0 3

Measured (2 shared CPU cores; warm start 200 steps; batch 8 x n 4; 100 steps; lr 3e-4):

    seed  first10  last10  ratio   gain   success first10 -> last10   RL wall time
       0    0.258   0.887   3.44  +0.63   0.19 -> 0.87                 ~25 s idle machine
       1    0.227   0.934   4.11  +0.71   0.15 -> 0.93                 (60-200 s when the
       2    0.361   0.908   2.52  +0.55   0.30 -> 0.90                  cores were shared)
       3    0.190   0.726   3.82  +0.54   0.11 -> 0.68

lr 1e-3 was unstable (2 of 3 seeds collapsed: into `get` loops, or into unparseable
text); lr 5e-4 learns faster (>= 0.85 by step 70 on seeds 0-1) but a fast seed can rise so
much within the first 10 steps that the ratio lands just under 2 (seed 2: 1.98).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.engines.warmstart import warm_start
from agl_lab.tasks import get_task, lookup

# ---------------------------------------------------------------------------------------------
# Sampling multi-turn episodes with HF generate
# ---------------------------------------------------------------------------------------------


def render(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True))


@torch.no_grad()
def generate(model, tok, prompts: list[list[int]], max_tokens: int, temperature: float):
    """Sample one reply per prompt; returns [(response_ids, logprobs)] (ids end at EOS if hit)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    new = out.sequences[:, width:]
    logp = torch.stack(out.logits, 1).float().div(temperature).log_softmax(-1)
    logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for i in range(len(prompts)):
        row = new[i].tolist()
        end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        results.append((row[:end], logp[i, :end].tolist()))
    return results


def play_batch(model, tok, tasks, max_tokens: int, temperature: float):
    """Play every task to the end, batching the k-th call of all live episodes together.

    Returns (envs, calls) where calls[i] = [(prompt_ids, response_ids, logprobs), ...].
    """
    envs = [lookup.LookupEnv(t) for t in tasks]
    convs = [env.first_messages() for env in envs]
    calls: list[list] = [[] for _ in tasks]
    while True:
        live = [i for i, env in enumerate(envs) if not env.episode.done]
        if not live:
            return envs, calls
        prompts = [render(tok, convs[i]) for i in live]
        for i, p, (resp, lp) in zip(live, prompts, generate(model, tok, prompts, max_tokens, temperature)):
            reply = tok.decode(resp, skip_special_tokens=True)
            calls[i].append((p, resp, lp))
            obs = envs[i].step(reply)
            if obs is not None:
                convs[i] = lookup.append_turn(convs[i], reply, obs)


# ---------------------------------------------------------------------------------------------
# One GRPO step
# ---------------------------------------------------------------------------------------------


def group_advantages(rewards: list[float], n: int) -> list[float]:
    """(r - group mean) / (group std + 1e-6) over consecutive groups of n rollouts."""
    out = []
    for g in range(0, len(rewards), n):
        grp = torch.tensor(rewards[g : g + n])
        out += ((grp - grp.mean()) / (grp.std(unbiased=True) + 1e-6)).tolist()
    return out


def policy_gradient_step(model, optim, tok, calls, advantages, grad_clip: float = 1.0) -> float:
    """Per-rollout mean PG loss over every call of every rollout; one clipped optimiser step."""
    rows, weights = [], []
    for rollout_calls, adv in zip(calls, advantages):
        n_tokens = sum(len(r) for _, r, _ in rollout_calls)
        for p, r, _ in rollout_calls:
            rows.append((p, r))
            weights.append(adv / max(n_tokens, 1) / len(calls))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    att = torch.zeros_like(ids)
    tgt_mask = torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(rows):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        att[i, : len(seq)] = 1
        tgt_mask[i, len(p) : len(seq)] = 1  # response positions
    model.train()
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    w = torch.tensor(weights).unsqueeze(1) * tgt_mask[:, 1:]
    loss = -(w * logp).sum()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # verl's actor default: 1.0
    optim.step()
    model.eval()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------------------------


def run_seed(args, seed: int) -> dict:
    """Warm start (cached) + `args.steps` GRPO steps for one seed; returns the curves and timings."""
    model, tok = load_model_and_tokenizer(seed=args.model_seed, device="cpu")
    t0 = time.perf_counter()
    warm_start(model, tok, get_task("lookup"), args.warm_steps, seed, cache_dir=args.cache_dir)
    t_warm = time.perf_counter() - t0
    torch.manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pool = lookup.train_tasks(args.steps * args.batch, seed)
    curve, success, n_calls = [], [], []
    t1 = time.perf_counter()
    for step in range(args.steps):
        tasks = [t for t in pool[step * args.batch : (step + 1) * args.batch] for _ in range(args.n)]
        envs, calls = play_batch(model, tok, tasks, args.max_tokens, args.temperature)
        rewards = [env.reward() for env in envs]
        policy_gradient_step(model, optim, tok, calls, group_advantages(rewards, args.n), args.grad_clip)
        curve.append(statistics.mean(rewards))
        success.append(statistics.mean(lookup.reward(e.task, e.episode.answer) for e in envs))
        n_calls.append(statistics.mean(len(c) for c in calls))
        if args.verbose and step % 10 == 9:
            print(
                f"  seed {seed} step {step + 1:3d} reward {statistics.mean(curve[-10:]):.3f} success "
                f"{statistics.mean(success[-10:]):.3f} calls {statistics.mean(n_calls[-10:]):.2f}",
                flush=True,
            )
    return {
        "seed": seed,
        "curve": curve,
        "success": success,
        "calls": statistics.mean(n_calls),
        "t_warm": t_warm,
        "t_rl": time.perf_counter() - t1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="tasks per step")
    ap.add_argument("--n", type=int, default=4, help="rollouts per task (group size)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=lookup.MAX_TOKENS)
    ap.add_argument("--warm-steps", type=int, default=lookup.WARM_START_STEPS)
    ap.add_argument("--cache-dir", default=None, help="warm-start cache (default: the tiny model cache)")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"lookup learnability: batch {args.batch} x n {args.n}, {args.steps} steps, lr {args.lr}, "
        f"warm start {args.warm_steps} steps, max_tokens {args.max_tokens}, {args.threads} threads",
        flush=True,
    )
    results = [run_seed(args, s) for s in args.seeds]
    print(
        f"\n{'seed':>4} {'first10':>8} {'last10':>8} {'ratio':>6} {'gain':>6} {'succ0':>6} {'succ1':>6} "
        f"{'calls':>5} {'warm_s':>6} {'rl_s':>6}  ok   (succ = task success, calls = LLM calls per rollout)"
    )
    all_ok = True
    for r in results:
        a, b = statistics.mean(r["curve"][:10]), statistics.mean(r["curve"][-10:])
        s0, s1 = statistics.mean(r["success"][:10]), statistics.mean(r["success"][-10:])
        ok = b >= 2 * a and b - a >= 0.25
        all_ok &= ok
        print(
            f"{r['seed']:>4} {a:8.3f} {b:8.3f} {b / max(a, 1e-9):6.2f} {b - a:+6.3f} {s0:6.3f} {s1:6.3f} "
            f"{r['calls']:5.2f} {r['t_warm']:6.1f} {r['t_rl']:6.1f}  {'yes' if ok else 'NO'}"
        )
        print(
            "     curve (10-step means): "
            + " ".join(f"{statistics.mean(r['curve'][i : i + 10]):.2f}" for i in range(0, len(r["curve"]), 10))
        )
    print(f"\ntarget (last10 >= 2 x first10 and >= +0.25): {'met for every seed' if all_ok else 'NOT met'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
