r"""The LoRA update through the merged product beside PEFT's own layer, on one SmolLM2 `calc` batch (#51).

`configs/cpu_smollm2_learn.yaml` (LoRA r16 on every linear, shared prefix, bypass), seed 0: one
rollout phase, one batch, then `trainer.update(batch, allow_reuse=True)` with the two forwards
taking turns for `--repeat` rounds (each update moves the adapter, so the rounds see slightly
different weights — alike for both):

    merged         this checkout: each adapted projection runs `lora._MergedProduct` (x @ (W + s·B@A)ᵀ,
                   the weight the engine decodes with; A's and B's gradients from rank-r products)
    peft           PEFT's `lora.Linear.forward`: W x + s · B(A(x)), three products, a scale and an add
    merged-bf16    `agl_lab.model.compute_dtype=bfloat16` as this checkout runs it: the merged product
                   and every frozen linear (the LM head) from bfloat16 weight copies, the rest float32
    autocast-bf16  the same key under `torch.autocast("cpu", bfloat16)` (PEFT's layer; every
                   weight cast at each use, bfloat16 attention) — how it ran before the copies
    logits-picked  `merged`, with the shared-prefix suffix's response positions picked from the
                   V-wide logits after HF's forward and the logits divided by the temperature even
                   at 1.0 — how it ran before `shared_prefix._head_apart` and `at_temperature`
    verl-scores    `merged`, the response tokens scored by verl's `logprobs_from_logits` and
                   `entropy_from_logits` (autograd's V-wide backward; the entropy's own softmax and
                   log-sum-exp) instead of `shared_prefix._TokenLogprobs` — how it ran before
    sdpa           `merged`, with HF's own `sdpa` attention (each KV head's keys and values copied for
                   its query heads, summed back in the backward) instead of the grouped one
                   (`engines.grouped_attention`) — how it ran before

Columns: update seconds (median and best of the rounds) and `aten::mm` calls of the last round's
update (torch.profiler, that round untimed).

    python benchmarks/lora_update.py [--repeat 3] [--cases merged,peft,...] [--config PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agl_lab.engines import local_ppo, lora, precision, shared_prefix  # noqa: E402
from agl_lab.engines.grouped_attention import GROUPED_SDPA  # noqa: E402
from agl_lab.trainer import Trainer  # noqa: E402
from benchmarks.host import describe  # noqa: E402

PLAIN_HEAD, at_temperature = shared_prefix._PLAIN_HEAD, shared_prefix.at_temperature
SCORES = shared_prefix.score_responses
OVERRIDES = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"]


CASES = ("merged", "peft", "merged-bf16", "autocast-bf16", "logits-picked", "verl-scores", "sdpa")


def use(model, case: str, grouped: bool) -> None:
    """Bind the case's forward on every adapted projection (`add_lora` binds the merged one) and
    set its precision."""
    for proj in lora.adapted_layers(model):
        if case == "peft":
            proj.forward = type(proj).forward.__get__(proj)
        else:
            proj.forward = lora._forward.__get__(proj)
    precision.set_compute_dtype(model, torch.bfloat16 if case.endswith("bf16") else None)
    precision.use_weight_copies(model, case != "autocast-bf16")
    if grouped:  # the model runs the grouped attention unless the case is HF's own
        model.set_attn_implementation("sdpa" if case == "sdpa" else GROUPED_SDPA)
    local_ppo.score_responses = shared_prefix.score_responses = _verl_scores if case == "verl-scores" else SCORES
    before = case == "logits-picked"
    shared_prefix._PLAIN_HEAD = frozenset() if before else PLAIN_HEAD
    local_ppo.at_temperature = shared_prefix.at_temperature = _always_divide if before else at_temperature


def _verl_scores(logits, responses, attended, response_length, entropy):
    """`shared_prefix.score_responses` as it was: verl's functions, autograd's backward."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    attended = attended.to(logits.device, logits.dtype)
    widen = lambda t: torch.nn.functional.pad(t * attended, (0, response_length - t.shape[1]))  # noqa: E731
    logprobs = widen(logprobs_from_logits(logits, responses.to(logits.device)))
    if entropy == "none":
        return logprobs, None
    return logprobs, widen(entropy_from_logits(logits if entropy == "grad" else logits.detach()))


def _always_divide(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cpu_smollm2_learn.yaml")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default="merged,peft", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = p.parse_args(argv)
    from torch.profiler import profile

    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        p.error(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    print(describe(), flush=True)  # before the cases and after them: a shared host's speed drifts
    seconds: dict[str, list[float]] = {c: [] for c in cases}
    mm: dict[str, int] = {}
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Trainer.from_config(
            args.config, overrides=[*OVERRIDES, *args.overrides], run_dir=run_dir, console=False
        ) as trainer,
    ):
        batch = trainer.build_batch(trainer.rollout())
        model = trainer.engine.model
        grouped = model.config._attn_implementation == GROUPED_SDPA  # a GQA model on the CPU
        if "sdpa" in cases and not grouped:
            print(f"# case sdpa: this model runs {model.config._attn_implementation!r}, not the grouped attention")
        trainer.update(batch, allow_reuse=True)  # warm: allocator, oneDNN, the merge of this version
        for round_ in range(args.repeat + 1):
            for case in cases:
                use(model, case, grouped)
                if round_ == args.repeat:
                    with profile() as prof:
                        trainer.update(batch, allow_reuse=True)
                    mm[case] = sum(e.count for e in prof.key_averages() if e.key == "aten::mm")
                    continue
                t0 = time.perf_counter()
                trainer.update(batch, allow_reuse=True)
                seconds[case].append(time.perf_counter() - t0)
                print(f"#   round {round_ + 1} {case}: {seconds[case][-1]:.2f} s", flush=True)
        use(model, "merged", grouped)
    print(f"{'forward':<13} | {'median s':>9} | {'best s':>7} | {'aten::mm':>8}")
    for case in cases:
        print(f"{case:<13} | {statistics.median(seconds[case]):>9.2f} | {min(seconds[case]):>7.2f} | {mm[case]:>8}")
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
