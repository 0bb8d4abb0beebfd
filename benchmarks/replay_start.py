r"""How long `agl-lab replay` takes to its first output line, without verl and Ray and with them.

`agl-lab replay RUN_DIR --step N` rebuilds a recorded step (batch, advantages, selection, loss
weights) and prints the recorded-vs-replayed table. Before issue #36 its batch was verl's
`DataProto` and its advantage verl's `compute_advantage`, so every call imported verl, whose
package imports Ray, and verl's `ray_trainer` (the issue measured ~60 s a call on a loaded
laptop). Now the batch is agl_lab's `BatchData` and GRPO/RLOO and the data metrics are computed in
`agl_lab.algorithms.estimators`, so neither is imported. The cases, each a fresh interpreter:

    python -c pass          the interpreter alone (the floor)
    replay                  `agl-lab replay CASSETTE --step 2` as it is now
    replay + verl imports   the same, after importing what the replay imported before #36
                            (`verl`, `verl.trainer.ppo.ray_trainer`, `verl.trainer.ppo.metric_utils`):
                            the old path's import cost, measured on this checkout
    replay @ CHECKOUT       with `--before PATH`: `agl-lab replay` from another checkout (e.g. one
                            from before #36: `--before /path/to/old/agl_lab-checkout`)

Columns: the median and fastest seconds from the process's start to its first output line (the
table's header) and to its exit, and whether Ray was loaded at the end. `--load K` adds K
busy-looping competitor processes standing in for the rest of a shared machine. The recording
replayed is the test cassette (`tests/fixtures/cassette`, 2 steps of the demo).

    python benchmarks/replay_start.py [--repeats 3] [--load 0 2] [--before PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import busy_loops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASSETTE = ROOT / "tests" / "fixtures" / "cassette"
OLD_IMPORTS = ("verl", "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.metric_utils")
# Imports PRELOAD (comma-separated, may be empty), then runs `agl-lab replay ARGS`; "RAY yes|no" last.
CHILD = r"""
import sys
for name in filter(None, sys.argv[1].split(",")):
    __import__(name)
rc = 0
if sys.argv[2] != "--pass":
    from agl_lab import cli
    rc = cli.main(["replay", *sys.argv[2:]])
print("RAY " + ("yes" if "ray" in sys.modules else "no"), flush=True)
sys.exit(rc)
"""


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    return env


def _once(root: Path, preload: str, args: list[str]) -> tuple[float, float, str]:
    """(seconds to the first output line, seconds to exit, "yes"/"no": Ray loaded)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, preload, *args],
        cwd=root,
        env=_env(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    first_line = proc.stdout.readline()
    first = time.perf_counter() - t0
    rest = proc.stdout.read()
    rc = proc.wait(timeout=600)
    done = time.perf_counter() - t0
    if rc != 0 or not first_line:
        raise RuntimeError(f"{args} in {root} exited {rc}: {(first_line + rest)[-2000:]}")
    ray = next(line for line in reversed(rest.splitlines() or [first_line]) if line.startswith("RAY "))
    return first, done, ray.split()[1]


def cases(before: Path | None) -> list[tuple[str, Path, str, list[str]]]:
    """(name, checkout, modules to import first, replay arguments) per case."""
    replay = [str(CASSETTE), "--step", "2"]
    out = [
        ("python -c pass", ROOT, "", ["--pass"]),
        ("replay", ROOT, "", replay),
        ("replay + verl imports", ROOT, ",".join(OLD_IMPORTS), replay),
    ]
    if before is not None:
        out.append((f"replay @ {before.name}", before, "", replay))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy competitor processes")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to time beside this one")
    args = ap.parse_args()
    if args.before is not None and not (args.before / "agl_lab" / "replay.py").exists():
        ap.error(f"--before {args.before}: not an agl_lab checkout (no agl_lab/replay.py)")

    header = (
        f"{'case':<24} | {'load':>4} | {'repeats':>7} | {'first line s':>12} | {'min':>6} | "
        f"{'exit s':>7} | {'min':>6} | {'ray':>3}"
    )
    print(header)
    print("-" * len(header))
    for load in args.load:
        with busy_loops(load):
            for name, root, preload, replay_args in cases(args.before):
                runs = [_once(root, preload, replay_args) for _ in range(args.repeats)]
                firsts, exits = [r[0] for r in runs], [r[1] for r in runs]
                print(
                    f"{name:<24} | {load:>4} | {args.repeats:>7} | {statistics.median(firsts):>12.2f} | "
                    f"{min(firsts):>6.2f} | {statistics.median(exits):>7.2f} | {min(exits):>6.2f} | {runs[-1][2]:>3}",
                    flush=True,
                )
    print(
        f"\n{os.cpu_count()} CPUs; python {sys.version.split()[0]}; each case a fresh interpreter; "
        f"replayed: {CASSETTE.relative_to(ROOT)} step 2 (ray: loaded at the process's end)"
    )


if __name__ == "__main__":
    main()
