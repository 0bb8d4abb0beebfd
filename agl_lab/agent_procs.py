"""The processes of one agent subprocess, and how the runner ends all of them.

An AGL agent class runs in a subprocess that leads its own session, so its process group holds
the agent and every plain child it starts (a tool server, a shell): one `killpg` ends them. A
*daemon* leaves that group: it forks, calls `setsid` and forks again, and its parent exits, so
it sits in a session of its own, re-parented to init, and a `killpg` never reaches it.

What a daemon keeps is its environment. Every agent subprocess starts with
`AGL_LAB_ROLLOUT_MARK=<a value unique to the execution>` (`new_mark`), which its children and
their children inherit through fork and exec; `marked_pids` sweeps /proc for the processes of
this user whose start-up environment carries it. Ending a rollout's processes is both: the
process group, then the sweep, repeated until no marked process is left (a daemon may be
forking while it is swept).

What the sweep cannot find (docs/robustness.md, "Agent processes"): a process that execs with
a cleared or rewritten environment (`env -i`, `execve(path, argv, {})`; changing `os.environ`
in the process does not hide it: /proc shows the environment it started with), one that changes
its user, one in another PID namespace, and anything on a system without /proc (macOS: the
process group only). A cgroup would hold them all, but needs a delegated cgroup tree (root or a
systemd user session); the runner does not create one.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import time

log = logging.getLogger(__name__)

MARK_VARIABLE = "AGL_LAB_ROLLOUT_MARK"
KILL_WAIT_SECONDS = 5.0  # how long a SIGKILLed agent leader may take to be reaped
TERM_GRACE_SECONDS = 2.0  # stop(): agents' processes get SIGTERM, then SIGKILL after this
SWEEP_SECONDS = 2.0  # the sweep repeats (a daemon may be forking) for at most this long


def new_mark(rollout_id: str) -> str:
    """A value for `MARK_VARIABLE` that names one execution of `rollout_id` and no other."""
    return f"{rollout_id}.{os.getpid()}.{secrets.token_hex(8)}"


def marked_pids(mark: str) -> list[int]:
    """Pids of this user's live processes whose start-up environment holds `MARK_VARIABLE=mark`.

    Reads /proc/<pid>/environ (empty for a zombie, so the dead are not counted); [] without /proc."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    uid, me = os.getuid(), os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):  # Critical: a whole entry, so "mark" never matches "mark2"
            found.append(int(entry))
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_rollout_processes(proc: subprocess.Popen, mark: str | None) -> None:
    """SIGKILL the agent's process group (it leads its own session), reap the leader, then sweep
    for the processes that carry `mark` (daemons that left the group) until none is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=KILL_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        log.error("agent subprocess %d did not die within %ss of SIGKILL", proc.pid, KILL_WAIT_SECONDS)
    if mark is None:
        return
    deadline = time.monotonic() + SWEEP_SECONDS
    while pids := marked_pids(mark):
        _signal(pids, signal.SIGKILL)
        if time.monotonic() > deadline:
            log.error("agent processes %s (%s=%s) survived SIGKILL for %ss", pids, MARK_VARIABLE, mark, SWEEP_SECONDS)
            return
        time.sleep(0.02)  # a killed process leaves /proc (or turns zombie) within moments


def terminate_rollout_processes(
    agents: list[tuple[subprocess.Popen, str | None]], grace: float = TERM_GRACE_SECONDS
) -> None:
    """SIGTERM every live agent's process group and marked processes at once, then wait up to
    `grace` seconds in all for the leaders to exit (`kill_rollout_processes` follows for what
    remains)."""
    alive = [(proc, mark) for proc, mark in agents if proc.poll() is None]
    for proc, mark in alive:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        if mark is not None:
            _signal(marked_pids(mark), signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc, _ in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
