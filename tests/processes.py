"""Stopping the subprocesses a test started (servers, runners, trainers), each in its own
process group: SIGTERM to every group first, then wait, then SIGKILL a group that outlived it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable


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
