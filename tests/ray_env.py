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

    import psutil

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
            if i == 0:
                port = free_port()
                cmd += [
                    "--head",
                    f"--port={port}",
                    "--include-dashboard=false",
                    f"--ray-client-server-port={free_port()}",
                ]
            else:
                cmd += [f"--address={address}"]
            subprocess.run(cmd, env=env, cwd=path, check=True, timeout=180, capture_output=True)
            if i == 0:
                import ray

                address = f"{ray.util.get_node_ip_address()}:{port}"
        yield address
    finally:
        # not `ray stop`: it stops every Ray process of this user on the machine, other people's too
        left = {
            p.pid: p
            for p in psutil.process_iter(["cmdline"])
            if any(d in " ".join(p.info["cmdline"] or []) for d in dirs)
        }
        for p in list(left.values()):
            with contextlib.suppress(psutil.Error):
                left.update({c.pid: c for c in p.children(recursive=True)})
        left = list(left.values())
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=30)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        for path in dirs:
            if not os.environ.get("AGL_LAB_KEEP_RAY_DIRS"):  # debugging: keep the nodes' logs
                shutil.rmtree(path, ignore_errors=True)


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
