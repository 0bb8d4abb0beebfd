"""The in-place KV slab (#51 item 2) against the re-pad + `torch.cat` one it replaced, in one run.

    python benchmarks/kv_slab.py                       # tiny model, CPU, ~1 min
    python benchmarks/kv_slab.py --model-path "$(python -c 'from agl_lab.models import smollm2; print(smollm2())')"

A continuous-batching load straight into `DecodeBatch` (no scheduler thread, no HTTP), driven
as `BatchScheduler` drives it — decode the running rows, prefill and merge the arrivals,
retire the finished rows: a GRPO group of `--n` rows arrives every `--every` steps
(`--groups` groups), each with its own prompt length and reply length, so rows retire from
the middle of the batch. The old implementation is read from git (`--old`, default the
commit before the change) into a temporary module; both run the same schedule, alternating
`--repeats` times. The table gives, per implementation, the medians of: decode-step ms, ms
per arrival (merge) and per retirement (select), and the whole run's seconds; the last line checks that both produced the same tokens and
logprobs bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from agl_lab.engines.serving import decode_batch
from agl_lab.engines.serving.decode_batch import sample_tokens
from agl_lab.engines.tiny import load_model_and_tokenizer

OLD_COMMIT = "271a058"  # the last commit with the re-pad + cat slab
PATH = "agl_lab/engines/serving/decode_batch.py"


def old_module(commit: str):
    """`decode_batch.py` as of `commit`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{commit}:{PATH}"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_decode_batch.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_decode_batch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def schedule(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, reply tokens) per row, seeded."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for g in range(args.groups):
        n = int(torch.randint(args.prompt_min, args.prompt_max + 1, (), generator=gen))
        prompt = torch.randint(4, vocab, (n,), generator=gen).tolist()
        for _ in range(args.n):
            rows.append((g * args.every, prompt, int(torch.randint(8, args.max_tokens + 1, (), generator=gen))))
    return rows


def run(module, model, rows: list, invariant: bool) -> dict:
    """Drive `module.DecodeBatch` through the schedule → timings and every row's logprobs."""
    times = {"decode": [], "merge": [], "select": []}
    logprobs: list[list[float]] = [[] for _ in rows]
    running: list[int] = []
    batch, step = None, 0
    t_run = time.perf_counter()

    def sample(logits, ids, b):
        u = torch.tensor([((7919 * r + len(logprobs[r])) % 1000) / 1000 for r in ids], dtype=torch.float64)
        tokens, logp = sample_tokens(logits, b.temps, b.top_p, b.greedy, u, b.nucleus)
        b.tokens = tokens
        for r, lp in zip(ids, logp.gather(1, tokens[:, None])[:, 0].tolist()):
            logprobs[r].append(lp)

    with torch.inference_mode():
        while step == 0 or running or any(at >= step for at, _, _ in rows):
            if running:
                t0 = time.perf_counter()
                logits = batch.decode(model, invariant=invariant)
                times["decode"].append(time.perf_counter() - t0)
                sample(logits, running, batch)
            new = [r for r, (at, _, _) in enumerate(rows) if at == step]
            if new:
                k = len(new)
                fresh, logits = module.DecodeBatch.prefill(
                    model, [rows[r][1] for r in new], [1.0] * k, [0.95] * k, [False] * k, pad_id=0, invariant=invariant
                )
                sample(logits, new, fresh)
                if running:
                    t0 = time.perf_counter()
                    batch = batch.merge(fresh)
                    times["merge"].append(time.perf_counter() - t0)
                else:
                    batch = fresh
                running = running + new
            keep = [i for i, r in enumerate(running) if len(logprobs[r]) < rows[r][2]]
            if len(keep) < len(running):
                if keep:
                    t0 = time.perf_counter()
                    batch = batch.select(keep)
                    times["select"].append(time.perf_counter() - t0)
                else:
                    batch = None
                running = [running[i] for i in keep]
            step += 1
    return {"times": times, "logprobs": logprobs, "run_s": time.perf_counter() - t_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--n", type=int, default=4, help="rows per group (a GRPO group)")
    parser.add_argument("--every", type=int, default=6, help="decode steps between two arrivals")
    parser.add_argument("--prompt-min", type=int, default=60)
    parser.add_argument("--prompt-max", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--invariant", action="store_true", help="the batch-invariant decode")
    parser.add_argument("--old", default=OLD_COMMIT, help="commit of the re-pad + cat implementation")
    parser.add_argument("--model-path", default=None, help="HF model directory (default: the tiny model)")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    model = load_model_and_tokenizer(args.model_path, device="cpu")[0]
    rows = schedule(args, model.config.vocab_size)
    impls = {"re-pad + cat (old)": old_module(args.old), "in place (new)": decode_batch}
    results: dict[str, list[dict]] = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, module in impls.items():
            results[name].append(run(module, model, rows, args.invariant))

    def ms(name: str, key: str) -> float:
        return 1000 * statistics.median(t for r in results[name] for t in r["times"][key])

    first = results[next(iter(impls))][0]
    print(
        f"load {os.getloadavg()[0]:.1f}; {len(rows)} rows, {first['times']['merge'].__len__()} merges, "
        f"{len(first['times']['select'])} retirements, {len(first['times']['decode'])} decode steps; "
        f"threads {args.num_threads}; invariant {args.invariant}"
    )
    print("| slab | decode step ms | merge ms | select ms | run s |")
    print("|---|---:|---:|---:|---:|")
    for name in impls:
        run_s = statistics.median(r["run_s"] for r in results[name])
        print(
            f"| {name} | {ms(name, 'decode'):.2f} | {ms(name, 'merge'):.2f} | {ms(name, 'select'):.2f} | {run_s:.2f} |"
        )
    same = all(r["logprobs"] == first["logprobs"] for rs in results.values() for r in rs)
    print("logprobs bit-identical across implementations and repeats:", same)


if __name__ == "__main__":
    main()
