"""The subprocesses a test starts (servers, runners, trainers), each in its own process group.

    proc = spawn_cli(["serve", "--port", str(free_port())], tmp_path / "serve.log")   # agl-lab serve
    wait_for(lambda: healthy(url), 60, "the server", procs=[proc], logs=[log])
    stop_groups(procs)     # SIGTERM to every group first, then wait, then SIGKILL a group that outlived it

`cli_env()` is the environment such a process gets: this checkout on PYTHONPATH, a fixed hash seed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def stop_groups(procs: Iterable[subprocess.Popen], grace: float = 30) -> None:
    """SIGTERM every live process group of `procs`, then wait up to `grace` s for each and
    SIGKILL the group of any that is still running. Never raises for a group already gone."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cli_env(**env: str) -> dict[str, str]:
    """The environment of an `agl_lab` subprocess: this checkout first on PYTHONPATH, hash seed 0."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0", **env}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_cli(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`python -m agl_lab.cli *argv` in its own process group (stop it with `stop_groups`), output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agl_lab.cli", *argv],
            cwd=ROOT,
            env=cli_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(predicate: Callable[[], bool], bound: float, what: str, procs=(), logs=()) -> None:
    """Poll `predicate` for up to `bound` s; fail at once, with its log's tail, if one of `procs` exits."""
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if predicate():
            return
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, f"{what}: {log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {bound} s waiting for {what}")


def healthy(url: str) -> bool:
    """Whether the server at `url` answers `GET /healthz` with 200."""
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
