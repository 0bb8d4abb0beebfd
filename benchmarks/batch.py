"""Benchmark `build_batch`: 512 rollouts × 8 calls × ~256 new tokens per call (append-only agent).

Each call adds ~128 observation tokens and samples ~128 response tokens on top of a 256-token
first prompt, so every call extends the previous context (no merge break). Prints, for both
levels, the build time (median of 5, verl already imported), rows/s and the forward-pass
token count (sum of attended tokens over rows), whose ratio is the compute saved by merging.

    python benchmarks/batch.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from agl_lab.batch import build_batch
from agl_lab.records import CompletedRollout, Triplet

N_ROLLOUTS, N_CALLS, FIRST_PROMPT = 512, 8, 256


def make_rollouts(seed: int = 0) -> list[CompletedRollout]:
    rng = np.random.default_rng(seed)
    rollouts = []
    for k in range(N_ROLLOUTS):
        context = rng.integers(1, 50_000, FIRST_PROMPT).tolist()
        triplets = []
        for call in range(N_CALLS):
            if call:
                context = context + rng.integers(1, 50_000, int(rng.integers(64, 193))).tolist()  # observation
            response = rng.integers(1, 50_000, int(rng.integers(64, 193))).tolist()
            logprobs = (-rng.random(len(response))).tolist()
            triplets.append(Triplet(list(context), response, logprobs))
            context = context + response
        rollouts.append(CompletedRollout(f"r{k}", f"d{k // 8}", 0, k // 8, triplets, float(k % 2)))
    return rollouts


def measure(rollouts: list[CompletedRollout], level: str, p: int, r: int) -> dict:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        result = build_batch(rollouts, level, max_prompt_length=p, max_response_length=r)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    rows = len(result.data)
    tokens = int(result.data.batch["attention_mask"].sum())
    padded = int(result.data.batch["attention_mask"].numel())
    return {"level": level, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds,
            "forward_tokens": tokens, "padded_tokens": padded,
            "truncated": result.metrics["training/n_truncated_sample"],
            "dropped": result.metrics["training/n_dropped_prompt_too_long"]}


def main() -> None:
    rollouts = make_rollouts()
    build_batch(rollouts[:2], "trajectory", max_prompt_length=256, max_response_length=2560)  # import verl
    results = [
        measure(rollouts, "trajectory", 256, 2560),
        measure(rollouts, "transition", 2560, 192),
    ]
    print(f"{N_ROLLOUTS} rollouts x {N_CALLS} calls, first prompt {FIRST_PROMPT} tokens, ~256 new tokens per call")
    print(f"{'level':<11} {'rows':>6} {'time (s)':>9} {'rows/s':>9} {'forward tokens':>15} {'padded tokens':>14} {'trunc':>6} {'drop':>5}")
    for res in results:
        print(f"{res['level']:<11} {res['rows']:>6} {res['seconds']:>9.3f} {res['rows_per_s']:>9.0f} "
              f"{res['forward_tokens']:>15,} {res['padded_tokens']:>14,} {res['truncated']:>6} {res['dropped']:>5}")
    ratio = results[1]["forward_tokens"] / results[0]["forward_tokens"]
    print(f"transition / trajectory forward tokens: {ratio:.2f}x")


if __name__ == "__main__":
    main()
