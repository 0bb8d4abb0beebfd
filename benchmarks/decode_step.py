r"""One decode step of SmolLM2-135M (or `--model-path`) + LoRA r16: this checkout's `fast_decode` beside another revision's (#51).

Both modules decode their own copy of the same batch — `--rows` prompts of 200 + 13·i random tokens,
prefilled once, greedy — taking turns step by step in one process (so the host's drift hits them
alike), 2 torch threads. The adapter's B is random (a trained adapter: the merged weights differ
from the base). Columns: medians over steps 4..N in ms, their ratio, and the largest |Δ logit| of
the last step (0 when the function is bitwise unchanged).

    python benchmarks/decode_step.py [--before HEAD~1] [--rows 4,8,16] [--steps 30] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agl_lab.engines.serving import fast_decode  # noqa: E402
from agl_lab.engines.serving.decode_batch import DecodeBatch  # noqa: E402
from benchmarks.adapted import adapted_model  # noqa: E402
from benchmarks.host import describe  # noqa: E402


def module_at(rev: str) -> types.ModuleType:
    """`agl_lab/engines/serving/fast_decode.py` as it is at git revision `rev`, as a module."""
    src = subprocess.run(
        ["git", "show", f"{rev}:agl_lab/engines/serving/fast_decode.py"], cwd=ROOT, capture_output=True, text=True
    )
    if src.returncode != 0:
        raise SystemExit(f"--before {rev}: {src.stderr.strip()}")
    module = types.ModuleType(f"fast_decode_{rev}")
    exec(compile(src.stdout, f"fast_decode@{rev}", "exec"), module.__dict__)
    return module


def measure(model, modules: dict, rows: int, steps: int) -> dict:
    vocab = min(40000, model.config.vocab_size)
    prompts = [
        torch.randint(1, vocab, (200 + 13 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(rows)
    ]
    times: dict[str, list[float]] = {name: [] for name in modules}
    logits = {}
    with torch.inference_mode():
        batches = {
            name: DecodeBatch.prefill(model, prompts, [1.0] * rows, [1.0] * rows, [True] * rows, pad_id=0)[0]
            for name in modules
        }
        for _ in range(steps):
            for name, module in modules.items():
                b = batches[name]
                mask = torch.cat([b.mask, b.mask.new_ones((b.size, 1))], dim=1)
                t0 = time.perf_counter()
                logits[name] = module.decode_step(model, b.layers, b.tokens, b.positions, mask)
                times[name].append(time.perf_counter() - t0)
                b.mask, b.positions, b.tokens = mask, b.positions + 1, logits[name].argmax(-1)
    before, now = (logits[n] for n in modules)
    out = {f"{n}_ms": 1000 * statistics.median(t[3:]) for n, t in times.items()}
    return {**out, "max_dlogit": (before - now).abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="HEAD~1", help="git revision of the module to compare with")
    p.add_argument("--rows", default="4,8,16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model-path", help="an HF model directory (default: SmolLM2-135M, the preset)")
    args = p.parse_args(argv)
    model, path = adapted_model(args.model_path)
    modules = {"before": module_at(args.before), "now": fast_decode}
    print(f"# {Path(path).name} + LoRA r16, {args.steps} steps a case, before = {args.before}")
    print(describe(), flush=True)
    print(f"{'rows':>5} | {'before ms':>10} | {'now ms':>10} | {'now/before':>10} | {'max |dlogit|':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(model, modules, rows, args.steps)
        print(
            f"{rows:>5} | {r['before_ms']:>10.1f} | {r['now_ms']:>10.1f} | "
            f"{r['now_ms'] / r['before_ms']:>10.3f} | {r['max_dlogit']:>12.2e}",
            flush=True,
        )
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
