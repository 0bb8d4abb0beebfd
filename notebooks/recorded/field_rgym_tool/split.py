"""The validation rollouts of a recorded run split by what the calculator did (docs/environments.md,
"A field dataset with a tool"): `python notebooks/recorded/field_rgym_tool/split.py <run or recorded dir>`.

Per validation step: the share of rollouts that called the calculator, whose answer equals the
calculator's last result, that were right (reward 1.0, the verifier's), right after calling the tool,
and the verifier's mean reward — read from each rollout's `task_result` event (agl_lab/tasks/rgym.py).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def split(path: Path) -> dict[str, float]:
    rollouts = json.loads(gzip.decompress(path.read_bytes()))["rollouts"]
    results = [e["data"] for r in rollouts for e in r["events"] if e["event_type"] == "task_result"]
    n = len(results)
    return {
        "rollouts": n,
        "called": sum(bool(d["tool_called"]) for d in results) / n,
        "answer==tool": sum(bool(d["answer_is_tool_result"]) for d in results) / n,
        "right": sum(d["reward"] >= 1.0 for d in results) / n,
        "right & called": sum(d["reward"] >= 1.0 and bool(d["tool_called"]) for d in results) / n,
        "mean reward": sum(d["reward"] for d in results) / n,
    }


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for path in sorted(root.glob("**/validation_*.json.gz")):
        row = split(path)
        step = int(path.name.split("_")[1].split(".")[0])
        print(
            f"step {step:3d} "
            + " · ".join(f"{k} {v:.3f}" if k != "rollouts" else f"{v} rollouts" for k, v in row.items())
        )
