r"""Where a synchronous SmolLM2 `calc` step's seconds go, and the prefill through HF vs the decode loop's forward (#51).

The recipe of docs/real-model.md (`configs/cpu_smollm2_learn.yaml`: LoRA, bypass mode), seed 0
(the gateway seeds every call, so each case samples the same rollouts up to float rounding),
`--steps` steps a case, each case in a fresh interpreter; the cases take turns for `--repeat`
rounds so a drifting load hits them alike:

    hf-prefill    a prompt's prefill through the HF module (PEFT's unmerged adapter, K/V repeated per
                  query head) — the engine before the prefill ran `fast_decode.forward`
    fast-prefill  the default: the prefill through the decode loop's forward (packed, merged weights)
    fast-prefill-bf16  fast-prefill with `agl_lab.model.compute_dtype=bfloat16`: the decode loop's
                  products from packed bfloat16 copies, the update's from bfloat16 weight copies
    before        with `--before PATH`: another checkout of agl_lab (the code before a change) as it is

Columns (medians over steps 2..N of every round; step 1 pays the warm-up):

    step_s       the step's wall seconds
    rollout_s    the rollout phase (`timing_s/gen`)
    prefill_s    of the phase, the engine's prefill forwards (the scheduler's `prefill_s`)
    prefills     prefill forwards in the phase (arrivals admitted together share one)
    decode_ms    the phase's decode forward seconds / decode steps, in ms
    steps        decode steps in the phase (the critical path sets most of them)
    engine_cpu   the scheduler thread's CPU seconds / the phase's wall: how much of the phase the
                 engine thread computes (the rest: waiting for requests)
    forward      the engine's forward seconds (prefills and decode steps) / the phase's wall: the
                 share of the phase the engine spends in the model (the issue's "≥ 70 % in forward")
    update_s     the update (`timing_s/update`)

    python benchmarks/phase_profile.py [--steps 4] [--repeat 2] [--cases hf-prefill,fast-prefill] [--before PATH]
                                       [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import ROOT, run_child, tagged  # noqa: E402
from benchmarks.host import describe  # noqa: E402

BF16 = "agl_lab.model.compute_dtype=bfloat16"
# name → (scheduler.fast_prefill, the case's own overrides)
CASES = {"hf-prefill": (False, []), "fast-prefill": (True, []), "fast-prefill-bf16": (True, [BF16])}
DEFAULT_CASES = "hf-prefill,fast-prefill"

CHILD = r"""
import json, os, sys, tempfile, threading, time
from agl_lab.trainer import Trainer

config, steps, fast_prefill, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
overrides = [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
             "trainer.test_freq=-1", "trainer.save_freq=-1", *overrides]


def thread_cpu(native_id):
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


with tempfile.TemporaryDirectory() as run_dir, \
        Trainer.from_config(config, overrides=overrides, run_dir=run_dir, console=False) as trainer:
    scheduler = trainer.engine.server.scheduler
    scheduler.fast_prefill = fast_prefill
    engine_thread = next(t for t in threading.enumerate() if t.name == "agl-lab-scheduler").native_id
    stats = scheduler.stats
    for step in range(1, steps + 1):
        s0, c0, t0 = dict(stats), thread_cpu(engine_thread), time.time()
        ro = trainer.rollout()
        s1, c1, t1 = dict(stats), thread_cpu(engine_thread), time.time()
        u = trainer.update(trainer.build_batch(ro))
        d = {k: s1[k] - s0[k] for k in ("steps", "prefills", "forward_s", "prefill_s")}
        print("ROW " + json.dumps({
            "step_s": time.time() - t0, "rollout_s": ro.metrics["timing_s/gen"], "update_s": u.metrics["timing_s/update"],
            "prefill_s": d["prefill_s"], "prefills": d["prefills"], "steps": d["steps"],
            "decode_ms": 1000 * (d["forward_s"] - d["prefill_s"]) / max(d["steps"], 1),
            "engine_cpu": (c1 - c0) / (t1 - t0), "forward": d["forward_s"] / (t1 - t0),
        }), flush=True)
"""

COLS = ("step_s", "rollout_s", "prefill_s", "prefills", "decode_ms", "steps", "engine_cpu", "forward", "update_s")


def run_case(config: str, steps: int, fast_prefill: bool, overrides: list[str], checkout: Path = ROOT) -> list[dict]:
    """Per-step rows of one case, in a fresh interpreter running `checkout`."""
    args = [config, str(steps), "1" if fast_prefill else "0", *overrides]
    what = f"phase_profile case fast_prefill={fast_prefill} in {checkout}"
    return tagged(run_child(CHILD, args, what, checkout))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cpu_smollm2_learn.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2, help="rounds; the cases take turns in each")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--before", type=Path, help="another agl_lab checkout, run as it is as the case 'before'")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) for every case")
    args = p.parse_args(argv)
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in CASES]:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.before is not None:
        if not (args.before / "agl_lab" / "__init__.py").is_file():
            raise SystemExit(f"--before {args.before}: not an agl_lab checkout (no agl_lab/__init__.py)")
        names = ["before", *names]
    print(
        f"# {args.config}, {args.steps} steps a case × {args.repeat} rounds, overrides: {' '.join(args.overrides) or '-'}"
    )
    print(describe(), flush=True)  # before the cases and after them: a shared host's speed drifts
    tails: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(1, args.repeat + 1):
        for name in names:
            if name == "before":  # its own code decides the prefill (a scheduler without the switch ignores it)
                rows = run_case(args.config, args.steps, True, args.overrides, args.before.resolve())
            else:
                fast_prefill, own = CASES[name]
                rows = run_case(args.config, args.steps, fast_prefill, [*own, *args.overrides])
            for i, r in enumerate(rows, start=1):
                print(
                    f"#   round {round_} {name} step {i}: " + json.dumps({k: round(v, 3) for k, v in r.items()}),
                    flush=True,
                )
            tails[name] += rows[1:] or rows
    print(f"{'case':<17} | " + " | ".join(f"{c:>10}" for c in COLS))
    for name in names:
        med = {c: statistics.median(r[c] for r in tails[name]) for c in COLS}
        print(f"{name:<17} | " + " | ".join(f"{med[c]:>10.3f}" for c in COLS), flush=True)
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
