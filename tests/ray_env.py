"""A private Ray temp dir for a test module that starts a real Ray cluster (verl on CPU, vLLM).

Ray's socket paths must stay short (a short prefix under /tmp), and RAY_AUTH_MODE is off for
tests; both variables are put back as they were, and the directory removed, afterwards.

    with isolated_ray_env("aglr"), ray_nodes(2, num_cpus=1, num_gpus=0, dirs_out=dirs) as address:
        node_index(address, dirs)     # {Ray node id: index of the `ray start` that started it}
        node_of(client, rollout_id)   # the node id the rollout's last attempt ran on (RayRunner)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the module stays light: the vLLM suite imports it too
    from agl_lab.client import AglClient


@contextlib.contextmanager
def isolated_ray_env(prefix: str) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=path, RAY_AUTH_MODE="disabled")
    try:
        yield path
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_nodes(
    count: int, *, num_cpus: int = 4, num_gpus: int = 1, object_store_mb: int = 100, dirs_out: list | None = None
) -> Iterator[str]:
    """`count` Ray nodes on this machine started with `ray start` (a head, then `count - 1` joining
    it), each with its own temp dir and free ports; yields the head's address (`ip:port`).
    Measured: ~5-10 s per node on the 2-core machine.

    The nodes run in a clean env (no PYTHONPATH, cwd in the temp dir), so a worker imports agl_lab
    only as the driver ships it (Ray `py_modules`). Afterwards the processes that ran under those
    dirs (and their children) are terminated and waited for (bounded, then killed): nothing is
    left behind, nothing else is touched (not `ray stop`, which stops every Ray of this user)."""
    import subprocess
    import sys

    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "RAY_TMPDIR")}
    # workers at nice 0, not Ray's 15: beside two busy loops a niced worker gets ~3 % of a core
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_worker_niceness="0")
    dirs = [tempfile.mkdtemp(prefix=f"agln{i}", dir="/tmp") for i in range(count)]
    if dirs_out is not None:  # node i's processes have dirs_out[i] in their command line (to kill one)
        dirs_out.extend(dirs)
    address = None
    try:
        for i, path in enumerate(dirs):
            for attempt in (1, 2):  # Ray gives a raylet 30 s (fixed) to register: at load 10+ it may not
                cmd, head = _start_command(ray_cli, path, address, num_cpus, num_gpus, object_store_mb)
                done = subprocess.run(cmd, env=env, cwd=path, timeout=180, capture_output=True, text=True)
                if done.returncode == 0:
                    break
                _stop([path], head)  # this attempt's processes: a late raylet must not join the cluster
                if attempt == 2:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                    raise RuntimeError(f"`ray start` of node {i} failed twice (exit {done.returncode}): {tail}")
            address = address or head
        yield address
    finally:
        _stop(dirs, address)
        for path in dirs:
            if not os.environ.get("AGL_LAB_KEEP_RAY_DIRS"):  # debugging: keep the nodes' logs
                shutil.rmtree(path, ignore_errors=True)


def _start_command(
    ray_cli: str, path: str, address: str | None, num_cpus: int, num_gpus: int, object_store_mb: int
) -> tuple[list[str], str | None]:
    """`ray start` of a node under `path` on fresh free ports: a head when `address` is None (then
    also the head's `ip:port`), else a node joining `address`."""
    ports = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-grpc-port",
        "--dashboard-agent-listen-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    ]
    cmd = [
        ray_cli,
        "start",
        "--temp-dir",
        path,
        f"--num-cpus={num_cpus}",
        f"--num-gpus={num_gpus}",
        f"--object-store-memory={object_store_mb * 2**20}",
        "--disable-usage-stats",
        *(arg for flag in ports for arg in (flag, str(free_port()))),
    ]
    if address is not None:
        return [*cmd, f"--address={address}"], None
    import ray

    port = free_port()
    head = ["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}"]
    return [*cmd, *head], f"{ray.util.get_node_ip_address()}:{port}"


def _stop(dirs: list[str], address: str | None) -> None:
    """Terminate the processes of the nodes started under `dirs` (a dir in the command line, or the
    head's address: the Ray client server names no dir) and their children; after a short grace,
    kill. Not `ray stop`: it stops every Ray process of this user on the machine, other people's too."""
    import psutil

    def ours(cmdline: list[str]) -> bool:
        return any(d in " ".join(cmdline) for d in dirs) or bool(address and f"--address={address}" in cmdline)

    left = {p.pid: p for p in psutil.process_iter(["cmdline"]) if ours(p.info["cmdline"] or [])}
    for p in list(left.values()):
        with contextlib.suppress(psutil.Error):
            left.update({c.pid: c for c in p.children(recursive=True)})
    procs = list(left.values())
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    # 5 s, then SIGKILL: some (the autoscaler monitor, workers whose GCS is gone) never exit on
    # SIGTERM, and the old 30 s wait for them cost every cluster's teardown 30 s; nothing is kept
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def node_index(address: str, dirs: list[str]) -> dict[str, int]:
    """Ray node id -> index of the `ray start` that started it (its temp dir is in its socket path)."""
    import ray

    ray.init(address=address, logging_level="WARNING")
    try:
        return {
            n["NodeID"]: i for n in ray.nodes() for i, d in enumerate(dirs) if n["Alive"] and d in n["RayletSocketName"]
        }
    finally:
        ray.shutdown()


def node_of(client: AglClient, rollout_id: str) -> str | None:
    """The node id of the rollout's last attempt (its `ray_node` event), None before the agent started."""
    from agl_lab.ray_runner import NODE_EVENT

    events = client.get_events(rollout_id, event_type=NODE_EVENT)
    return events[-1]["data"]["node_id"] if events else None
