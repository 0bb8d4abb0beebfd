"""`agl-lab runner` as a real process against a real server on loopback: it claims and runs
rollouts, SIGTERM releases what it holds, SIGKILL loses nothing (the lease re-queues the
rollouts as attempt 1 for another runner), and the trainer's collection and hooks see each
rollout finish exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agl_lab.client import AglClient
from agl_lab.hooks import RolloutHooks
from agl_lab.protocol import RolloutCreate
from agl_lab.rollout import SyncRolloutManager
from tests.conftest import scaled

KEY = "runner-cli-key"
ROOT = Path(__file__).resolve().parents[1]
AGENT = "tests.agents_for_tests:remote_agent"


def start_runner(url: str, *extra: str, env: dict[str, str] | None = None, key: str = KEY) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "agl_lab.cli",
        "runner",
        "--server",
        url,
        "--key",
        key,
        "--agent",
        AGENT,
        "--poll-interval",
        "0.02",
        *extra,
    ]
    return subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for(predicate, bound: float, what: str) -> None:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {bound} s waiting for {what}")


def running_ids(client: AglClient) -> set[str]:
    return {r.rollout_id for r in client.list_rollouts(["running"])}


def test_runner_runs_rollouts_prints_summaries_and_releases_on_sigterm(embedded_server):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    proc = start_runner(server.url, "--concurrency", "3", "--summary-every", "4")
    try:
        with AglClient(server.url, key=KEY) as client:
            quick = [RolloutCreate(rollout_id=f"q{i}", input={}) for i in range(8)]
            held = [RolloutCreate(rollout_id=f"h{i}", input={"hold": True}) for i in range(3)]
            client.create_rollouts(quick)
            wait_for(
                lambda: all(client.get_rollout(r.rollout_id)[0].is_terminal for r in quick),
                scaled(300),
                "quick rollouts",
            )
            time.sleep(0.5)  # the runner checks for a summary every 0.1 s
            client.create_rollouts(held)
            wait_for(lambda: running_ids(client) == {"h0", "h1", "h2"}, 30, "the runner to hold 3 rollouts")
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=scaled(120))
            assert proc.returncode == 0, out
            for r in quick:
                rollout, attempts = client.get_rollout(r.rollout_id)
                assert rollout.status.state == "succeeded" and attempts == ["0"]
                assert client.get_events(r.rollout_id, event_type="reward")[0]["data"] == {"value": 1.0}
            for r in held:  # released, not failed: back in the queue for another runner
                status = client.get_rollout(r.rollout_id)[0].status
                assert status.state == "queuing" and status.error_message.startswith("attempt 0 released (runner ")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out.strip().splitlines()
    assert lines[0].startswith("agl-lab runner ") and "concurrency 3" in lines[0]
    assert any(line.startswith("agl-lab runner: 8 done (8 succeeded, 0 failed)") for line in lines), out
    assert lines[-1].startswith("agl-lab runner: stopped (SIGTERM): 8 done (8 succeeded, 0 failed)"), out
    assert "released 3" in lines[-1], out


def test_a_wrong_key_fails_at_once_naming_the_flag(embedded_server):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    proc = start_runner(server.url, key="wrong")
    out, _ = proc.communicate(timeout=scaled(300))
    assert proc.returncode == 2 and "rejected the key (401)" in out and "--key" in out


def test_a_key_refused_after_start_up_ends_the_runner_after_bounded_retries(embedded_server):
    """The server comes back with another key (rotated) while the runner polls: a few 401s are
    retried, then one line naming the flags and exit 2 (it used to retry forever)."""
    first = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    port = int(first.url.rsplit(":", 1)[1].split("/")[0])
    proc = start_runner(first.url)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("agl-lab runner ") and "claiming from" in line, line
        first.stop()
        embedded_server(key="rotated-key", default_proxy={"model_name": "m"}, port=port)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "rejected the key (401) 5 times in a row: pass the server's key (--key, --key-file or $AGL_KEY)" in out


def test_bad_arguments_fail_naming_the_flag():
    for argv, message in (
        (["--server", "host:8080"], "must be an http:// or https:// URL"),
        (["--server", "http://127.0.0.1:9", "--agent", "nomodule"], "must be 'module:function'"),
        (["--server", "http://127.0.0.1:9", "--concurrency", "0"], "concurrency"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "agl_lab.cli", "runner", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=scaled(300),
            env={k: v for k, v in os.environ.items() if k != "AGL_SERVER_URL"},
        )
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr)


class CountingHooks(RolloutHooks):
    def __init__(self) -> None:
        self.succeeded: list[str] = []
        self.failed: list[str] = []
        self.attempts_seen: dict[str, list[str]] = {}

    def on_succeeded(self, rollout, events_by_attempt, writer) -> None:
        self.succeeded.append(rollout.rollout_id)
        self.attempts_seen[rollout.rollout_id] = sorted(events_by_attempt)

    def on_failed(self, rollout, writer) -> None:
        self.failed.append(rollout.rollout_id)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_sigkilled_runner_loses_nothing_its_rollouts_rerun_as_attempt_1_and_finish_once(
    embedded_server, tmp_path, store_kind
):
    store = "memory" if store_kind == "memory" else f"sqlite:///{tmp_path}/store.db"
    # the runners beat every tenth of the lease: a 4 s lease (scaled) survives a loaded machine's stalls
    # (the rescuer's claims must not expire: the counts below are exact)
    server = embedded_server(
        key=KEY, default_proxy={"model_name": "m"}, store=store, lease_seconds=scaled(4.0), max_attempts=2
    )
    doomed = start_runner(server.url, "--concurrency", "4")
    rescuer: list[subprocess.Popen] = []
    hooks = CountingHooks()
    try:
        with AglClient(server.url, key=KEY) as client:

            def kill_then_rescue() -> None:  # the doomed runner holds 4 rollouts; kill -9 it; start another
                wait_for(lambda: len(running_ids(client)) == 4, scaled(300), "the doomed runner to hold 4 rollouts")
                doomed.send_signal(signal.SIGKILL)
                doomed.wait()
                rescuer.append(start_runner(server.url, "--concurrency", "8", env={"AGL_TEST_NO_HOLD": "1"}))

            killer = threading.Thread(target=kill_then_rescue)
            killer.start()
            manager = SyncRolloutManager(
                client, n=2, step=0, rollout_config={}, hooks=hooks, timeout_seconds=scaled(300), poll_interval=0.05
            )
            completed = manager.run([{"hold": True, "i": i} for i in range(3)], is_train=True)
            killer.join()
    finally:
        for proc in [doomed, *rescuer]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.communicate(timeout=scaled(120))
    ids = [c.rollout_id for c in completed]
    assert len(ids) == len(set(ids)) == 6 and all(c.state == "succeeded" for c in completed)
    assert sorted(hooks.succeeded) == sorted(ids) and hooks.failed == []  # each hook exactly once
    rerun = [rid for rid, seen in hooks.attempts_seen.items() if seen == ["1"]]
    assert len(rerun) == 4  # the killed runner's 4 ran again as attempt 1; only attempt 1 is read
    assert all(seen == ["0"] for rid, seen in hooks.attempts_seen.items() if rid not in rerun)
    assert sorted(c.rollout_id for c in completed if c.metadata.get("attempt_id") == "1") == sorted(rerun)
    from agl_lab.rollout import report_failures

    assert report_failures(completed, 0, True) == {"training/n_failed_rollouts": 0, "training/n_rerun_rollouts": 4}


AGL_PYTHON = os.environ.get("AGL_PYTHON", "/tmp/agl-venv/bin/python")


@pytest.mark.skipif(
    not os.path.exists(AGL_PYTHON),
    reason=f"no Agent Lightning environment at {AGL_PYTHON} "
    "(set AGL_PYTHON; benchmarks/batch.py's docstring has the recipe)",
)
def test_runner_on_agent_lightnings_own_server_claims_by_list_then_patch(tmp_path):
    """AGL's server has no claim, release or heartbeat route: the Runner falls back to AGL's
    list-then-PATCH claims, attempt "0", and stop() fails what it holds ("runner shutdown")."""
    import socket

    import httpx

    from agl_lab.runner import Runner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agl = subprocess.Popen(
        [
            AGL_PYTHON,
            "-I",
            "-m",
            "agentlightning.server",
            "host=127.0.0.1",
            f"port={port}",
            f"key={KEY}",
            f"hydra.run.dir={tmp_path}",
            "hydra.output_subdir=null",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(httpx, url), scaled(300), "AGL's server")
        with AglClient(url, key=KEY) as client:
            client.create_rollouts(
                [RolloutCreate(rollout_id=f"a{i}", input={}) for i in range(6)]
                + [RolloutCreate(rollout_id="held", input={"hold": True})]
            )
            from tests.agents_for_tests import remote_agent

            runners = [
                Runner(url, key=KEY, agent=remote_agent, concurrency=4, poll_interval=0.01).start() for _ in range(2)
            ]
            wait_for(
                lambda: all(client.get_rollout(f"a{i}")[0].is_terminal for i in range(6)), scaled(300), "the rollouts"
            )
            wait_for(lambda: running_ids(client) == {"held"}, 30, "the held rollout to run")
            for runner in runners:
                runner.stop()
            for i in range(6):
                rollout, attempts = client.get_rollout(f"a{i}")
                assert rollout.status.state == "succeeded" and attempts == ["0"]
                assert client.get_events(f"a{i}", event_type="reward")[0]["data"] == {"value": 1.0}
            held = client.get_rollout("held")[0].status
            assert (held.state, held.error_message) == ("failed", "runner shutdown")
            assert sum(r.stats["claimed"] for r in runners) == 7 and all(not r._claim_route for r in runners)
    finally:
        agl.terminate()
        agl.wait(10)


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_trainers_config_gives_the_runner_its_server_key_agent_and_concurrency(embedded_server, tmp_path):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    (tmp_path / "run.yaml").write_text(
        f"agentlightning:\n  agl_base_url: {server.url}\n  agl_key: {KEY}\n"
        "agl_lab:\n  server:\n    embedded: false\n  runner:\n    concurrency: 3\n"
    )
    argv = [
        sys.executable,
        "-m",
        "agl_lab.cli",
        "runner",
        str(tmp_path / "run.yaml"),
        f"agl_lab.agent={AGENT}",
        "--summary-every",
        "0",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with AglClient(server.url, key=KEY) as client:
            client.create_rollouts([RolloutCreate(rollout_id=f"c{i}", input={}) for i in range(4)])
            wait_for(  # the runner process starts (imports, agent) before it claims: 11 s alone, > 60 s loaded
                lambda: all(client.get_rollout(f"c{i}")[0].is_terminal for i in range(4)), scaled(300), "the rollouts"
            )
            assert all(client.get_rollout(f"c{i}")[0].status.state == "succeeded" for i in range(4))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    first = out.splitlines()[0]
    assert f"claiming from {server.url}" in first and "agent tests.agents_for_tests:remote_agent" in first, out
    assert "concurrency 3" in first and "stopped (SIGINT): 4 done (4 succeeded, 0 failed)" in out


# =========================================================================== a light process

# What a runner host need not load: the server stack (its app, FastAPI, uvicorn, Starlette) and numpy.
# `agl-lab runner` reads flags, imports the agent and talks HTTP (httpx, pydantic), nothing more.
NOT_IN_A_RUNNER = ["agl_lab.server", "fastapi", "uvicorn", "starlette", "numpy", "torch", "pandas", "aiohttp"]
LOADED = r"""
import json, sys
from agl_lab import cli
try:
    cli.main(["runner", *sys.argv[1:]])
except SystemExit:
    pass
print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
"""


def _heavy(out: str) -> list[str]:
    line = next(line for line in reversed(out.splitlines()) if line.startswith("MODULES "))
    loaded = json.loads(line[len("MODULES ") :])
    return sorted(m for m in loaded for bad in NOT_IN_A_RUNNER if m == bad or m.startswith(bad + "."))


def _fresh_env() -> dict[str, str]:  # as a runner host starts it: no VERL_* variables of an engine here
    return {k: v for k, v in os.environ.items() if not k.startswith("VERL_") and k != "AGL_SERVER_URL"}


def test_runner_help_imports_no_server_stack_and_no_numpy():
    done = subprocess.run(
        [sys.executable, "-c", LOADED, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_fresh_env(),
    )
    assert done.returncode == 0 and "usage: agl-lab runner" in done.stdout, done.stdout + done.stderr
    assert _heavy(done.stdout) == []


def test_a_runner_runs_a_rollout_without_the_server_stack_or_numpy(embedded_server):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    argv = [
        sys.executable,
        "-c",
        LOADED,
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
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=_fresh_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        with AglClient(server.url, key=KEY) as client:
            client.create_rollouts([RolloutCreate(rollout_id="light", input={})])
            wait_for(lambda: client.get_rollout("light")[0].is_terminal, 60, "the rollout")
            assert client.get_rollout("light")[0].status.state == "succeeded"
            assert client.get_events("light", event_type="reward")[0]["data"] == {"value": 1.0}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "stopped (SIGTERM): 1 done (1 succeeded, 0 failed)" in out, out
    assert _heavy(out) == []


def test_the_runners_key_follows_serves_rule_and_names_the_runner(tmp_path):
    from agl_lab.runner_cli import build_parser, runner_key

    def key(*argv: str, environ: dict[str, str] | None = None) -> str:
        return runner_key(build_parser().parse_args(["--server", "http://h:1", *argv]), environ or {})

    (tmp_path / "key").write_text("file-key\n")
    assert key(environ={"AGL_KEY": "env-key"}) == "env-key" and key() == ""
    assert key("--key-file", str(tmp_path / "key"), environ={"AGL_KEY": "env-key"}) == "file-key"
    assert key("--key", "flag-key", environ={"AGL_KEY": "env-key"}) == "flag-key"
    with pytest.raises(SystemExit, match="^agl-lab runner: give --key or --key-file, not both$"):
        key("--key", "k", "--key-file", str(tmp_path / "key"))
    (tmp_path / "empty").write_text("")
    with pytest.raises(SystemExit, match="^agl-lab runner: --key-file .*empty is empty$"):
        key("--key-file", str(tmp_path / "empty"))
