r"""Benchmark `build_batch` against Agent Lightning's `RolloutAdapter`, side by side in one run.

Shape: 512 rollouts × 8 calls, an append-only agent: a 256-token first prompt, then each call
adds ~128 observation tokens and samples ~128 response tokens (64..192), so every call extends
the previous context (no merge break). Levels: trajectory (P=256, R=2560: one row per rollout,
~1.2 M ids) and transition (P=2560, R=192: one row per call, ~4.9 M prompt ids).

For each level it prints the warm build time (median of `--repeat`, verl already imported, one
warm-up call made) of agl_lab and of AGL 1.0.2's `RolloutAdapter.get_train_data_batch`, the
ratio, and whether the two DataProtos are bit-identical on every key AGL emits
(token_level_scores compared after AGL's bfloat16 cast). The last column, `AGL env`, says where
each AGL figure came from, and the lines under the table give that environment's versions:

- `own`, with `--agl-python PATH`: AGL in its own environment. `benchmarks/agl_peer.py` runs under
  PATH as a subprocess (`python -I`: no PYTHONPATH; it imports nothing from agl_lab), reads the same
  rollouts from a temporary .npz, times the adapter there and sends back its timings, versions
  and the DataProto's tensors (a temporary .pt) for the identity check. One subprocess per level,
  each right after agl_lab's timing of that level.
- `agl_lab`: AGL imported into this process, i.e. run on agl_lab's verl 0.9.1 / numpy 2 (when
  `agentlightning` is importable here: `pip install --no-deps --ignore-requires-python
  agentlightning==1.0.2 httpx-retries structlog`; `--no-agl` skips it). With `--agl-python`
  as well, both rows are printed, from the same run.
- `issue`: neither: issue #17's figures (quiet machine, 2026-11-30), labelled, not measured.

AGL's own environment, as used for docs/benchmarks.md (~1 min to install from the local mirror).
AGL 1.0.2 declares Python >= 3.12 and no verl/numpy pin; its code targets verl 0.8.0 ("Mirrors
verl 0.8.0's ...", "verl 0.8.0 moved ...") and verl 0.8.0 requires numpy < 2. The only CPU torch
wheel here is cp311 (any other torch pulls a multi-GB CUDA build), hence Python 3.11 and
`--ignore-requires-python`; `pip check` is clean afterwards:

    python3.11 -m venv /tmp/agl-venv
    printf 'torch==2.13.0\nnumpy==1.26.4\n' > /tmp/agl-constraints.txt
    /tmp/agl-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/agl-venv/bin/pip install -c /tmp/agl-constraints.txt --ignore-requires-python \
        agentlightning==1.0.2 verl==0.8.0 numpy==1.26.4
    python benchmarks/batch.py --agl-python /tmp/agl-venv/bin/python

Where the time went (profile of the previous implementation, trajectory level, 2-core machine):
~55 % converting ragged Python lists to arrays with `np.fromiter(chain(...))` (~40 ns/id, four
passes: prompts, responses, response mask, logprobs), ~35 % the trajectory merge (copying every
prompt with `list()`, slicing twice per prefix test, growing response/mask/logprob lists call by
call), the rest padding and the DataProto. Now: a merged row is the last call's prompt + response
(each call extends the previous context, so nothing is rebuilt call by call), the prefix test
compares slices without copying the prompt first, masks and logprobs are scattered from the
(row, start, length) spans of the model tokens with numpy, and ids convert once with
`np.array(list)` (~20 ns/id). At the transition level the prompts of one rollout share their
prefixes: each prompt that extends the previous call's context converts only its new tail.
What remains is about the floor: one conversion per distinct id and one prefix comparison per call.

    python benchmarks/batch.py [--repeat 5] [--agl-python PATH] [--no-agl]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PEER = Path(__file__).resolve().parent / "agl_peer.py"
sys.path.insert(0, str(PEER.parent))
sys.path.insert(0, str(PEER.parents[1]))

from agl_peer import agl_builder, environment, save_rollouts, timed, to_agl  # noqa: E402

from agl_lab.batch import build_batch  # noqa: E402
from agl_lab.records import CompletedRollout, Triplet  # noqa: E402

N_ROLLOUTS, N_CALLS, FIRST_PROMPT = 512, 8, 256
SHAPES = {"trajectory": (256, 2560), "transition": (2560, 192)}  # level -> (P, R)
# Issue #17 (quiet 2-core machine, 2026-11-30, warm medians): used only without agentlightning.
ISSUE_AGL_MS = {"trajectory": 433.0}


def make_rollouts(seed: int = 0) -> list[CompletedRollout]:
    rng = np.random.default_rng(seed)
    rollouts = []
    for k in range(N_ROLLOUTS):
        context = rng.integers(1, 50_000, FIRST_PROMPT).tolist()
        triplets = []
        for call in range(N_CALLS):
            if call:
                context = context + rng.integers(1, 50_000, int(rng.integers(64, 193))).tolist()  # observation
            response = rng.integers(1, 50_000, int(rng.integers(64, 193))).tolist()
            logprobs = (-rng.random(len(response))).tolist()
            triplets.append(Triplet(list(context), response, logprobs))
            context = context + response
        # copy_idx keeps our sort (step, sample_idx, copy_idx) equal to AGL's stable (step, sample_idx)
        rollouts.append(CompletedRollout(f"r{k}", f"d{k // 8}", 0, k // 8, triplets, float(k % 2), copy_idx=k % 8))
    return rollouts


def records(rollouts: list[CompletedRollout]) -> list:
    """The rollouts as agl_peer's plain records (what AGL is built from, in process or in the peer)."""
    return [
        (
            r.rollout_id,
            r.data_id,
            r.step,
            r.sample_idx,
            r.final_reward,
            [(t.prompt_ids, t.response_ids, t.logprobs) for t in r.triplets],
        )
        for r in rollouts
    ]


def agl_importable() -> bool:
    return importlib.util.find_spec("agentlightning") is not None


def env_label(env: dict[str, str], where: str) -> str:
    return (
        f"(verl {env['verl']}): agentlightning {env['agentlightning']}, python {env['python']}, "
        f"numpy {env['numpy']}, torch {env['torch']}, tensordict {env['tensordict']}; {where}"
    )


@dataclass
class AglRun:
    """AGL's figures for one level from one environment (`tag` names it in the table)."""

    tag: str
    wall_ms: float
    cpu_ms: float
    same: str
    cell: str  # the wall cell as printed


class InProcess:
    """AGL imported into this process: agl_lab's environment."""

    tag = "agl_lab"

    def __init__(self, recs: list) -> None:
        self.recs = recs
        self.label = "AGL in agl_lab's env " + env_label(environment(), "in this process")

    def run(self, level: str, p: int, r: int, repeat: int, ours) -> AglRun:
        build = agl_builder(level, p, r)
        build(to_agl(self.recs[:2]))  # warm, as the peer does
        wall, cpu, agl = timed(build, repeat, setup=lambda: to_agl(self.recs))
        return AglRun(
            self.tag, wall * 1000, cpu * 1000, compare(ours.data, agl.batch, agl.non_tensor_batch), f"{wall * 1000:.0f}"
        )


class Peer:
    """AGL in its own environment: `agl_peer.py` run by another Python, rollouts passed in a file."""

    tag = "own"

    def __init__(self, python: str, recs: list, workdir: str) -> None:
        self.python, self.workdir = python, workdir
        self.rollouts = os.path.join(workdir, "rollouts.npz")
        save_rollouts(self.rollouts, recs)
        self.label = ""  # its versions, once it has run

    def run(self, level: str, p: int, r: int, repeat: int, ours) -> AglRun:
        out = os.path.join(self.workdir, f"{level}.pt")
        # -I: its own environment only (no PYTHONPATH, no user site, not even benchmarks/ on its path)
        done = subprocess.run(
            [
                self.python,
                "-I",
                str(PEER),
                "--rollouts",
                self.rollouts,
                "--level",
                level,
                "--max-prompt-length",
                str(p),
                "--max-response-length",
                str(r),
                "--repeat",
                str(repeat),
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"agl_peer.py under {self.python} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        res = torch.load(out, weights_only=True)
        os.unlink(out)
        self.label = "AGL in its own env " + env_label(res["env"], f"subprocess {self.python}")
        wall, cpu = res["wall_s"] * 1000, res["cpu_s"] * 1000
        return AglRun(self.tag, wall, cpu, compare(ours.data, res["batch"], res["non_tensor"]), f"{wall:.0f}")


def compare(ours, agl_batch, agl_non_tensor) -> str:
    """'yes' if every tensor/non-tensor AGL emits is bit-identical to ours, else the differing keys."""
    bad = []
    for key in agl_batch.keys():
        a, o = agl_batch[key], ours.batch[key]
        if key == "token_level_scores":
            o = o.to(a.dtype)
        if a.shape != o.shape or a.dtype != o.dtype or not torch.equal(a, o):
            bad.append(key)
    for key, a in agl_non_tensor.items():
        if list(a) != list(ours.non_tensor_batch[key]):
            bad.append(key)
    return "yes" if not bad else "NO: " + ",".join(bad)


def shown(ms: float) -> str:
    return "n/a" if math.isnan(ms) else f"{ms:.0f}"


def speed_up(agl_ms: float, ours_ms: float) -> str:
    return "n/a" if math.isnan(agl_ms) else f"{agl_ms / ours_ms:.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--agl-python",
        metavar="PATH",
        help="also time AGL in its own environment: run benchmarks/agl_peer.py with this Python",
    )
    p.add_argument("--no-agl", action="store_true", help="skip AGL in this process even when importable")
    args = p.parse_args()
    rollouts = make_rollouts()
    build_batch(rollouts[:2], "trajectory", max_prompt_length=256, max_response_length=2560)  # import verl
    with tempfile.TemporaryDirectory(prefix="agl-batch-") as workdir:
        sources: list = []
        if args.agl_python:
            if not os.access(args.agl_python, os.X_OK):
                raise SystemExit(f"--agl-python {args.agl_python}: not an executable")
            sources.append(Peer(args.agl_python, records(rollouts), workdir))
        if agl_importable() and not args.no_agl:
            sources.append(InProcess(records(rollouts)))
        table(rollouts, sources, args.repeat)


def table(rollouts: list[CompletedRollout], sources: list, repeat: int) -> None:
    print(
        f"{N_ROLLOUTS} rollouts x {N_CALLS} calls, first prompt {FIRST_PROMPT} tokens, ~256 new tokens per call; "
        f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} (1-min avg, start); median of {repeat}"
    )
    print(f"{'':<17} {'wall ms (median)':^36} {'CPU ms (median)':^31}")
    print(
        f"{'level':<11} {'rows':>5} {'agl_lab':>9} {'AGL':>15} {'speed-up':>9} {'agl_lab':>9} {'AGL':>10} "
        f"{'speed-up':>9} {'identical':>9} {'forward tokens':>15} {'padded tokens':>14}  AGL env"
    )
    forward = {}
    for level, (pl, rl) in SHAPES.items():
        ours_s, ours_cpu, ours = timed(
            lambda _, level=level, pl=pl, rl=rl: build_batch(
                rollouts, level, max_prompt_length=pl, max_response_length=rl
            ),
            repeat,
        )
        if sources:
            runs = [source.run(level, pl, rl, repeat, ours) for source in sources]
        elif level in ISSUE_AGL_MS:
            runs = [AglRun("issue", ISSUE_AGL_MS[level], float("nan"), "n/a", f"{ISSUE_AGL_MS[level]:.0f} (issue)")]
        else:
            runs = [AglRun("issue", float("nan"), float("nan"), "n/a", "n/a")]
        mask = ours.data.batch["attention_mask"]
        forward[level] = int(mask.sum())
        for run in runs:
            print(
                f"{level:<11} {len(ours.data):>5} {ours_s * 1000:>9.0f} {run.cell:>15} "
                f"{speed_up(run.wall_ms, ours_s * 1000):>9} {ours_cpu * 1000:>9.0f} {shown(run.cpu_ms):>10} "
                f"{speed_up(run.cpu_ms, ours_cpu * 1000):>9} {run.same:>9} {forward[level]:>15,} {mask.numel():>14,}"
                f"  {run.tag}"
            )
        del ours
    print(
        f"load={os.getloadavg()[0]:.1f} (end); transition / trajectory forward tokens: "
        f"{forward['transition'] / forward['trajectory']:.2f}x"
    )
    for source in sources:
        print(f"AGL env {source.tag}: {source.label}")
    if not sources:
        why = "--no-agl" if agl_importable() else "agentlightning not importable"
        print(f"AGL env issue: issue #17's figures ({why}), not measured in this run.")


if __name__ == "__main__":
    main()
