"""Who gets in: keyless servers answer only loopback Host names (DNS rebinding), a rollout
token opens its rollout's live attempt only — real servers on loopback — and a key no client
could present (non-ASCII, surrounding spaces, two lines) stops `agl-lab serve`/`runner` at start
in one line, while a key file others may read is warned about (real CLI processes)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from agl_lab.keys import key_problem, readable_by_others
from agl_lab.protocol import rollout_token
from tests.processes import ROOT, cli_env, free_port

KEY = "access-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _attempts(c: httpx.Client, headers: dict[str, str]) -> list[int]:
    """A rebound page's moves: list rollouts, pause the gateway, register its endpoint, call the proxy."""
    return [
        c.get("/api/rollouts", params={"state_in": "queuing"}, headers=headers).status_code,
        c.post("/proxy/pause", json={}, headers=headers).status_code,
        c.post("/api/models", json=[{"model": "m", "endpoint": "http://evil.example/v1"}], headers=headers).status_code,
        c.post(
            "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions", json=CHAT, headers=headers
        ).status_code,
    ]


def test_a_keyless_server_refuses_foreign_host_names(embedded_server, fake_upstream):
    server = embedded_server(default_proxy={"model_name": "m"})
    port = server.config.port
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        c.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).raise_for_status()
        c.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}]).raise_for_status()
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", "10.0.0.1"):
            assert _attempts(c, {"Host": host}) == [403] * 4, host
        refused = c.get("/api/rollouts", params={"state_in": "queuing"}, headers={"Host": "evil.example"})
        assert "allowed_hosts" in refused.json()["detail"]
        assert c.get("/proxy/state").json()["paused"] is False  # nothing it tried took effect
        assert [m.endpoint for m in server.store.models_for("m")] == [fake_upstream.base_url]
        assert c.get("/healthz", headers={"Host": "evil.example"}).status_code == 200  # liveness stays open
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST."):
            assert c.get("/api/rollouts", params={"state_in": "queuing"}, headers={"Host": host}).status_code == 200


def test_allowed_hosts_is_configurable_and_a_key_makes_it_moot(embedded_server):
    listed = embedded_server(default_proxy={"model_name": "m"}, allowed_hosts=["lab.internal"])
    anyone = embedded_server(default_proxy={"model_name": "m"}, allowed_hosts=["*"])
    keyed = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    listing = ("/api/rollouts", {"state_in": "queuing"})

    def status(server, host, headers=None):
        return httpx.get(
            server.url + listing[0], params=listing[1], headers={"Host": host, **(headers or {})}, trust_env=False
        ).status_code

    assert (status(listed, "lab.internal:1"), status(listed, "evil.example")) == (200, 403)
    assert status(anyone, "evil.example") == 200
    assert (status(keyed, "evil.example"), status(keyed, "evil.example", keyed.headers)) == (401, 200)


def test_serve_flag_adds_allowed_hosts():
    from agl_lab.server.embedded import _parser, serve_config

    config = serve_config(_parser().parse_args(["--allowed-host", "lab.internal"]), environ={})
    assert config.allowed_hosts == ["localhost", "127.0.0.1", "::1", "lab.internal"]


@pytest.fixture
def keyed(embedded_server, fake_upstream, store_url):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url)
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as admin:
        admin.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).raise_for_status()
        yield server, admin


def _token_of(admin: httpx.Client, rid: str) -> str:
    created_at = admin.get(f"/api/rollouts/{rid}").json()["rollout"]["status"]["created_at"]
    return rollout_token(KEY, rid, created_at)


def _agent_moves(url: str, token: str, rid: str, attempt: str = "0") -> list[int]:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, trust_env=False) as agent:
        return [
            agent.post(
                f"/api/rollouts/{rid}/attempt/{attempt}/events", json={"event_type": "reward", "data": {"value": 99.0}}
            ).status_code,
            agent.post(
                f"/proxy/rollout/{rid}/attempt/{attempt}/mode/train/openai/v1/chat/completions", json=CHAT
            ).status_code,
        ]


def test_a_rollout_token_dies_with_its_rollouts_live_attempt(keyed):
    server, admin = keyed
    admin.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}]).raise_for_status()
    token = _token_of(admin, "r1")
    admin.patch("/api/rollouts/r1", json={"status": {"state": "running", "last_attempt_id": "0"}}).raise_for_status()
    assert _agent_moves(server.url, token, "r1") == [200, 200]  # live: its events and calls
    assert _agent_moves(server.url, token, "r1", attempt="1") == [401, 401]  # not its live attempt
    admin.post("/api/rollouts/r1/attempt/0/events", json={"event_type": "reward", "data": {"value": 1.0}})
    admin.patch("/api/rollouts/r1", json={"status": {"state": "succeeded"}}).raise_for_status()
    assert _agent_moves(server.url, token, "r1") == [401, 401]  # succeeded: no late reward
    rewards = admin.get("/api/rollouts/r1/events", params={"event_type": "reward"}).json()
    assert rewards[-1]["data"] == {"value": 1.0}

    admin.delete("/api/rollouts/r1")
    admin.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}]).raise_for_status()  # same id, new life
    assert _agent_moves(server.url, token, "r1") == [401, 401]
    assert admin.get("/api/rollouts/r1/events").json() == []
    assert _agent_moves(server.url, _token_of(admin, "r1"), "r1") == [200, 200]  # its own token works


# ---------------------------------------------------------------------------------------------
# keys at start-up: `agl-lab serve` and `agl-lab runner` in subprocesses
# ---------------------------------------------------------------------------------------------


def _cli_runs(cases: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, tuple[int, str]]:
    """name -> (exit status, output) of `agl-lab *argv` with its environment, all started at once."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "agl_lab.cli", *argv],
            cwd=ROOT,
            env=cli_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, (argv, env) in cases.items()
    }
    out = {}
    for name, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0] + "\n(still running after 120 s)"
        out[name] = proc.returncode, text
    return out


def _key_file(folder, name: str, text: str, mode: int = 0o600):
    path = folder / name
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


def test_which_keys_a_header_can_carry(tmp_path):
    presentable = ["k", "tls-key", "a b", "Zx9_-.~!#$%&'*+/=?^`|", "token_urlsafe-AbC123"]
    assert [key_problem(k) for k in presentable] == [None] * len(presentable)  # inner spaces travel
    assert "non-ASCII character at character 1" in key_problem("ключ-1")
    assert "non-ASCII character at character 3" in key_problem("clé")  # latin-1 is not ASCII either
    assert "control character at character 2" in key_problem("a\x00b")
    assert "line break at character 6" in key_problem("first\nsecond")
    for spaced in (" k", "k ", "\tk", "k\n"):
        assert "whitespace" in key_problem(spaced), repr(spaced)
    private = _key_file(tmp_path, "private.key", "k")
    assert readable_by_others(str(private)) is None
    for mode in (0o640, 0o604, 0o660):  # group or other access, read or write
        private.chmod(mode)
        assert readable_by_others(str(private)) == f"{mode:04o}"
    assert readable_by_others(str(tmp_path / "missing")) is None


def test_a_key_no_client_could_present_stops_start_up_in_one_line(tmp_path):
    two_lines = _key_file(tmp_path, "two.key", "first-half\nsecond-half\n")
    non_ascii = _key_file(tmp_path, "runner.key", "ключ-runner\n")
    latin1 = tmp_path / "latin1.key"
    latin1.write_bytes("clé\n".encode("latin-1"))
    latin1.chmod(0o600)
    serve = ["serve", "--port", str(free_port())]
    # an unreachable server: a runner that passed the key check would wait for it, not exit
    runner = ["runner", "--server", f"http://127.0.0.1:{free_port()}", "--agent", "tests.agents_for_tests:remote_agent"]
    cases = {
        "AGL_KEY": (serve, {"AGL_KEY": "ключ-1"}),
        "AGL_KEY ": (serve, {"AGL_KEY": " spaced-key "}),
        f"--key-file {two_lines}": ([*serve, "--key-file", str(two_lines)], {"AGL_KEY": ""}),
        f"--runner-key-file {non_ascii}": ([*serve, "--runner-key-file", str(non_ascii)], {"AGL_KEY": "admin-key"}),
        "runner: AGL_KEY": (runner, {"AGL_KEY": "ключ-1"}),
        f"runner: --key-file {two_lines}": ([*runner, "--key-file", str(two_lines)], {"AGL_KEY": ""}),
        "runner: agentlightning.agl_key": ([*runner, "agentlightning.agl_key=ключ-1"], {"AGL_KEY": ""}),
    }
    runs = _cli_runs(
        {
            **cases,
            "--key-file latin1": ([*serve, "--key-file", str(latin1)], {}),
            "--runner-key-file latin1": ([*serve, "--runner-key-file", str(latin1)], {"AGL_KEY": "admin-key"}),
        }
    )
    for flag in ("--key-file", "--runner-key-file"):  # bytes that are not UTF-8: one line too
        status, out = runs.pop(f"{flag} latin1")
        assert (
            status == 2
            and out.strip() == f"agl-lab serve: {flag} {latin1} is not UTF-8 text: write the key (ASCII) into it"
        ), out
    for name, (status, out) in runs.items():
        source = name.removeprefix("runner: ").strip()
        assert status == 2, (name, out)
        assert len(out.strip().splitlines()) == 1 and f"the key from {source} " in out, (name, out)
        assert "ключ" not in out and "spaced-key" not in out and "half" not in out  # the key is never echoed
    assert "non-ASCII" in runs["AGL_KEY"][1] and "remove it" in runs["AGL_KEY "][1]  # each names its fix
    assert "keep the key on one line" in runs[f"--key-file {two_lines}"][1]


def test_a_key_file_others_may_read_is_warned_about(tmp_path):
    shared = _key_file(tmp_path, "shared.key", "admin-key\n", mode=0o644)
    runner_key = _key_file(tmp_path, "runner.key", "runner-key\n", mode=0o666)
    private = _key_file(tmp_path, "private.key", "admin-key\n")
    # a store that does not open ends the server after its key checks: exit 2, no port held
    bad_store = ["serve", "--port", str(free_port()), "--store", "nosuch://x"]
    runs = _cli_runs(
        {
            "shared": ([*bad_store, "--key-file", str(shared), "--runner-key-file", str(runner_key)], {}),
            "private": ([*bad_store, "--key-file", str(private)], {}),
        }
    )
    status, out = runs["shared"]
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert status == 2 and len(warnings) == 2, out
    assert f"--key-file {shared} has group or other access (mode 0644)" in warnings[0]
    assert f"chmod 600 {shared}" in warnings[0] and f"(mode 0666); it holds a secret: chmod 600 {runner_key}" in out
    status, out = runs["private"]
    assert status == 2 and "warning" not in out and "--store" in out, out
