r"""A prefix every row shares, held once (`decode_batch.SharedPrefix`) or copied into every row's slab (#51).

SmolLM2-135M (or `--model-path`) + LoRA r16, 2 torch threads. Each case prefills `rows` prompts that begin with the same
`--prefix` tokens (served from one `CachedPrefix`, as a GRPO phase's calls begin with one system
prompt and tool list) and `--suffix` tokens of their own, then decodes `--steps` greedy steps; the
two layouts take turns on the same prompts in one process:

    rows      the prefix's columns copied into each row's slab (the layout before #51's block;
              `SHARED_MIN` raised for the prefill, `keep_shared(0)` for the decode)
    block     one copy, every row's queries of a KV head read it in one product (`_cascade_attention`)

Columns: prefill ms (best of the rounds), decode step ms (median of steps 4..N), and the largest
|Δ logit| between the layouts after the last step (float32 summation order: ~1e-4).

    python benchmarks/shared_block.py [--rows 1,2,4,8,12,16] [--prefix 290] [--suffix 20] [--steps 25] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_lab.engines.serving import decode_batch  # noqa: E402
from agl_lab.engines.serving.decode_batch import DecodeBatch  # noqa: E402
from agl_lab.engines.serving.prefix_cache import CachedPrefix  # noqa: E402
from benchmarks.adapted import adapted_model  # noqa: E402
from benchmarks.host import describe  # noqa: E402

LAYOUTS = ("rows", "block")


def prefill(
    model, prompts: list[list[int]], entry: CachedPrefix, layout: str
) -> tuple[DecodeBatch, torch.Tensor, float]:
    """The prompts prefilled after the cached prefix in `layout` → (batch, logits, seconds)."""
    n, floor = len(prompts), decode_batch.SHARED_MIN
    decode_batch.SHARED_MIN = floor if layout == "block" else 1 << 30
    try:
        t0 = time.perf_counter()
        batch, logits = DecodeBatch.prefill(
            model, prompts, [1.0] * n, [1.0] * n, [True] * n, pad_id=0,
            prefixes=[entry] * n, prefix_lens=[len(entry.tokens)] * n,
        )  # fmt: skip
        return batch, logits, time.perf_counter() - t0
    finally:
        decode_batch.SHARED_MIN = floor


def measure(model, entry: CachedPrefix, rows: int, suffix: int, steps: int, rounds: int = 3) -> dict:
    gen, vocab = torch.Generator().manual_seed(rows), min(40000, model.config.vocab_size)
    prompts = [entry.tokens + torch.randint(1, vocab, (suffix + i,), generator=gen).tolist() for i in range(rows)]
    prefill_s = {name: min(prefill(model, prompts, entry, name)[2] for _ in range(rounds)) for name in LAYOUTS}
    batches, times, logits = {}, {name: [] for name in LAYOUTS}, {}
    for name in LAYOUTS:
        batch, out, _ = prefill(model, prompts, entry, name)
        assert (batch.shared is not None) == (name == "block"), name
        batch.tokens, batches[name] = out.argmax(-1), batch
    for _ in range(steps):
        for name, batch in batches.items():
            t0 = time.perf_counter()
            logits[name] = batch.decode(model)
            times[name].append(time.perf_counter() - t0)
            batch.tokens = logits["rows"].argmax(-1) if name == "block" else logits[name].argmax(-1)
    return {
        **{f"{n}_prefill_ms": 1000 * prefill_s[n] for n in LAYOUTS},
        **{f"{n}_ms": 1000 * statistics.median(times[n][3:]) for n in LAYOUTS},
        "max_dlogit": (logits["rows"] - logits["block"]).abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,12,16")
    p.add_argument(
        "--prefix", type=int, default=290, help="tokens every prompt begins with (calc's system prompt: ~290)"
    )
    p.add_argument("--suffix", type=int, default=20, help="each row's own prompt tokens (row i: suffix + i)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--model-path", help="an HF model directory (default: SmolLM2-135M, the preset)")
    args = p.parse_args(argv)
    model, path = adapted_model(args.model_path)
    with torch.inference_mode():
        vocab = min(40000, model.config.vocab_size)
        shared = torch.randint(1, vocab, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()
        first, _ = DecodeBatch.prefill(model, [shared], [1.0], [1.0], [True], pad_id=0)
        entry = CachedPrefix(shared, *first.row_kv(0))
        print(
            f"# {Path(path).name} + LoRA r16, prefix {args.prefix} + suffix {args.suffix}+i tokens, {args.steps} steps"
        )
        print(describe(), flush=True)
        head = (
            "rows",
            "prefill rows ms",
            "prefill block ms",
            "decode rows ms",
            "decode block ms",
            "block/rows",
            "max |dlogit|",
        )
        print(" | ".join(f"{h:>16}" for h in head))
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(model, entry, rows, args.suffix, args.steps)
            cells = (rows, r["rows_prefill_ms"], r["block_prefill_ms"], r["rows_ms"], r["block_ms"],
                     r["block_ms"] / r["rows_ms"])  # fmt: skip
            print(" | ".join(f"{c:>16.3f}" if isinstance(c, float) else f"{c:>16}" for c in cells)
                  + f" | {r['max_dlogit']:>16.2e}", flush=True)  # fmt: skip
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
