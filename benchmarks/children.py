"""Benchmark cases in fresh interpreters: each case's measurements come back as tagged stdout lines.

A case runs `python -c CODE ARGS...` in the checkout; its lines `ROW {json}` (or any other tag) are
the measurements, its stderr the reason when it fails. `overlap.py`, `memory.py` and
`phase_profile.py` run their cases this way, so one case's allocator, caches and threads never
colour the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a busy loop that ends with the process that started it (its pid: argv[1]), however that one ends (a
# kill runs no `finally`); given the pid, not reading it at start, since the parent may die first
BUSY_LOOP = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent: pass"


@contextlib.contextmanager
def busy_loops(k: int, settle: float = 1.0) -> Iterator[list[subprocess.Popen]]:
    """`k` busy-looping competitor processes (the rest of a shared machine) for the `with` block: started,
    given `settle` s to get going (when k > 0), killed at the end. Each also ends by itself when this
    process dies."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())]) for _ in range(k)]
    try:
        time.sleep(settle if k else 0.0)
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def run_child(code: str, args: list[str], what: str, checkout: Path = ROOT) -> list[str]:
    """The stdout lines of `python -c code *args`; SystemExit naming `what` with the stderr's tail when it fails.

    `checkout`: the agl_lab checkout the child runs in and imports (another one: code before a change)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return done.stdout.splitlines()


def tagged(lines: list[str], tag: str = "ROW") -> list:
    """The JSON values of the lines `f"{tag} {json}"`, in order."""
    return [json.loads(line[len(tag) + 1 :]) for line in lines if line.startswith(f"{tag} ")]
