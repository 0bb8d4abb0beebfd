r"""The update's micro-batches: rows per micro-batch and the row order, on one SmolLM2 `calc` batch (#51).

`configs/cpu_smollm2_learn.yaml` (LoRA r16, shared prefix, bypass), seed 0: one rollout phase, one
batch, then `trainer.update(batch, allow_reuse=True)` under each case, the cases taking turns for
`--repeat` rounds (each update moves the adapter, so the rounds see slightly different weights —
alike for every case). A case is `ROWS:ORDER`:

    ROWS     actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (rows per forward and backward)
    ORDER    batch    the rows as the batch holds them (zero-advantage rows last): the update before
                      `local_ppo._forward_plan`
             chosen   what `_forward_plan` picks: by attended length when that sends fewer tokens
                      through the body (`actor/rows_by_length` 1), else the batch's order

Columns: the update's seconds (median and best of the rounds), `actor/body_tokens` (prefix once plus
every micro-batch's padded cells), whether the rows went by length, and the process's peak RSS
during the case's updates (VmHWM, reset before each: `/proc/self/clear_refs`).

    python benchmarks/micro_batches.py [--repeat 3] [--cases 2:batch,2:chosen,4:chosen,8:chosen] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_lab.engines import zero_skip  # noqa: E402
from agl_lab.trainer import Trainer  # noqa: E402
from benchmarks.host import describe  # noqa: E402

OVERRIDES = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"]
DEFAULT_CASES = "2:batch,2:chosen,4:chosen,8:chosen"
_plan_forwards = zero_skip.plan_forwards


def _batch_order(mb, micro_rows, skip, by_length=False):
    return _plan_forwards(mb, micro_rows, skip, by_length=False)


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def parse(cases: str) -> list[tuple[str, int, str]]:
    out = []
    for case in cases.split(","):
        rows, _, order = case.partition(":")
        if not rows.isdigit() or int(rows) <= 0 or order not in ("batch", "chosen"):
            raise SystemExit(f"--cases: {case!r} is not ROWS:ORDER (a positive integer, then batch or chosen)")
        out.append((case, int(rows), order))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/cpu_smollm2_learn.yaml")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated ROWS:ORDER (ORDER: batch | chosen)")
    p.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = p.parse_args(argv)
    cases = parse(args.cases)
    print(describe(), flush=True)  # before the cases and after them: a shared host's speed drifts
    seconds: dict[str, list[float]] = {c: [] for c, _, _ in cases}
    seen: dict[str, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Trainer.from_config(
            args.config, overrides=[*OVERRIDES, *args.overrides], run_dir=run_dir, console=False
        ) as trainer,
    ):
        batch = trainer.build_batch(trainer.rollout())
        actor = trainer.engine.actor_cfg
        trainer.update(batch, allow_reuse=True)  # warm: allocator, oneDNN, the merge of this version
        for round_ in range(args.repeat):
            for case, rows, order in cases:
                actor.ppo_micro_batch_size_per_gpu = rows
                zero_skip.plan_forwards = _batch_order if order == "batch" else _plan_forwards
                peak_rss_reset()
                t0 = time.perf_counter()
                metrics = trainer.update(batch, allow_reuse=True).metrics
                seconds[case].append(time.perf_counter() - t0)
                last = seen.setdefault(case, {"rss": 0.0})
                last.update(tokens=metrics["actor/body_tokens"], by_length=metrics["actor/rows_by_length"])
                last["rss"] = max(last["rss"], peak_rss_gb())
                print(f"#   round {round_ + 1} {case}: {seconds[case][-1]:.2f} s", flush=True)
        zero_skip.plan_forwards = _plan_forwards
    print(
        f"{'case':<9} | {'median s':>8} | {'best s':>6} | {'body tokens':>11} | {'by length':>9} | {'peak RSS GB':>11}"
    )
    for case, _, _ in cases:
        s, m = seconds[case], seen[case]
        print(
            f"{case:<9} | {statistics.median(s):>8.2f} | {min(s):>6.2f} | {m['tokens']:>11.0f} | "
            f"{m['by_length']:>9.0f} | {m['rss']:>11.2f}"
        )
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
