"""float32 vs bfloat16 matrix products on this CPU (`agl_lab.model.compute_dtype`, agl_lab/engines/precision.py).

Two tables, each variant side by side in one run (best of `--repeat` rounds, the variants taking turns):

    products   one matrix product at the model's shapes: the decode step's (M = `--rows` rows through
               oneDNN's packed kernels, as `fast_decode` runs them: float32 weights vs packed bfloat16
               copies with the input cast in and the output cast out) and the update's (M = rows ×
               `--tokens`, `F.linear` in float32 vs under CPU autocast)
    model      the model's forward + backward on `--rows` × `--tokens` tokens (the update's work for
               one micro-batch, LoRA-free: every weight frozen but one MLP), float32 vs autocast, and
               the largest |Δ logprob| of the tokens' logprobs between the two (random ids: a
               harsher case than text)

What the tables do not say is what a training step gains: the step has more than products (attention,
norms, the optimizer, Python between the ops) — `benchmarks/overlap.py --cases sync,sync-bf16` times that.

    python benchmarks/precision.py [--preset smollm2-135m] [--rows 16] [--tokens 64] [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_seconds(fn: Callable[[], object], repeat: int, inner: int) -> float:
    fn()  # warm: kernels chosen, weights packed
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def packed(weight: torch.Tensor, mixed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fast_decode`'s own product on its own packed copy of `weight` (bfloat16 when `mixed`)."""
    from agl_lab.engines.serving.fast_decode import pack, packed_product

    return partial(packed_product, packed=pack(weight, mixed), mixed=mixed)


def products(cfg, rows: int, tokens: int, repeat: int) -> list[tuple[str, float, float]]:
    d, ff, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out = []
    with torch.inference_mode():
        for name, (n_out, n_in) in {"mlp up": (ff, d), "mlp down": (d, ff), "lm head": (vocab, d)}.items():
            w, x = torch.randn(n_out, n_in), torch.randn(rows, n_in)
            a, b = packed(w, mixed=False), packed(w, mixed=True)
            inner = max(1, int(2e8 // (rows * n_in * n_out)))
            out.append((f"decode {name}, M={rows}", best_seconds(partial(a, x), repeat, inner),
                        best_seconds(partial(b, x), repeat, inner)))  # fmt: skip
        w, x = torch.randn(ff, d), torch.randn(rows * tokens, d)

        def autocast_linear():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.linear(x, w)

        out.append((f"update mlp up, M={rows * tokens}", best_seconds(partial(F.linear, x, w), repeat, 3),
                    best_seconds(autocast_linear, repeat, 3)))  # fmt: skip
    return out


def model_pass(model, ids: torch.Tensor, mixed: bool) -> tuple[float, torch.Tensor]:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        logits = model(input_ids=ids, use_cache=False).logits
    # the logprob of each next token, as the loss reads them (not the whole vocabulary's tails)
    picked = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])
    picked.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, picked.detach()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m", help="a model preset (agl_lab/models.py) or tiny")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from agl_lab.engines.tiny import load_model_and_tokenizer
    from agl_lab.models import preset_dir

    model, _ = load_model_and_tokenizer(None if args.preset == "tiny" else preset_dir(args.preset), device="cpu")
    print(
        f"# {args.preset}, {args.threads} thread(s), best of {args.repeat}; load {Path('/proc/loadavg').read_text()[:14]}"
    )
    print(f"{'product':<28} | {'float32 ms':>10} | {'bf16 ms':>8} | {'speed-up':>8}")
    print("-" * 64)
    for name, a, b in products(model.config, args.rows, args.tokens, args.repeat):
        print(f"{name:<28} | {a * 1e3:>10.3f} | {b * 1e3:>8.3f} | {a / b:>7.2f}×")

    for q in model.parameters():
        q.requires_grad_(False)
    for q in model.model.layers[0].mlp.parameters():
        q.requires_grad_(True)  # a gradient path through every layer, as LoRA's
    ids = torch.randint(0, model.config.vocab_size, (args.rows, args.tokens))
    times = {False: [], True: []}
    logprobs = {}
    for _ in range(args.repeat + 1):
        for mixed in (False, True):
            seconds, logprobs[mixed] = model_pass(model, ids, mixed)
            times[mixed].append(seconds)
    a, b = min(times[False][1:]), min(times[True][1:])  # the first round warms
    gap = (logprobs[True] - logprobs[False]).abs().max().item()
    print()
    print(f"{'model pass':<28} | {'float32 s':>10} | {'bf16 s':>8} | {'speed-up':>8} | {'max |Δ logprob|':>15}")
    print("-" * 82)
    print(f"{f'fwd+bwd {args.rows}×{args.tokens} tokens':<28} | {a:>10.3f} | {b:>8.3f} | {a / b:>7.2f}× | {gap:>15.3g}")


if __name__ == "__main__":
    main()
