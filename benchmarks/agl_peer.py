"""Time AGL 1.0.2's `RolloutAdapter.get_train_data_batch` in whatever Python runs this file.

`benchmarks/batch.py` runs it with `--agl-python PATH` as a subprocess of AGL's own environment
(verl 0.8.0, numpy 1.26; see batch.py's docstring for the recipe), and imports its helpers for
the in-process mode. It imports nothing from agl_lab (agl_lab needs verl 0.9.1): only numpy,
torch and agentlightning, so it runs on both sides.

    python benchmarks/agl_peer.py --rollouts IN.npz --level trajectory --max-prompt-length 256 \
        --max-response-length 2560 --repeat 5 --out OUT.pt

IN.npz holds the rollouts (`save_rollouts`, written by batch.py); the peer warms the adapter on two
of them (verl imported, first call made), then times `repeat` builds, each on fresh AGL rollouts
built untimed, and writes to OUT.pt (`torch.save`, plain tensors, lists and numbers only, so
`torch.load(weights_only=True)` reads it): the median wall and CPU seconds, the environment's
versions, and the last DataProto's tensors and non-tensor columns for the identity check.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

# One rollout: (rollout_id, data_id, step, sample_idx, final_reward, [(prompt_ids, response_ids, logprobs)])
Record = tuple[str, str, int, int, float, list[tuple[list[int], list[int], list[float]]]]


def save_rollouts(path: str, records: list[Record]) -> None:
    """Write append-only rollouts compactly: each rollout's final context once, plus each call's
    prompt and response lengths (every call's prompt + response is a prefix of that context)."""
    contexts, prompt_len, response_len, calls, logprobs = [], [], [], [], []
    for rollout_id, _, _, _, _, triplets in records:
        prompt, response, _ = triplets[-1]
        context = np.asarray(prompt + response, dtype=np.int64)
        for p, r, lp in triplets:
            n = len(p) + len(r)
            if n > len(context) or not np.array_equal(np.asarray(p + r, dtype=np.int64), context[:n]):
                raise ValueError(f"{rollout_id}: a call's prompt + response is not a prefix of the last call's")
            prompt_len.append(len(p))
            response_len.append(len(r))
            logprobs.append(np.asarray(lp, dtype=np.float64))
        contexts.append(context)
        calls.append(len(triplets))
    np.savez(
        path,
        context=np.concatenate(contexts),
        context_len=np.array([len(c) for c in contexts]),
        calls=np.array(calls),
        prompt_len=np.array(prompt_len),
        response_len=np.array(response_len),
        logprobs=np.concatenate(logprobs),
        rollout_id=np.array([r[0] for r in records]),
        data_id=np.array([r[1] for r in records]),
        step=np.array([r[2] for r in records]),
        sample_idx=np.array([r[3] for r in records]),
        final_reward=np.array([r[4] for r in records], dtype=np.float64),
    )


def load_rollouts(path: str) -> list[Record]:
    with np.load(path, allow_pickle=False) as f:
        data = {k: f[k] for k in f.files}
    records, c0, k, l0 = [], 0, 0, 0
    for i, n in enumerate(data["context_len"].tolist()):
        context = data["context"][c0 : c0 + n].tolist()
        c0 += n
        triplets = []
        for _ in range(int(data["calls"][i])):
            p, r = int(data["prompt_len"][k]), int(data["response_len"][k])
            triplets.append((context[:p], context[p : p + r], data["logprobs"][l0 : l0 + r].tolist()))
            k, l0 = k + 1, l0 + r
        records.append(
            (
                str(data["rollout_id"][i]),
                str(data["data_id"][i]),
                int(data["step"][i]),
                int(data["sample_idx"][i]),
                float(data["final_reward"][i]),
                triplets,
            )
        )
    return records


def to_agl(records: list[Record]) -> list:
    """Fresh AGL rollouts (logprobs copied: AGL's trajectory level extends the first triplet's in place)."""
    from agentlightning.verl.agl_rollout_manager import CompletedRollout, Triplet

    return [
        CompletedRollout(
            rollout_id=rid,
            data_id=did,
            step=step,
            sample_idx_in_step=idx,
            enqueue_time=0.0,
            final_reward=reward,
            triplets=[
                Triplet(prompt={"token_ids": p}, response={"token_ids": r, "log_probs": list(lp)})
                for p, r, lp in triplets
            ],
        )
        for rid, did, step, idx, reward, triplets in records
    ]


def agl_builder(level: str, max_prompt_length: int, max_response_length: int):
    from agentlightning.verl.rollout_adapter import RolloutAdapter

    adapter = RolloutAdapter(
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        device=torch.device("cpu"),
        pad_token_id=0,
        trace_aggregator_level=level,
    )
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


def environment() -> dict[str, str]:
    """Versions of what the timing depends on, in this interpreter."""
    versions = {"python": platform.python_version()}
    for name in ("agentlightning", "verl", "numpy", "torch", "tensordict"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "-"
    return versions


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", required=True)
    p.add_argument("--level", required=True, choices=("trajectory", "transition"))
    p.add_argument("--max-prompt-length", type=int, required=True)
    p.add_argument("--max-response-length", type=int, required=True)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    records = load_rollouts(args.rollouts)
    build = agl_builder(args.level, args.max_prompt_length, args.max_response_length)
    build(to_agl(records[:2]))  # warm: verl imported, the adapter's first call made
    wall, cpu, out = timed(build, args.repeat, setup=lambda: to_agl(records))
    result: dict[str, Any] = {
        "wall_s": wall,
        "cpu_s": cpu,
        "env": environment(),
        "batch": {k: v.contiguous() for k, v in out.batch.items()},
        "non_tensor": {k: np.asarray(v).tolist() for k, v in out.non_tensor_batch.items()},
    }
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
