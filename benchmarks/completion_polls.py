"""Store calls per step for the trainer's and the runner's completion checks (#51 item 2).

`Trainer.fit(4)` on `configs/cpu_tiny.yaml` (lookup, 4 tasks × n=2, `tests/trainer_runs.SMALL`),
counting the embedded server's store calls by operation (`ServerMetrics.store_count`) per step.
`before` restores the clock-driven checks — the terminal cursor polled without a wait every
`poll_interval_seconds`, the idle runner's claim every 0.5 s — `after` is the code as it is.

    python benchmarks/completion_polls.py before|after [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests.trainer_runs`, run as a script
OPS = ["terminal_page", "list_rollouts", "claim_rollouts", "heartbeat"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["before", "after"])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    import agl_lab.rollout
    import agl_lab.runner
    from agl_lab.trainer import Trainer
    from tests.trainer_runs import SMALL

    if args.mode == "before":
        agl_lab.rollout.TERMINAL_WAIT_SECONDS = 0.0
        agl_lab.runner.IDLE_CLAIM_WAIT_SECONDS = agl_lab.runner.CLAIM_WAIT_SECONDS
    with Trainer.from_config(str(ROOT / "configs/cpu_tiny.yaml"), overrides=SMALL) as trainer:
        counts = trainer.server.app.state.metrics.store_count
        start = dict(counts)
        t0 = time.time()
        trainer.fit(args.steps)
        wall = time.time() - t0
        per_step = {op: round((counts[op] - start.get(op, 0)) / args.steps, 1) for op in OPS}
    print(
        f"{args.mode}: {args.steps} steps in {wall:.1f} s, load {os.getloadavg()[0]:.1f}; store calls per step: "
        f"{per_step}, total {round(sum(per_step.values()), 1)}"
    )


if __name__ == "__main__":
    main()
