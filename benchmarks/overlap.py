r"""Synchronous steps vs generation overlapping the update (#50 item 4, docs/engines.md "Overlap").

The SmolLM2 `calc` recipe of docs/real-model.md (`configs/cpu_smollm2_learn.yaml`, LoRA, bypass
mode), same seed, `--steps` steps per case, each case in a fresh interpreter, all in one
invocation so the machine's load is shared:

    sync          the recipe as recorded: the engine paused for the whole update
    stale1-drop   agl_lab.rollout.max_staleness=1, carry-over on (async_train_batch_size = batch: one
                  batch generates while the previous one trains), a group older than one version dropped
    stale1-wait   the same, the groups exactly one version old waited for and trained
    stale1-wait-2x  stale1-wait with a buffer of two batches (async_train_batch_size 2 × batch): groups
                  wait two steps but may be one version old, so half of them age out (dropped)
    stale1-wait-d1  stale1-wait with the decode loop on 1 thread beside the update's 2
                  (`agl_lab.engine_options.decode_threads=1`; `auto` gives it the update's count)
    sync-bf16     sync with `agl_lab.model.compute_dtype=bfloat16`: the matrix products of the decode
                  loop and of the update in bfloat16 over float32 weights (agl_lab/engines/precision.py)
    stale1-wait-bf16  stale1-wait, bfloat16 products
    sync-bf16-gap sync-bf16 without bypass: the old logprobs recomputed, so the engine-vs-trainer gap
                  that bfloat16 opens is measured (lp_gap), at the price of that forward

Columns (per case; medians over steps 2..N, step 1 pays the warm-up):

    step_s      the step's wall seconds (`timing_s/step`)
    rollout_s   the rollout phase (`timing_s/gen`): under overlap, what is left of it after the update
    update_s    the update (`timing_s/update`: the weight publish is not in it)
    rest_s      step_s − rollout_s − update_s: build_batch and, under overlap, the publish (the
                server finishing its running generations on the old weights, the weight copy)
    busy        the engine's forward seconds over the step / the step's wall (the scheduler's
                `forward_s`): the share of the step the engine computes
    busy_gen    the same over the rollout phase only
    prefill_s   of the rollout phase's engine forwards, the prompts' prefills (the rest: decode steps)
    fwd_upd_s   engine forward seconds inside the update (0 when synchronous: the overlap's work)
    dropped     stale groups dropped over the run (`training/overlap/n_stale_groups_dropped`)
    lp_gap      median of `training/rollout_logprobs_diff_max` (sampling vs recomputed logprobs; NaN
                under bypass, where nothing is recomputed)
    reward      mean training reward over steps 1..N
    val         validation reward after the last step (`--no-val` skips it)

    python benchmarks/overlap.py [--config configs/cpu_smollm2_learn.yaml] [--steps 4] [--cases sync,stale1-drop]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import run_child, tagged  # noqa: E402

OVERLAP = ["agentlightning.async_rollout.enabled=true", "agl_lab.rollout.max_staleness=1"]
BF16 = "agl_lab.model.compute_dtype=bfloat16"
CASES = {
    "sync": [],
    "stale1-drop": [*OVERLAP, "agl_lab.rollout.stale_groups=drop"],
    "stale1-wait": [*OVERLAP, "agl_lab.rollout.stale_groups=wait"],
    # a carry-over buffer of two batches at staleness 1: a group waits two steps in it but may be
    # one version old, so every other step a batch ages out (what the first table measured)
    "stale1-wait-2x": [*OVERLAP, "agl_lab.rollout.stale_groups=wait"],
    # the decode loop on one thread beside the update's (auto: as many as the update): the cores split
    "stale1-wait-d1": [*OVERLAP, "agl_lab.rollout.stale_groups=wait", "agl_lab.engine_options.decode_threads=1"],
    "sync-bf16": [BF16],
    "stale1-wait-bf16": [*OVERLAP, "agl_lab.rollout.stale_groups=wait", BF16],
    "sync-bf16-gap": [BF16, "algorithm.rollout_correction.bypass_mode=false"],
}
BUFFER_BATCHES = {
    "stale1-drop": 1,
    "stale1-wait": 1,
    "stale1-wait-2x": 2,
    "stale1-wait-d1": 1,
    "stale1-wait-bf16": 1,
}  # async_train_batch_size / batch

CHILD = r"""
import json, sys, tempfile, time
from agl_lab.trainer import Trainer

config, steps, val, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on", sys.argv[4:]
overrides = [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "trainer.save_freq=-1", *overrides]
with tempfile.TemporaryDirectory() as run_dir, \
        Trainer.from_config(config, overrides=overrides, run_dir=run_dir, console=False) as trainer:
    stats = trainer.engine.server.scheduler.stats  # the engine's running totals (forward_s)
    for step in range(1, steps + 1):
        t0, f0, p0 = time.time(), stats["forward_s"], stats["prefill_s"]
        ro = trainer.rollout()
        f1, p1 = stats["forward_s"], stats["prefill_s"]
        b = trainer.build_batch(ro)
        f2 = stats["forward_s"]
        u = trainer.update(b)
        m = {**ro.metrics, **u.metrics}
        row = {"step_s": time.time() - t0, "rollout_s": m["timing_s/gen"], "update_s": m["timing_s/update"],
               "fwd_s": stats["forward_s"] - f0, "fwd_gen_s": f1 - f0, "prefill_s": p1 - p0, "fwd_upd_s": stats["forward_s"] - f2,
               "dropped": m.get("training/overlap/n_stale_groups_dropped", 0.0),
               "reward": b.metrics.get("training/reward", float("nan")),
               "lp_gap": m.get("training/rollout_logprobs_diff_max", float("nan"))}
        print("ROW " + json.dumps(row), flush=True)
    if val:
        print("VAL " + json.dumps(trainer.validate().get("val/reward", float("nan"))), flush=True)
"""


def run_case(config: str, steps: int, val: bool, overrides: list[str]) -> tuple[list[dict], float]:
    """Per-step rows and the validation reward (NaN without) of one case, in a fresh interpreter."""
    args = [config, str(steps), "on" if val else "off", *overrides]
    lines = run_child(CHILD, args, f"overlap benchmark case ({' '.join(overrides) or 'sync'})")
    vals = tagged(lines, "VAL")
    return tagged(lines), (vals[0] if vals else float("nan"))


def summary(rows: list[dict], val: float) -> dict[str, float]:
    """Medians over steps 2..N (all steps when there is one) of a case's rows."""
    tail = rows[1:] or rows
    keys = ("step_s", "rollout_s", "update_s", "fwd_upd_s", "prefill_s")
    med = {k: statistics.median(r.get(k, float("nan")) for r in tail) for k in keys}
    med["rest_s"] = statistics.median(r["step_s"] - r["rollout_s"] - r["update_s"] for r in tail)
    med["busy"] = statistics.median(r["fwd_s"] / r["step_s"] for r in tail)
    med["busy_gen"] = statistics.median(r["fwd_gen_s"] / r["rollout_s"] for r in tail if r["rollout_s"] > 0)
    med["dropped"] = sum(r["dropped"] for r in rows)  # the metric counts a step's drops
    med["reward"] = statistics.mean(r["reward"] for r in rows)
    med["lp_gap"] = statistics.median(r.get("lp_gap", float("nan")) for r in tail)
    med["val"] = val
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cpu_smollm2_learn.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--no-val", dest="val", action="store_false", help="skip the validation after the last step")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) for every case")
    args = p.parse_args(argv)
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in CASES]:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    print(f"# {args.config}, {args.steps} steps a case, overrides: {' '.join(args.overrides) or '-'}")
    cols = ("step_s", "rollout_s", "update_s", "rest_s", "busy", "busy_gen", "fwd_upd_s", "dropped", "reward", "val")
    cols += ("prefill_s", "lp_gap")
    print(f"{'case':<16} | " + " | ".join(f"{c:>9}" for c in cols), flush=True)
    from agl_lab.config import load_config

    batch = int(load_config(args.config, args.overrides).data.train_batch_size)
    for name in names:
        buffer = BUFFER_BATCHES.get(name)
        extra = [f"agentlightning.async_rollout.async_train_batch_size={buffer * batch}"] if buffer else []
        rows, val = run_case(args.config, args.steps, args.val, [*CASES[name], *extra, *args.overrides])
        for i, r in enumerate(rows, start=1):
            print(f"#   {name} step {i}: " + json.dumps({k: round(v, 3) for k, v in r.items()}))
        s = summary(rows, val)
        print(f"{name:<16} | " + " | ".join(f"{s[c]:>9.3f}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
