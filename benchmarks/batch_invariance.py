"""What batch-invariant numbers cost the local engine: the scheduler with and without them, in one run.

    python benchmarks/batch_invariance.py                       # tiny model, CPU, ~1 min
    python benchmarks/batch_invariance.py --model-path "$(python -c 'from agl_lab.models import smollm2; print(smollm2())')"

A GRPO-shaped load straight into `BatchScheduler` (no HTTP): `--groups` prompts × `--n` samples,
all submitted at once, each generating `--max-tokens` tokens (`ignore_eos`), seeded. Each mode
runs `--repeats` times, alternating, so load drift hits both alike; the table gives the best
and median wall time of each and the cost of the invariant mode relative to the plain one.
The last column checks the claim: a seeded request's logprobs are identical in every
invariant run (they need not be in the plain mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from agl_lab.engines.serving.scheduler import BatchScheduler, SamplingParams
from agl_lab.engines.tiny import load_model_and_tokenizer


def one_run(scheduler: BatchScheduler, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, list]:
    """→ (wall seconds, every request's logprobs) for all prompts × n samples submitted at once."""
    t0 = time.perf_counter()
    futures = [
        scheduler.submit(p, SamplingParams(max_tokens=args.max_tokens, seed=1000 * g + i, ignore_eos=True))
        for g, p in enumerate(prompts)
        for i in range(args.n)
    ]
    logprobs = [f.result().logprobs for f in futures]
    return time.perf_counter() - t0, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the decode loop")
    parser.add_argument("--model-path", default=None, help="HF model directory (default: the tiny model)")
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model_path, device="cpu")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.groups)]

    times: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list] = {True: [], False: []}
    for _ in range(args.repeats):
        for invariant in (False, True):
            scheduler = BatchScheduler(model, tokenizer, num_threads=args.num_threads)
            scheduler.batch_invariant = invariant
            one_run(scheduler, prompts[:1], argparse.Namespace(n=2, max_tokens=4))  # warm-up: packing
            wall, logprobs = one_run(scheduler, prompts, args)
            scheduler.close()
            times[invariant].append(wall)
            outputs[invariant].append(logprobs)

    tokens = args.groups * args.n * args.max_tokens
    name = os.path.basename(args.model_path) if args.model_path else "tiny"
    print(
        f"\nbatch invariance, {name} on CPU ({args.num_threads} thread(s)), {args.groups}×{args.n} requests × "
        f"{args.max_tokens} tokens, prompts of {args.prompt_tokens}, {args.repeats} runs each, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'mode':>10} {'best s':>8} {'median s':>9} {'tok/s (best)':>13} {'cost':>7} {'same logprobs every run':>24}"
    )
    base = min(times[False])
    for invariant in (False, True):
        t = times[invariant]
        same = all(o == outputs[invariant][0] for o in outputs[invariant])
        cost = f"{min(t) / base - 1:+.0%}" if invariant else "-"
        mode = "invariant" if invariant else "plain"
        print(
            f"{mode:>10} {min(t):>8.2f} {statistics.median(t):>9.2f} {tokens / min(t):>13.0f} {cost:>7} {str(same):>24}"
        )


if __name__ == "__main__":
    main()
