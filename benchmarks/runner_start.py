r"""How fast `agl-lab runner` starts, and what it loads: each case in a fresh interpreter.

A runner host reads flags, imports the agent and talks HTTP; it never serves. Since #37 it loads
no server stack (the app, FastAPI, uvicorn, Starlette) and no numpy (`tests/test_runner_cli.py`
asserts it); this script times what that buys, beside what the two would cost:

    python -c pass      the interpreter alone (the floor)
    runner --help       `agl-lab runner --help`: flags only
    runner to polling   `agl-lab runner --server URL --agent tests.agents_for_tests:remote_agent`, from
                        the process's start to its "claiming from" line (the key checked on the
                        server, the agent imported, the poll thread running)
    runner to 1 done    the same, until a rollout queued before the start is succeeded
    server stack+numpy  `import agl_lab.server.embedded, numpy`: what a runner imported before #37

Every case runs `--repeats` times; the columns are the median and the fastest wall seconds, the
number of modules the process had loaded at its end and how many of them are the server stack or
numpy. `--load K` adds K busy-looping competitor processes (`benchmarks.children.busy_loops`) standing
in for the rest of a shared machine (the issue measured ~2.7 s of imports under load). The server
the runners claim from is an in-process `EmbeddedServer` on loopback.

    python benchmarks/runner_start.py [--repeats 5] [--load 0 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.children`, run as a script

from benchmarks.children import busy_loops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "runner-start-bench-key"
AGENT = "tests.agents_for_tests:remote_agent"
HEAVY = ("agl_lab.server", "fastapi", "uvicorn", "starlette", "numpy")
# Runs `agl-lab runner ARGS` (or, with --import, imports modules) and prints the loaded modules last.
CHILD = r"""
import json, sys
if sys.argv[1] == "--import":
    for name in sys.argv[2:]:
        __import__(name)
elif sys.argv[1] != "--pass":
    from agl_lab import cli
    try:
        cli.main(["runner", *sys.argv[1:]])
    except SystemExit:
        pass
print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
"""
CASES = ("python -c pass", "runner --help", "runner to polling", "runner to 1 done", "server stack+numpy")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_") and k != "AGL_SERVER_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _modules(out: str) -> tuple[int, int]:
    """(modules loaded, of which server stack or numpy) from the child's last line."""
    line = next(line for line in reversed(out.splitlines()) if line.startswith("MODULES "))
    loaded = json.loads(line[len("MODULES ") :])
    return len(loaded), sum(1 for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))


def _once(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{args} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, done.stdout


def _runner_once(server, client, until_done: bool) -> tuple[float, str]:
    """Start a runner process; seconds until it polls (or until a queued rollout is done), then SIGTERM."""
    from agl_lab.protocol import RolloutCreate

    rid = f"start-{uuid.uuid4().hex[:8]}"
    if until_done:
        client.create_rollouts([RolloutCreate(rollout_id=rid, input={})])
    argv = [
        sys.executable,
        "-c",
        CHILD,
        "--server",
        server.url,
        "--key",
        KEY,
        "--agent",
        AGENT,
        "--poll-interval",
        "0.02",
        "--summary-every",
        "0",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = ""
        while "claiming from" not in first:  # (a log line may come first)
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the runner did not start: {first}{proc.stdout.read()[-2000:]}")
            first += line
        wall = time.perf_counter() - t0
        if until_done:
            while not client.get_rollout(rid)[0].is_terminal:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("the runner did not finish its rollout within 120 s")
                time.sleep(0.005)
            wall = time.perf_counter() - t0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return wall, first + out


def measure(case: str, repeats: int, server, client) -> tuple[list[float], str]:
    walls, out = [], ""
    for _ in range(repeats):
        if case == "python -c pass":
            wall, out = _once(["--pass"])
        elif case == "runner --help":
            wall, out = _once(["--help"])
        elif case == "server stack+numpy":
            wall, out = _once(["--import", "agl_lab.server.embedded", "numpy"])
        else:
            wall, out = _runner_once(server, client, until_done=case == "runner to 1 done")
        walls.append(wall)
    return walls, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2], help="busy competitor processes")
    args = ap.parse_args()

    from agl_lab.client import AglClient
    from agl_lab.server.embedded import EmbeddedServer

    server = EmbeddedServer(key=KEY, default_proxy={"model_name": "m"})
    header = (
        f"{'case':<18} | {'load':>4} | {'repeats':>7} | {'median s':>8} | {'min s':>6} | {'modules':>7} | "
        f"{'server stack or numpy':>21}"
    )
    print(header)
    print("-" * len(header))
    try:
        with AglClient(server.url, key=KEY) as client:
            for load in args.load:
                with busy_loops(load):
                    for case in CASES:
                        walls, out = measure(case, args.repeats, server, client)
                        n_modules, n_heavy = _modules(out)
                        print(
                            f"{case:<18} | {load:>4} | {args.repeats:>7} | {statistics.median(walls):>8.3f} | "
                            f"{min(walls):>6.3f} | {n_modules:>7} | {n_heavy:>21}",
                            flush=True,
                        )
    finally:
        server.stop()
    print(
        f"\n{os.cpu_count()} CPUs; python {sys.version.split()[0]}; each case a fresh interpreter "
        f"(modules: loaded at the process's end; the last column counts {', '.join(HEAVY)})"
    )


if __name__ == "__main__":
    main()
