"""The numbers of docs/research.md's n=4 vs n=8 study, from a sweep's run directories.

    agl-lab sweep configs/cpu_tiny.yaml actor_rollout_ref.rollout.n=4,8 data.train_batch_size=8,4 \\
        actor_rollout_ref.actor.ppo_mini_batch_size=8,4 --zip --seeds 0,1,2 --out runs/n4_vs_n8 \\
        trainer.total_training_steps=50 trainer.test_freq=10
    python scripts/zero_signal_study.py runs/n4_vs_n8

Prints (markdown) the `compare` table over the last 10 steps with the paired n8 − n4 difference,
and per setting the rollouts with no learning signal: from the metric
`training/n_zero_signal_rollouts_collected` (summed over steps and seeds) and, independently,
from the recordings (rollouts of a task whose n rewards are all equal: `agl_lab.views.groups_df`),
step by step; it exits 1 when the two disagree on any step. It also counts the zero-advantage
groups that verl's float32 GRPO estimator would have given a non-zero advantage (issue 36's bug).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

import agl_lab
from agl_lab.replay import load_recording, recorded_steps
from agl_lab.views import groups_df

METRIC = "training/n_zero_signal_rollouts_collected"


def markdown(frame: pd.DataFrame) -> str:
    """A markdown table (3 decimals for floats)."""
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    head = "| " + " | ".join(map(str, frame.columns)) + " |"
    return "\n".join([head, "|" + "---|" * len(frame.columns), *("| " + " | ".join(r) + " |" for r in cells)])


def from_recordings(run_dir: Path) -> dict[int, int]:
    """Per step: rollouts in groups whose rewards are all equal, read from the step's recording."""
    fill = 0.0
    out = {}
    for step in recorded_steps(run_dir):
        rec = load_recording(run_dir, step)
        groups = groups_df(rec.rollouts, reward_fillna_value=fill)
        out[rec.step] = int(groups.loc[groups.zero_adv, "n_rollouts"].sum())
    return out


def verl_float32_off_zero(run_dir: Path) -> tuple[int, int, int]:
    """(zero-advantage groups, those verl's float32 GRPO gives a non-zero advantage, their rollouts)."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    groups = off = rollouts = 0
    for step in recorded_steps(run_dir):
        table = groups_df(load_recording(run_dir, step).rollouts)
        for rewards in table.loc[table.zero_adv, "rewards"]:
            groups += 1
            scores = torch.tensor(rewards, dtype=torch.float32)[:, None]
            if len(rewards) > 1:
                adv, _ = compute_grpo_outcome_advantage(scores, torch.ones_like(scores), np.array(["g"] * len(rewards)))
                if bool((adv != 0).any()):
                    off, rollouts = off + 1, rollouts + len(rewards)
    return groups, off, rollouts


def from_metrics(run_dir: Path) -> dict[int, int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(d["step"]): int(d[METRIC]) for d in lines if METRIC in d}


def main(out: str) -> int:
    manifest = json.loads((Path(out) / "sweep.json").read_text())
    names = {name: ("n4" if "n=4" in name else "n8" if "n=8" in name else name) for name in manifest["settings"]}
    settings: dict[str, list[Path]] = {}
    for run in manifest["runs"]:
        settings.setdefault(names[run["setting"]], []).append(Path(run["run_dir"]))
    table = agl_lab.compare(
        settings, last=10, metrics=("training/reward", "val/reward", "training/zero_signal_rollout_frac_collected")
    )
    cols = ["setting", "n_seeds"] + [
        c for c in table.columns if c.startswith(("training/reward", "val/reward", "training/zero_signal"))
    ]
    print(markdown(table[cols]))
    print(f"\nwindow: {table.attrs['window']}; baseline {table.attrs['baseline']}\n")
    rows, mismatches = [], 0
    for name, dirs in settings.items():
        metric_total = rec_total = rollouts = zero_groups = off_groups = off_rollouts = 0
        for d in dirs:
            g, o, r_off = verl_float32_off_zero(d)
            zero_groups, off_groups, off_rollouts = zero_groups + g, off_groups + o, off_rollouts + r_off
            m, r = from_metrics(d), from_recordings(d)
            steps = sorted(set(m) | set(r))
            bad = [s for s in steps if m.get(s) != r.get(s)]
            mismatches += len(bad)
            for s in bad[:3]:
                print(f"MISMATCH {name} {d.name} step {s}: metric {m.get(s)} recordings {r.get(s)}")
            metric_total += sum(m.values())
            rec_total += sum(r.values())
            rollouts += sum(len(load_recording(d, s).rollouts) for s in recorded_steps(d))
        rows.append(
            {
                "setting": name,
                "runs": len(dirs),
                "rollouts": rollouts,
                "zero-signal (metric)": metric_total,
                "zero-signal (recordings)": rec_total,
                "share": metric_total / rollouts if rollouts else float("nan"),
                "zero-adv groups": zero_groups,
                "of them non-zero under verl float32": off_groups,
                "their rollouts": off_rollouts,
            }
        )
    print(markdown(pd.DataFrame(rows)))
    print(f"\nsteps where metric and recordings disagree: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/n4_vs_n8"))
