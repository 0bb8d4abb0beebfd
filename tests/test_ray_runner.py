"""`agl-lab runner --ray ADDRESS` against two real Ray nodes on this machine (`ray start --head` and a
second `ray start --address`, one CPU each, no PYTHONPATH: workers get agl_lab and the agent's
module through Ray `py_modules`) and a real server on loopback: the runner process claims and
heartbeats, the agents run as Ray tasks on both nodes (each attempt's `ray_node` event names its
node), and the rollout whose node is killed (SIGKILL of that node's processes) is released by the
runner and re-runs as attempt "1" on the surviving node, while the other rollout finishes as
attempt "0"."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from agl_lab.client import AglClient  # noqa: E402
from agl_lab.protocol import RolloutCreate  # noqa: E402
from agl_lab.ray_runner import NODE_EVENT  # noqa: E402
from tests.ray_env import isolated_ray_env, node_index, node_of, ray_nodes  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two Ray nodes started with `ray start`

KEY = "ray-runner-key"
ROOT = Path(__file__).resolve().parents[1]
AGENT = "tests.agents_for_tests:ray_hold_agent"


def wait_for(predicate, bound: float, what: str) -> None:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {bound} s waiting for {what}")


def kill_node(path: str) -> int:
    """SIGKILL every process of the Ray node started under `path` (its raylet, workers, agents)."""
    import psutil

    procs = {p.pid: p for p in psutil.process_iter(["cmdline"]) if path in " ".join(p.info["cmdline"] or [])}
    for p in list(procs.values()):
        with contextlib.suppress(psutil.Error):
            procs.update({c.pid: c for c in p.children(recursive=True)})
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(list(procs.values()), timeout=30)
    return len(procs)


def test_agents_run_on_both_nodes_and_a_killed_nodes_rollout_reruns_as_attempt_1(embedded_server, tmp_path):
    if ray.is_initialized():  # a connection left by another module would be reused, not joined
        ray.shutdown()
    dirs: list[str] = []
    with isolated_ray_env("aglr"), ray_nodes(2, num_cpus=1, num_gpus=0, dirs_out=dirs) as address:
        nodes = node_index(address, dirs)
        assert sorted(nodes.values()) == [0, 1], nodes
        head, second = (next(n for n, i in nodes.items() if i == k) for k in (0, 1))
        server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
        argv = [sys.executable, "-m", "agl_lab.cli", "runner", "--server", server.url, "--key", KEY]
        argv += ["--agent", AGENT, "--ray", address, "--concurrency", "2", "--poll-interval", "0.05"]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            with AglClient(server.url, key=KEY) as client:
                # 1. quick rollouts: one Ray CPU per node and per agent; the first two wait for each other,
                # so two ran at the same time -> on both nodes (without the meeting a fast node may run all four)
                quick = [f"q{i}" for i in range(4)]
                meet = tmp_path / "meet"
                meet.mkdir()
                task = {"meet_dir": str(meet), "meet_count": 2}
                client.create_rollouts([RolloutCreate(rollout_id=r, input=task) for r in quick])
                wait_for(lambda: all(client.get_rollout(r)[0].is_terminal for r in quick), 300, "the quick rollouts")
                for r in quick:
                    rollout, attempts = client.get_rollout(r)
                    assert rollout.status.state == "succeeded" and attempts == ["0"], rollout.status
                    assert client.get_events(r, event_type="reward")[0]["data"] == {"value": 1.0}
                assert {node_of(client, r) for r in quick} == {head, second}

                # 2. two held rollouts, one on each node; kill the second node
                hold = str(tmp_path / "release")
                client.create_rollouts([RolloutCreate(rollout_id=f"h{i}", input={"hold_file": hold}) for i in (0, 1)])
                wait_for(lambda: {node_of(client, r) for r in ("h0", "h1")} == {head, second}, 300, "h0, h1 to start")
                doomed = next(r for r in ("h0", "h1") if node_of(client, r) == second)
                survivor = "h1" if doomed == "h0" else "h0"
                assert kill_node(dirs[1]) > 0
                wait_for(  # released, then claimed again (attempt 1 waits for the survivor's CPU)
                    lambda: (
                        "(Ray node lost: " in (client.get_rollout(doomed)[0].status.error_message or "")
                        or client.get_rollout(doomed)[0].status.last_attempt_id == "1"
                    ),
                    300,
                    f"the runner to release {doomed}",
                )
                Path(hold).touch()
                wait_for(
                    lambda: all(client.get_rollout(r)[0].is_terminal for r in ("h0", "h1")), 300, "h0, h1 to finish"
                )
                rollout, attempts = client.get_rollout(doomed)
                assert rollout.status.state == "succeeded" and attempts == ["0", "1"], rollout.status
                assert rollout.status.last_attempt_id == "1"
                assert node_of(client, doomed) == head  # attempt 1 ran on the node that is left
                assert client.get_events(doomed, event_type="reward")[0]["data"] == {"value": 1.0}
                rollout, attempts = client.get_rollout(survivor)
                assert rollout.status.state == "succeeded" and attempts == ["0"], rollout.status
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = out.strip().splitlines()
    assert proc.returncode == 0, out
    assert f"agents as Ray tasks on {address}" in lines[0], out
    assert "6 done (6 succeeded, 0 failed)" in lines[-1] and "node_lost 1" in lines[-1], out


def test_ray_flags_are_checked_before_any_cluster_is_joined():
    argv = [sys.executable, "-m", "agl_lab.cli", "runner", "--server", "http://127.0.0.1:9", "--key", KEY]
    done = subprocess.run(
        [*argv, "--agent", AGENT, "--ray", "--ray-cpus-per-agent", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--ray-cpus-per-agent must be >= 0, got -1.0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_agl_agent_classes_run_in_a_subprocess_on_the_node_with_the_rollouts_token_only(embedded_server):
    from agl_lab.ray_runner import RayRunner

    if ray.is_initialized():
        ray.shutdown()
    with isolated_ray_env("aglc"), ray_nodes(1, num_cpus=1, num_gpus=0) as address:
        server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
        with AglClient(server.url, key=KEY) as client:
            for agent, rid in (("EnvReportAgent", "env"), ("CrashAgent", "crash")):
                with RayRunner(
                    server.url, key=KEY, agent=f"tests.agents_for_tests:{agent}", address=address, cpus_per_agent=0.5
                ):
                    client.create_rollouts([RolloutCreate(rollout_id=rid, input={})])
                    wait_for(lambda: client.get_rollout(rid)[0].is_terminal, 300, f"rollout {rid}")  # noqa: B023
                assert not ray.is_initialized()  # stop() left the cluster it joined
        with AglClient(server.url, key=KEY) as client:
            env_rollout, _ = client.get_rollout("env")
            env = client.get_events("env", event_type="env")[0]["data"]
            node = client.get_events("env", event_type=NODE_EVENT)[0]["data"]
            client_rollout, _ = client.get_rollout("crash")
    assert env_rollout.status.state == "succeeded"
    assert env["AGL_KEY"] and env["AGL_KEY"] != KEY and "AGL_RUNNER_KEY" not in env  # its token, not the key
    assert env["AGL_EVENT_URL"].startswith(server.url) and node["node_id"] and node["pid"] != os.getpid()
    assert client_rollout.status.state == "failed"
    message = client_rollout.status.error_message
    assert message.startswith("subprocess exited with code 1 on Ray node ") and "agent crashed on purpose" in message
