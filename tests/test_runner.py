"""Runner: real server on loopback, real agent threads and subprocesses; assert what the store shows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest

from agl_lab.agent import AgentContext, agent_urls, resolve_env_map
from agl_lab.agent_procs import MARK_VARIABLE, kill_rollout_processes, marked_pids, new_mark
from agl_lab.protocol import Rollout, rollout_token
from agl_lab.runner import Runner
from agl_lab.server.embedded import EmbeddedServer
from tests.conftest import scaled
from tests.servers import status, wait_terminal, wait_until

KEY = "runner-key"
AGENTS = "tests.agents_for_tests"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def server(embedded_server) -> EmbeddedServer:
    return embedded_server(key=KEY)


@pytest.fixture
def api(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=10) as client:
        yield client


def create(api: httpx.Client, *rollouts: dict[str, Any]) -> list[str]:
    body = [{"rollout_id": f"r{i}-{time.monotonic_ns()}", **r} for i, r in enumerate(rollouts)]
    resp = api.post("/api/rollouts", json=body)
    assert resp.status_code == 201, resp.text
    return [r["rollout_id"] for r in resp.json()]


def subprocess_rollout(
    agent_class: str | None,
    env_map: dict[str, str] | None = None,
    input: Any = None,
    timeout_seconds: int = 3600,
    is_train: bool = True,
) -> dict:
    local = {"env_map": env_map or {}}
    if agent_class is not None:
        local["agent_class"] = f"{AGENTS}:{agent_class}"
    return {
        "input": input if input is not None else {},
        "is_train": is_train,
        "config": {"timeout_seconds": timeout_seconds, "local": local},
    }


def events(api: httpx.Client, rid: str, **params: str) -> list[dict]:
    resp = api.get(f"/api/rollouts/{rid}/events", params=params)
    resp.raise_for_status()
    return resp.json()


def process_gone(pid: int) -> bool:
    """True if `pid` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _session_of(pid: int) -> int | None:
    """`pid`'s session id; None once it is gone (a zombie counts as gone). One read: the runner's
    kill may end and reap the process between two looks, as between `process_gone` and `os.getsid`."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return None
    return None if fields[0] == "Z" else int(fields[3])


# ---------------------------------------------------------------------------------------------
# what the agent receives (pure)
# ---------------------------------------------------------------------------------------------


def test_env_map_resolution_follows_agl_rules():
    task = {"question": "2+2 = ？", "nums": [1, 2, {"x": None}], "meta": {"ok": True}}
    env = resolve_env_map(
        {
            "Q": "input.question",
            "N": "input.nums.1",
            "X": "input.nums.2.x",
            "ALL": "input",
            "META": "input.meta",
            "LIT": "Qwen/Qwen2.5-1.5B",
        },
        task,
    )
    assert env == {
        "Q": "2+2 = ？",
        "N": "2",
        "X": "null",
        "ALL": json.dumps(task, ensure_ascii=False),
        "META": '{"ok": true}',
        "LIT": "Qwen/Qwen2.5-1.5B",
    }
    for bad in ("input.missing", "input.nums.3", "input.question.0", "input.nums.x"):
        with pytest.raises(ValueError, match=f"^local.env_map path not found: {bad}$"):
            resolve_env_map({"V": bad}, task)


def test_agent_urls_match_agl():
    assert agent_urls("http://h:1/", "abc", True) == (
        "http://h:1/proxy/rollout/abc/attempt/0/mode/train/openai/v1",
        "http://h:1/api/rollouts/abc/attempt/0/events",
    )
    assert agent_urls("http://h:1", "abc", False)[0].endswith("/mode/val/openai/v1")


def test_bad_runner_arguments_name_the_argument():
    with pytest.raises(ValueError, match="concurrency"):
        Runner("http://x", agent=lambda t, c: None, concurrency=0)
    with pytest.raises(ValueError, match="poll_interval"):
        Runner("http://x", poll_interval=0)
    with pytest.raises(TypeError, match="agent"):
        Runner("http://x", agent=42)
    with pytest.raises(ValueError, match="module:Class"):
        Runner("http://x", agent="NoModule")


# ---------------------------------------------------------------------------------------------
# callable agents
# ---------------------------------------------------------------------------------------------


def test_callable_agent_success_posts_reward_and_gets_its_context(server, api):
    seen: dict[str, AgentContext] = {}

    def agent(task: dict, ctx: AgentContext) -> float | None:
        seen[ctx.rollout_id] = ctx
        ctx.emit("note", {"task": task["n"]})
        return None if task["n"] == 2 else task["n"] / 4

    ids = create(api, {"input": {"n": 0}}, {"input": {"n": 1}, "is_train": False}, {"input": {"n": 2}})
    with Runner(server.url, key=KEY, agent=agent) as runner:
        final = wait_terminal(api, ids)
    assert {rid: st["state"] for rid, st in final.items()} == dict.fromkeys(ids, "succeeded")
    assert all(st["last_attempt_id"] == "0" and st["error_message"] is None for st in final.values())
    assert [e["data"] for e in events(api, ids[0])] == [{"task": 0}, {"value": 0.0}]
    assert [(e["event_type"], e["data"]) for e in events(api, ids[1])] == [
        ("note", {"task": 1}),
        ("reward", {"value": 0.25}),
    ]
    assert events(api, ids[2], event_type="reward") == []  # None = no reward event
    ctx = seen[ids[1]]
    assert ctx.base_url == f"{server.url}/proxy/rollout/{ids[1]}/attempt/0/mode/val/openai/v1"
    assert ctx.event_url == f"{server.url}/api/rollouts/{ids[1]}/attempt/0/events"
    # the rollout as the store holds it, typed (attempt 0 running), not a dict copy of it
    assert isinstance(ctx.rollout, Rollout) and ctx.rollout.input == {"n": 1}
    status = ctx.rollout.status
    assert (ctx.rollout.rollout_id, status.state, status.last_attempt_id) == (ids[1], "running", "0")
    assert ctx.mode == "val" and ctx.env["AGL_OPENAI_BASE_URL"] == ctx.base_url
    token = rollout_token(KEY, ids[1], ctx.rollout.status.created_at)
    assert (ctx.api_key, ctx.attempt_id, ctx.is_train) == (token, "0", False)
    client = ctx.openai_client(max_retries=1)
    assert str(client.base_url).rstrip("/") == ctx.base_url and client.api_key == token
    assert runner.stats == {
        "claimed": 3,
        "succeeded": 3,
        "failed": 0,
        "abandoned": 0,
        "released": 0,
        "conflicts": 0,
        "running": 0,
    }


def test_async_callable_agent_is_awaited(server, api):
    async def agent(task, ctx):
        return 0.5

    ids = create(api, {"input": {}})
    with Runner(server.url, key=KEY, agent=agent):
        assert wait_terminal(api, ids)[ids[0]]["state"] == "succeeded"
    assert events(api, ids[0])[0]["data"] == {"value": 0.5}


def test_callable_crash_timeout_and_bad_return_fail_with_a_message(server, api):
    late_gateway_status: list[int] = []

    def agent(task: dict, ctx: AgentContext):
        if task["kind"] == "raise":
            raise ValueError("bad task 7")
        if task["kind"] == "bool":
            return True
        # hang: ignore the deadline, then try the gateway after the runner gave up
        ctx.cancelled.wait(30)
        wait_until(lambda: status_of(ctx.rollout_id) == "failed", 10, "the timeout patch")
        resp = httpx.post(
            ctx.base_url + "/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
        )
        late_gateway_status.append(resp.status_code)

    def status_of(rid: str) -> str:
        return status(api, rid)["state"]

    ids = create(
        api,
        {"input": {"kind": "raise"}},
        {"input": {"kind": "bool"}},
        {"input": {"kind": "hang"}, "config": {"timeout_seconds": 1}},
    )
    with Runner(server.url, key=KEY, agent=agent):
        final = wait_terminal(api, ids)
        wait_until(lambda: late_gateway_status, 15, "the abandoned agent's late call")
    assert {st["state"] for st in final.values()} == {"failed"}
    raised = final[ids[0]]["error_message"]
    assert raised.startswith("agent raised ValueError: bad task 7\n") and "Traceback" in raised
    assert final[ids[1]]["error_message"].startswith("agent returned bool True; return a float reward")
    assert final[ids[2]]["error_message"] == "agent timed out after 1 s"
    assert late_gateway_status == [409]  # the gateway refuses calls of a terminal rollout


def test_runner_timeout_caps_the_rollout_timeout(server, api):
    ids = create(api, {"input": {}})  # config.timeout_seconds defaults to 3600
    with Runner(server.url, key=KEY, agent=lambda t, ctx: ctx.cancelled.wait(30), rollout_timeout_seconds=0.3):
        final = wait_terminal(api, ids)
    assert final[ids[0]]["error_message"] == "agent timed out after 0.3 s"


def test_concurrency_limit_is_respected(server, api):
    limit, lock = 3, threading.Lock()
    active, peak = [0], [0]
    barrier = threading.Barrier(limit, timeout=10)  # passes only when `limit` agents run at once

    def agent(task, ctx):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            barrier.wait()
            time.sleep(0.05)
        finally:
            with lock:
                active[0] -= 1
        return 1.0

    ids = create(api, *[{"input": {"i": i}} for i in range(3 * limit)])
    with Runner(server.url, key=KEY, agent=agent, concurrency=limit):
        final = wait_terminal(api, ids)
    assert [st["state"] for st in final.values()] == ["succeeded"] * len(ids)
    assert peak[0] == limit


def test_two_runners_never_run_a_rollout_twice(server, api):
    runs: list[str] = []
    lock = threading.Lock()

    def agent(task, ctx):
        with lock:
            runs.append(ctx.rollout_id)
        time.sleep(0.01)

    ids = create(api, *[{"input": {"i": i}} for i in range(12)])
    with (
        Runner(server.url, key=KEY, agent=agent, concurrency=4) as a,
        Runner(server.url, key=KEY, agent=agent, concurrency=4) as b,
    ):
        wait_terminal(api, ids)
    assert sorted(runs) == sorted(ids)
    assert a.stats["claimed"] + b.stats["claimed"] == len(ids)


def test_shutdown_releases_running_rollouts_back_to_the_queue(server, api):
    started = threading.Semaphore(0)

    def agent(task, ctx):
        started.release()
        ctx.cancelled.wait(60)  # a well-behaved agent stops when the runner gives up

    ids = create(api, *[{"input": {"i": i}} for i in range(5)])
    runner = Runner(server.url, key=KEY, agent=agent, concurrency=2).start()
    try:
        for _ in range(2):
            assert started.acquire(timeout=10)
    finally:
        runner.stop()
    states = [status(api, rid) for rid in ids]
    released = [st for st in states if st["error_message"]]
    assert len(released) == 2 and runner.stats["released"] == 2 and runner.stats["failed"] == 0
    assert all(
        st["error_message"] == f"attempt 0 released (runner {runner.runner_id} stopped); re-queued"
        and st["last_attempt_id"] == "0"
        for st in released
    )
    assert all(st["state"] == "queuing" for st in states)  # none failed: another runner runs them
    assert api.get("/api/rollouts", params={"state_in": "running"}).json() == []
    assert runner.running == []
    seen = []
    with Runner(server.url, key=KEY, agent=lambda task, ctx: seen.append((task["i"], ctx.attempt_id)) or 1.0):
        wait_terminal(api, ids)
    attempts = dict(seen)
    assert sorted(attempts) == [0, 1, 2, 3, 4] and sorted(attempts.values()) == ["0", "0", "0", "1", "1"]
    assert all(status(api, rid)["state"] == "succeeded" for rid in ids)


def test_runner_keeps_polling_through_a_server_outage(embedded_server):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with Runner(url, key=KEY, agent=lambda t, ctx: 1.0, poll_interval=0.02, request_timeout=1):
        time.sleep(0.2)  # several polls hit a closed port
        server = embedded_server(key=KEY, port=port)
        with httpx.Client(base_url=server.url, headers=server.headers) as api:
            ids = create(api, {"input": {}})
            assert wait_terminal(api, ids)[ids[0]]["state"] == "succeeded"


# ---------------------------------------------------------------------------------------------
# subprocess agents (AGL agent classes)
# ---------------------------------------------------------------------------------------------


def test_subprocess_agent_gets_the_agl_environment(server, api, monkeypatch):
    for secret in ("AGL_ENGINE_KEY", "AGL_RUNNER_KEY"):  # this host's keys: not passed on to agents
        monkeypatch.setenv(secret, "host-secret")
    task = {"question": "¿cuánto es 2+2?", "nums": [3, 4], "meta": {"level": 1}}
    env_map = {
        "T_Q": "input.question",
        "T_N": "input.nums.1",
        "T_META": "input.meta",
        "T_ALL": "input",
        "T_MODEL": "Qwen/Qwen2.5-1.5B-Instruct",
    }
    ids = create(
        api, subprocess_rollout("EnvReportAgent", env_map, task), subprocess_rollout("AsyncRewardAgent", is_train=False)
    )
    with Runner(server.url, key=KEY, concurrency=2):  # agent=None: each rollout's agent_class
        final = wait_terminal(api, ids)
    assert [final[rid]["state"] for rid in ids] == ["succeeded", "succeeded"]
    env = events(api, ids[0], event_type="env")[0]["data"]
    env = {k: v for k, v in env.items() if not k.startswith("AGL_LAB_")}  # agl_lab's own settings pass through
    assert env == {
        "AGL_OPENAI_BASE_URL": f"{server.url}/proxy/rollout/{ids[0]}/attempt/0/mode/train/openai/v1",
        "AGL_EVENT_URL": f"{server.url}/api/rollouts/{ids[0]}/attempt/0/events",
        "AGL_KEY": rollout_token(KEY, ids[0], final[ids[0]]["created_at"]),  # its own token, not the server key
        "T_Q": "¿cuánto es 2+2?",
        "T_N": "4",
        "T_META": '{"level": 1}',
        "T_ALL": json.dumps(task, ensure_ascii=False),
        "T_MODEL": "Qwen/Qwen2.5-1.5B-Instruct",
    }
    assert events(api, ids[0], event_type="reward")[0]["data"] == {"value": 1.0}
    assert events(api, ids[1], event_type="reward")[0]["data"] == {"value": 0.25}


def test_runner_agent_class_overrides_the_rollout(server, api):
    ids = create(api, subprocess_rollout(None, input={}))  # no agent_class in the rollout
    with Runner(server.url, key=KEY, agent=f"{AGENTS}.AsyncRewardAgent"):
        assert wait_terminal(api, ids)[ids[0]]["state"] == "succeeded"


def test_subprocess_failures_fail_with_a_message(server, api):
    ids = create(
        api,
        subprocess_rollout("CrashAgent"),
        subprocess_rollout("ExitCodeAgent"),
        subprocess_rollout(None),
        subprocess_rollout("EnvReportAgent", {"T_X": "input.nope"}),
        subprocess_rollout("NoSuchAgent"),
    )
    with Runner(server.url, key=KEY, concurrency=5):
        final = [wait_terminal(api, ids)[rid] for rid in ids]
    assert [st["state"] for st in final] == ["failed"] * 5
    crash, code3, missing, bad_path, no_class = (st["error_message"] for st in final)
    assert crash.startswith("subprocess exited with code 1; stderr tail:\n")
    assert "about to crash" in crash and "RuntimeError: agent crashed on purpose" in crash
    assert code3 == "subprocess exited with code 3; stderr tail:\nbad configuration: giving up"
    assert missing.startswith("local subprocess spawn failed: invalid rollout config: missing config.local.agent_class")
    assert bad_path == "local subprocess spawn failed: local.env_map path not found: input.nope"
    assert no_class.startswith("subprocess exited with code 1") and "has no attribute 'NoSuchAgent'" in no_class


def test_subprocess_timeout_kills_the_process_group(server, api):
    # 6 s: the agent's start (Python, imports, its tool child, the "pids" event) must fit in it on a loaded host
    ids = create(api, subprocess_rollout("HangAgent", timeout_seconds=6))
    with Runner(server.url, key=KEY):
        final = wait_terminal(api, ids)
    assert final[ids[0]]["error_message"] == "local subprocess timed out after 6 s"
    pids = events(api, ids[0], event_type="pids")[0]["data"]
    wait_until(lambda: process_gone(pids["agent"]) and process_gone(pids["tool"]), 10, "the agent's group to die")


def test_shutdown_kills_subprocess_agents(server, api):
    ids = create(api, subprocess_rollout("HangAgent"), subprocess_rollout("HangAgent"))
    runner = Runner(server.url, key=KEY).start()
    try:
        wait_until(lambda: all(events(api, rid, event_type="pids") for rid in ids), scaled(60), "agents to start")
    finally:
        runner.stop()
    for rid in ids:
        st = status(api, rid)
        assert st["state"] == "queuing" and st["error_message"].startswith("attempt 0 released")
        pids = events(api, rid, event_type="pids")[0]["data"]
        wait_until(lambda pids=pids: process_gone(pids["agent"]) and process_gone(pids["tool"]), 10, "agents to die")


def test_rollout_ended_outside_the_runner_stops_its_agent(server, api):
    ids = create(api, subprocess_rollout("HangAgent"))
    with Runner(server.url, key=KEY) as runner:
        wait_until(lambda: events(api, ids[0], event_type="pids"), scaled(60), "the agent to start")
        api.patch(
            f"/api/rollouts/{ids[0]}", json={"status": {"state": "failed", "error_message": "trainer gave up"}}
        ).raise_for_status()
        pids = events(api, ids[0], event_type="pids")[0]["data"]
        wait_until(lambda: process_gone(pids["agent"]) and process_gone(pids["tool"]), 10, "the agent to die")
        wait_until(lambda: runner.stats["abandoned"] == 1, scaled(30), "the slot to be freed")
    assert status(api, ids[0])["error_message"] == "trainer gave up"  # the runner did not overwrite it


def test_a_daemonised_tool_server_ends_with_its_rollout(server, api):
    """A daemon (fork, setsid, fork) leaves the agent's process group; the runner still ends it:
    when the agent finishes, and when stop() ends a running agent."""
    done = create(api, subprocess_rollout("DaemonAgent"))
    with Runner(server.url, key=KEY) as runner:
        assert wait_terminal(api, done)[done[0]]["state"] == "succeeded"
        wait_until(lambda: runner.stats["succeeded"] == 1, scaled(30), "the runner to finish the rollout")
        first = events(api, done[0], event_type="pids")[0]["data"]
        daemon = first["daemon"]
        assert _session_of(daemon) != first["agent"]  # it left the agent's session (or is gone already)
        wait_until(lambda: process_gone(daemon), 10, "the finished rollout's daemon to die")
        hung = create(api, subprocess_rollout("DaemonAgent", {"T_HANG": "1"}))
        wait_until(lambda: events(api, hung[0], event_type="pids"), scaled(60), "the hanging agent to start")
    pids = events(api, hung[0], event_type="pids")[0]["data"]
    assert status(api, hung[0])["state"] == "queuing"
    wait_until(lambda: process_gone(pids["agent"]) and process_gone(pids["daemon"]), 10, "the stopped agent's daemon")


def _runs_sleep(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[0] == b"sleep"
    except OSError:
        return False


def test_the_sweep_finds_a_mark_through_exec_and_not_past_a_cleared_environment():
    """`marked_pids` matches the whole `AGL_LAB_ROLLOUT_MARK=...` entry of a process started with
    it; a process that execs with a cleared environment is out of its reach (docs/robustness.md)."""
    mark = new_mark("r1")
    env = {**os.environ, MARK_VARIABLE: mark}
    carried = subprocess.Popen(["sleep", "60"], env=env)
    cleared = subprocess.Popen(["env", "-i", "sleep", "60"], env=env)
    longer = subprocess.Popen(["sleep", "60"], env={**os.environ, MARK_VARIABLE: mark + "0"})
    try:
        # Critical: `env -i` holds the mark until it execs sleep; look only once all three run sleep.
        wait_until(
            lambda: all(_runs_sleep(p.pid) for p in (carried, cleared, longer)), scaled(30), "the three to exec sleep"
        )
        wait_until(lambda: carried.pid in marked_pids(mark), scaled(30), "the marked process to show")
        found = marked_pids(mark)
        assert cleared.pid not in found and longer.pid not in found
        kill_rollout_processes(subprocess.Popen(["true"], start_new_session=True), mark)
        assert carried.wait(timeout=5) == -9 and marked_pids(mark) == []
        assert cleared.poll() is None and longer.poll() is None
    finally:
        for proc in (carried, cleared, longer):
            proc.kill()
            proc.wait()
