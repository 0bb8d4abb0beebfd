r"""A decode step beside another thread's idle OpenMP pool, kept or given back (`engines.openmp`, #51).

The local engine computes on two threads: the trainer's (the update) and the decode loop's. GNU
OpenMP keeps a worker pool per thread that ever ran a parallel region; with more pooled threads than
cores it stops letting idle workers spin, and every parallel region waits for a wake-up. Here a
helper thread plays the trainer (one parallel op, then idle) while this thread decodes SmolLM2 +
LoRA r16 (or `--model-path`) — 2 torch threads each, the helper's pool kept or released, the two
cases taking turns for `--repeat` rounds on the same batches:

    kept        the helper's pool stays (the engine before `openmp.release_threads`)
    released    the helper gave its pool back (`LocalEngine.resume` does this for the trainer's thread)

Columns: decode step ms by rows (median of steps 4..N over the rounds), released / kept.

    python benchmarks/openmp_pools.py [--rows 1,4,8,16] [--steps 15] [--repeat 2] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_lab.engines import openmp  # noqa: E402
from agl_lab.engines.serving.decode_batch import DecodeBatch  # noqa: E402
from benchmarks.adapted import adapted_model  # noqa: E402
from benchmarks.host import describe  # noqa: E402

CASES = ("kept", "released")


class Helper:
    """A thread that computes once (its pool made) and waits; `keep(False)` makes it give the pool back."""

    def __init__(self):
        self._orders: list[bool] = []
        self._cv = threading.Condition()
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        torch.set_num_threads(2)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._orders)
                keep = self._orders.pop()
            torch.ones(1 << 22).mul_(2.0)  # a parallel region: the pool exists
            if not keep:
                openmp.release_threads()
            self._done.set()

    def keep(self, keep: bool) -> None:
        self._done.clear()
        with self._cv:
            self._orders.append(keep)
            self._cv.notify()
        self._done.wait()
        time.sleep(0.2)  # released workers end a moment later


def decode_ms(model, rows: int, steps: int) -> list[float]:
    vocab = min(40000, model.config.vocab_size)
    gen = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(1, vocab, (200 + 13 * i,), generator=gen).tolist() for i in range(rows)]
    with torch.inference_mode():
        batch, logits = DecodeBatch.prefill(model, prompts, [1.0] * rows, [1.0] * rows, [True] * rows, pad_id=0)
        times = []
        for _ in range(steps):
            batch.tokens = logits.argmax(-1)
            t0 = time.perf_counter()
            logits = batch.decode(model)
            times.append(1000 * (time.perf_counter() - t0))
    return times[3:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--model-path", help="an HF model directory (default: SmolLM2-135M, the preset)")
    args = p.parse_args(argv)
    if not openmp.available():
        print("# torch here does not run on GNU OpenMP: nothing to release (both cases are the same)")
    model, path = adapted_model(args.model_path)
    rows = [int(r) for r in args.rows.split(",")]
    helper = Helper()
    times = {(case, n): [] for case in CASES for n in rows}
    print(f"# {Path(path).name} + LoRA r16, {args.steps} steps a case, {args.repeat} rounds")
    print(describe(), flush=True)
    for _ in range(args.repeat):
        for case in CASES:
            helper.keep(case == "kept")
            for n in rows:
                times[case, n] += decode_ms(model, n, args.steps)
    print(f"{'rows':>5} | {'kept ms':>9} | {'released ms':>11} | {'released/kept':>13}")
    for n in rows:
        kept, released = (statistics.median(times[case, n]) for case in CASES)
        print(f"{n:>5} | {kept:>9.1f} | {released:>11.1f} | {released / kept:>13.3f}")
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
