"""The server's guard (agl_lab.server.guard): auth before the body, size and count limits, store work off the
event loop, keyless serve stays on loopback, no cross-site bodies, per-rollout agent tokens, docs auth."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from agl_lab.protocol import RolloutCreate, rollout_token
from agl_lab.server.embedded import _parser, serve_config

KEY = "guard-key"


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(
        key=KEY, default_proxy={"model_name": "m"}, store=store_url, max_body_bytes=100_000, max_batch_items=5
    )


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as c:
        yield c


def _raw_request(server, head: str) -> bytes:
    """Send only a request head (a body is announced but never sent) and read the answer."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


# -- finding 6: auth before the body, limits, store work off the loop ------------------------------------


def test_key_is_checked_before_the_body_is_read(server):
    answer = _raw_request(
        server,
        "POST /api/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000000000\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 401") and b"Invalid or missing API key" in answer


def test_body_over_the_limit_is_refused_before_it_is_read(server):
    answer = _raw_request(
        server,
        f"POST /api/rollouts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in answer


def test_chunked_body_over_the_limit_is_refused(client):
    def chunks():
        yield b'[{"input": "'
        for _ in range(20):
            yield b"x" * 10_000
        yield b'"}]'

    r = client.post("/api/rollouts", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert client.get("/api/rollouts", params={"state_in": "queuing"}).json() == []


def test_chunked_body_within_the_limit_is_served(client):
    def chunks():
        yield b'[{"input": "small",'
        yield b' "rollout_id": "c1"}]'

    r = client.post("/api/rollouts", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 201 and r.json()[0]["rollout_id"] == "c1"


def test_batch_routes_have_a_count_limit(client):
    r = client.post("/api/rollouts", json=[{"input": i} for i in range(6)])
    assert r.status_code == 413 and "max_batch_items" in r.json()["detail"]
    assert client.post("/api/rollouts", json=[{"input": i} for i in range(5)]).status_code == 201
    r = client.post("/api/models", json=[{"model": "m", "endpoint": f"http://e{i}"} for i in range(6)])
    assert r.status_code == 413


def test_listing_limits_are_capped(client):
    assert client.get("/api/rollouts", params={"state_in": "queuing", "limit": 10**12}).status_code == 200


def test_store_work_does_not_block_the_event_loop(server, client):
    """A store call that cannot finish until /healthz answers: it must run off the event loop."""
    store, working, healthz_answered = server.app.state.store, threading.Event(), threading.Event()
    real = store.create_rollouts

    def waits_for_healthz(creates):
        working.set()
        assert healthz_answered.wait(timeout=20), "/healthz was not served while the store worked"
        return real(creates)

    store.create_rollouts = waits_for_healthz
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(r=client.post("/api/rollouts", json=[{"input": 1}])))
    worker.start()
    assert working.wait(timeout=30), "the POST never reached the store"  # Critical: ask /healthz only during it
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as other:
        assert other.get("/healthz").status_code == 200
    healthz_answered.set()
    worker.join(timeout=30)
    assert result["r"].status_code == 201


# -- finding 11: serve without key, key sources, cross-site bodies ---------------------------------------


def test_serve_without_key_refuses_non_loopback(tmp_path):
    with pytest.raises(SystemExit, match="refusing to bind 0.0.0.0 without a key: set AGL_KEY"):
        serve_config(_parser().parse_args(["--host", "0.0.0.0"]), environ={})
    assert serve_config(_parser().parse_args(["--host", "127.0.0.1"]), environ={}).key == ""
    assert serve_config(_parser().parse_args(["--host", "::1"]), environ={}).key == ""
    assert serve_config(_parser().parse_args(["--host", "0.0.0.0"]), environ={"AGL_KEY": "env-key"}).key == "env-key"
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    args = _parser().parse_args(["--host", "0.0.0.0", "--key-file", str(key_file)])
    assert serve_config(args, environ={"AGL_KEY": "env-key"}).key == "file-key"
    assert serve_config(_parser().parse_args(["--key", "flag-key"]), environ={"AGL_KEY": "x"}).key == "flag-key"
    with pytest.raises(SystemExit, match="is empty"):
        (tmp_path / "empty").write_text("")
        serve_config(_parser().parse_args(["--key-file", str(tmp_path / "empty")]), environ={})


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/proxy/pause"),
        ("DELETE", "/api/models"),
        ("POST", "/api/rollouts"),
        ("PATCH", "/api/rollouts/r1"),
        ("POST", "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"),
    ],
)
def test_cross_site_content_types_are_refused_on_every_route_without_auth(embedded_server, content_type, method, path):
    server = embedded_server(default_proxy={"model_name": "m"})  # auth off
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        r = c.request(method, path, content=b'{"retry_after_seconds": 5}', headers={"content-type": content_type})
        assert r.status_code == 415 and "application/json" in r.json()["detail"], r.text
        assert c.get("/proxy/state").json()["paused"] is False
        assert c.post("/proxy/pause", json={}).status_code == 200  # JSON still works


# -- finding 12: per-rollout tokens; docs auth -----------------------------------------------------------


def test_per_rollout_token_opens_only_its_proxy_route_and_event_posts(server, client, fake_upstream):
    client.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}])
    created = client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "r1"}, {"input": {}, "rollout_id": "r2"}])
    token = rollout_token(KEY, "r1", created.json()[0]["status"]["created_at"])
    with httpx.Client(base_url=server.url, trust_env=False, headers={"Authorization": f"Bearer {token}"}) as agent:
        ok = agent.post(
            "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status_code == 200, ok.text
        assert (
            agent.post(
                "/api/rollouts/r1/attempt/0/events", json={"event_type": "reward", "data": {"value": 1}}
            ).status_code
            == 200
        )
        refused = [
            agent.post("/proxy/rollout/r2/attempt/0/mode/train/openai/v1/chat/completions", json={}),
            agent.post("/api/rollouts/r2/attempt/0/events", json={"event_type": "reward", "data": {}}),
            agent.patch("/api/rollouts/r1", json={"status": {"state": "failed"}}),
            agent.patch("/api/rollouts/r2", json={"status": {"state": "failed"}}),
            agent.delete("/api/models"),
            agent.post("/api/models", json=[{"model": "m", "endpoint": "http://evil"}]),
            agent.post("/proxy/pause", json={}),
            agent.get("/api/rollouts", params={"state_in": "queuing"}),
            agent.get("/api/rollouts/r1/events"),
            agent.delete("/api/rollouts/r1"),
        ]
        assert [r.status_code for r in refused] == [401] * len(refused)
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    r = httpx.post(
        f"{server.url}/api/rollouts/r1/attempt/0/events",
        json={"event_type": "x", "data": {}},
        headers={"x-api-key": forged},
        trust_env=False,
    )
    assert r.status_code == 401
    assert client.get("/proxy/state").json()["paused"] is False


def test_rollout_token_is_empty_without_a_key():
    assert rollout_token("", "r1", 1.0) == ""
    assert rollout_token("k", "r1", 1.0) != rollout_token("k", "r2", 1.0) != rollout_token("j", "r2", 1.0)
    assert rollout_token("k", "r1", 1.0) != rollout_token("k", "r1", 1.5)  # another life of the id


def test_docs_follow_the_api_auth_unless_opened(embedded_server):
    closed = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(closed.url + path, trust_env=False).status_code == 401, path
        assert httpx.get(closed.url + path, headers=closed.headers, trust_env=False).status_code == 200, path
    opened = embedded_server(key=KEY, default_proxy={"model_name": "m"}, docs_auth=False)
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(opened.url + path, trust_env=False).status_code == 200, path
    assert httpx.get(opened.url + "/api/rollouts", params={"state_in": "queuing"}, trust_env=False).status_code == 401


def test_runner_agents_get_the_rollout_token(server, client):
    from agl_lab.client import AglClient
    from agl_lab.runner import Runner

    seen = {}

    def agent(task, ctx):
        seen["key"] = ctx.api_key
        ctx.emit("note", {"ok": True})
        with AglClient(server.url, key=ctx.api_key, max_retries=0) as own:  # the agent's own client
            own.add_event(ctx.rollout_id, "0", "own", {})
            with pytest.raises(Exception, match="401"):
                own.delete_models()  # best effort: swallowed -> check via pause instead
                own.pause()
        return 1.0

    with AglClient(server.url, key=KEY) as admin:
        (rollout,) = admin.create_rollouts([RolloutCreate(input={}, rollout_id="rt1")])
        with Runner(server.url, key=KEY, agent=agent):
            deadline = time.monotonic() + 30
            while not admin.get_rollout("rt1")[0].is_terminal:  # (AglClient.wait_for_terminal was removed)
                assert time.monotonic() < deadline, "the runner never finished rt1"
                time.sleep(0.02)
        assert admin.get_rollout("rt1")[0].status.state == "succeeded", admin.get_rollout("rt1")[0].status
        types = [e["event_type"] for e in admin.get_events("rt1")]
    assert seen["key"] == rollout_token(KEY, "rt1", rollout.status.created_at) and {"note", "own", "reward"} <= set(
        types
    )


# -- OpenAPI: every route lists the errors it answers ------------------------------------------------------


def test_openapi_lists_error_responses(client):
    spec = client.get("/openapi.json").json()
    expected = {
        ("/api/rollouts", "post"): {"400", "422", "413"},
        ("/api/rollouts/{rollout_id}", "patch"): {"404", "409", "422"},
        ("/api/rollouts/{rollout_id}", "get"): {"404"},
        ("/api/rollouts/terminal", "get"): {"422"},
        ("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", "post"): {"404", "422"},
        ("/api/models", "post"): {"413", "422"},
    }
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            codes = set(op["responses"])
            if path == "/healthz":
                continue  # open, no body
            assert {"401", "413", "415", "500"} <= codes, (path, method, codes)
            assert expected.get((path, method), set()) <= codes, (path, method, codes)
    assert spec["paths"]["/api/rollouts/{rollout_id}"]["patch"]["responses"]["409"]["description"].startswith(
        "transition"
    )


def test_each_limit_is_a_serve_flag_and_a_config_key():
    """The limits are listed once (server/config.py LIMITS): `agl-lab serve`'s flag and a training
    config's `agl_lab.server.<key>` both reach the ServerConfig field, and the help names the default."""
    from agl_lab.config import load_config, server_overrides
    from agl_lab.server.config import LIMITS

    assert {"lease_seconds", "max_body_bytes", "upstream_max_attempts", "terminal_log_limit"} <= set(LIMITS)
    changed = {key: field.default + 1 for key, field in LIMITS.items()}  # valid, and not the default
    argv = [arg for key, value in changed.items() for arg in (LIMITS[key].json_schema_extra["flag"], str(value))]
    served = serve_config(_parser().parse_args(argv), environ={})
    assert {key: getattr(served, key) for key in LIMITS} == changed
    cfg = load_config("cpu_tiny", [f"agl_lab.server.{key}={value}" for key, value in changed.items()])
    assert {key: value for key, value in server_overrides(cfg).items() if key in LIMITS} == changed
    help_text = " ".join(_parser().format_help().split())
    assert "larger request bodies answer 413 (default 32 MiB)" in help_text
    assert "tries per call on timeouts, 408/409/429/5xx (default 6)" in help_text
