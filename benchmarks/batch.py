"""Benchmark `build_batch` against Agent Lightning's `RolloutAdapter`, side by side in one run.

Shape: 512 rollouts × 8 calls, an append-only agent: a 256-token first prompt, then each call
adds ~128 observation tokens and samples ~128 response tokens (64..192), so every call extends
the previous context (no merge break). Levels: trajectory (P=256, R=2560: one row per rollout,
~1.2 M ids) and transition (P=2560, R=192: one row per call, ~4.9 M prompt ids).

For each level it prints the warm build time (median of `--repeat`, verl already imported) of
agl_lab and of AGL 1.0.2's `RolloutAdapter.get_train_data_batch` (when `agentlightning` is
importable: `pip install --no-deps --ignore-requires-python agentlightning==1.0.2 httpx-retries
structlog`), the ratio, and whether the two DataProtos are bit-identical on every key both emit
(token_level_scores compared after AGL's bfloat16 cast). Without `agentlightning` the AGL column
shows the figures of issue #17 (quiet machine, 2026-11-30), labelled as such.

Where the time went (profile of the previous implementation, trajectory level, 2-core machine):
~55 % converting ragged Python lists to arrays with `np.fromiter(chain(...))` (~40 ns/id, four
passes: prompts, responses, response mask, logprobs), ~35 % the trajectory merge (copying every
prompt with `list()`, slicing twice per prefix test, growing response/mask/logprob lists call by
call), the rest padding and the DataProto. Now: a merged row is the last call's prompt + response
(each call extends the previous context, so nothing is rebuilt call by call), the prefix test
compares slices without copying the prompt first, masks and logprobs are scattered from the
(row, start, length) spans of the model tokens with numpy, and ids convert once with
`np.array(list)` (~20 ns/id). At the transition level the prompts of one rollout share their
prefixes: each prompt that extends the previous call's context converts only its new tail.
What remains is about the floor: one conversion per distinct id and one prefix comparison per call.

    python benchmarks/batch.py [--repeat 5] [--no-agl]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_lab.batch import build_batch  # noqa: E402
from agl_lab.records import CompletedRollout, Triplet  # noqa: E402

N_ROLLOUTS, N_CALLS, FIRST_PROMPT = 512, 8, 256
SHAPES = {"trajectory": (256, 2560), "transition": (2560, 192)}  # level -> (P, R)
# Issue #17 (quiet 2-core machine, 2026-11-30, warm medians): used only without agentlightning.
ISSUE_AGL_MS = {"trajectory": 433.0}


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
        # copy_idx keeps our sort (step, sample_idx, copy_idx) equal to AGL's stable (step, sample_idx)
        rollouts.append(CompletedRollout(f"r{k}", f"d{k // 8}", 0, k // 8, triplets, float(k % 2), copy_idx=k % 8))
    return rollouts


def agl_available() -> bool:
    return importlib.util.find_spec("agentlightning") is not None


def to_agl(rollouts: list[CompletedRollout]) -> list:
    from agentlightning.verl.agl_rollout_manager import CompletedRollout as AglRollout
    from agentlightning.verl.agl_rollout_manager import Triplet as AglTriplet

    return [AglRollout(rollout_id=r.rollout_id, data_id=r.data_id, step=r.step, sample_idx_in_step=r.sample_idx,
                       enqueue_time=0.0, final_reward=r.final_reward,
                       triplets=[AglTriplet(prompt={"token_ids": t.prompt_ids},
                                            response={"token_ids": t.response_ids, "log_probs": list(t.logprobs)})
                                 for t in r.triplets])
            for r in rollouts]


def agl_builder(level: str, p: int, r: int):
    from agentlightning.verl.rollout_adapter import RolloutAdapter

    adapter = RolloutAdapter(max_prompt_length=p, max_response_length=r, device=torch.device("cpu"),
                             pad_token_id=0, trace_aggregator_level=level)
    return lambda rollouts: adapter.get_train_data_batch(rollouts)[0]


def timed(fn, repeat: int, setup=lambda: None) -> tuple[float, float, object]:
    """Median wall and CPU seconds of `fn(setup())` over `repeat` runs (setup untimed), last output.

    CPU = this process's user+system time: on a loaded machine it excludes the time spent
    waiting for a core, so it is the steadier of the two."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        arg = setup()
        out = None
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(arg)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus), out


def compare(ours, agl) -> str:
    """'yes' if every tensor/non-tensor both emit is bit-identical, else the differing keys."""
    bad = []
    for key in agl.batch.keys():
        a, o = agl.batch[key], ours.batch[key]
        if key == "token_level_scores":
            o = o.to(a.dtype)
        if a.shape != o.shape or a.dtype != o.dtype or not torch.equal(a, o):
            bad.append(key)
    for key, a in agl.non_tensor_batch.items():
        if list(a) != list(ours.non_tensor_batch[key]):
            bad.append(key)
    return "yes" if not bad else "NO: " + ",".join(bad)


def shown(ms: float) -> str:
    return "n/a" if math.isnan(ms) else f"{ms:.0f}"


def speed_up(agl_ms: float, ours_ms: float) -> str:
    return "n/a" if math.isnan(agl_ms) else f"{agl_ms / ours_ms:.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-agl", action="store_true", help="skip AGL even when importable")
    args = p.parse_args()
    rollouts = make_rollouts()
    build_batch(rollouts[:2], "trajectory", max_prompt_length=256, max_response_length=2560)  # import verl
    use_agl = agl_available() and not args.no_agl
    print(f"{N_ROLLOUTS} rollouts x {N_CALLS} calls, first prompt {FIRST_PROMPT} tokens, ~256 new tokens per call; "
          f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} (1-min avg, start); median of {args.repeat}")
    print(f"{'':<17} {'wall ms (median)':^36} {'CPU ms (median)':^31}")
    print(f"{'level':<11} {'rows':>5} {'agl_lab':>9} {'AGL':>15} {'speed-up':>9} {'agl_lab':>9} {'AGL':>10} "
          f"{'speed-up':>9} {'identical':>9} {'forward tokens':>15} {'padded tokens':>14}")
    forward = {}
    for level, (pl, rl) in SHAPES.items():
        ours_s, ours_cpu, ours = timed(lambda _: build_batch(rollouts, level, max_prompt_length=pl, max_response_length=rl),
                             args.repeat)
        if use_agl:
            build = agl_builder(level, pl, rl)
            # fresh copies each run: AGL's trajectory level extends the first triplet's logprobs in place
            agl_s, agl_cpu, agl = timed(build, args.repeat, setup=lambda: to_agl(rollouts))
            agl_ms, agl_label, same = agl_s * 1000, f"{agl_s * 1000:.0f}", compare(ours.data, agl)
            agl_cpu_ms = agl_cpu * 1000
            del agl
        elif level in ISSUE_AGL_MS:
            agl_ms, agl_cpu_ms, same = ISSUE_AGL_MS[level], float("nan"), "n/a"
            agl_label = f"{agl_ms:.0f} (issue)"
        else:
            agl_ms, agl_cpu_ms, agl_label, same = float("nan"), float("nan"), "n/a", "n/a"
        mask = ours.data.batch["attention_mask"]
        forward[level] = int(mask.sum())
        print(f"{level:<11} {len(ours.data):>5} {ours_s * 1000:>9.0f} {agl_label:>15} "
              f"{speed_up(agl_ms, ours_s * 1000):>9} {ours_cpu * 1000:>9.0f} {shown(agl_cpu_ms):>10} "
              f"{speed_up(agl_cpu_ms, ours_cpu * 1000):>9} {same:>9} {forward[level]:>15,} {mask.numel():>14,}")
        del ours
    print(f"load={os.getloadavg()[0]:.1f} (end); transition / trajectory forward tokens: "
          f"{forward['transition'] / forward['trajectory']:.2f}x")
    if not use_agl:
        print("AGL column: issue #17's figures (agentlightning not importable), not measured in this run.")


if __name__ == "__main__":
    main()
