"""The HTTP API over real loopback HTTP, on both store backends (parity with AGL v1's tests/server/test_endpoints.py and tests/test_package.py)."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from agl_lab.server.app import NO_KEY_WARNING, create_app
from agl_lab.server.config import ServerConfig, load_server_config
from agl_lab.server.embedded import EmbeddedServer, serve_main

KEY = "test-secret-key"
TEST_CONFIG = {
    "key": KEY,
    "default_proxy": {"model_name": "test-model", "train": {"temperature": 1}, "val": {"temperature": 0}},
}


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(TEST_CONFIG, store=store_url)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as c:
        yield c


def new_rollout(client, **body):
    body.setdefault("input", {"question": "1+1"})
    r = client.post("/api/rollouts", json=[body])
    assert r.status_code == 201, r.text
    return r.json()[0]


def patch(client, rid, **status):
    return client.patch(f"/api/rollouts/{rid}", json={"status": status})


# ---------------------------------------------------------------------------------------------
# Health, auth, metadata, config
# ---------------------------------------------------------------------------------------------


def test_healthz_is_open(server):
    assert httpx.get(server.url + "/healthz", trust_env=False).json() == {"status": "ok"}


def test_auth_accepts_bearer_or_x_api_key(server):
    url = server.url + "/api/rollouts"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        r = httpx.post(url, json=[], headers=headers, trust_env=False)
        assert (r.status_code, r.json()) == (401, {"detail": "Invalid or missing API key"}), headers
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.post(url, json=[], headers=headers, trust_env=False).status_code == 201
    for method, path in [("GET", "/proxy/state"), ("DELETE", "/api/models"), ("GET", "/api/rollouts/x")]:
        assert httpx.request(method, server.url + path, trust_env=False).status_code == 401


def test_empty_key_disables_auth_and_warns(embedded_server, caplog):
    with caplog.at_level(logging.WARNING, logger="agl_lab.server"):
        server = embedded_server(key="")
    assert NO_KEY_WARNING in caplog.text
    info = httpx.get(server.url + "/openapi.json", trust_env=False).json()["info"]
    assert info == {"title": "Agent Lightning", "version": "1.0.0"}
    assert httpx.post(server.url + "/api/rollouts", json=[], trust_env=False).status_code == 201


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="^server config is required$"):
        create_app(None)
    with pytest.raises(ValueError, match=r"default_proxy\.model_nam: Extra inputs are not permitted"):
        load_server_config({"default_proxy": {"model_nam": "x"}})
    with pytest.raises(ValueError, match="upstream_max_attempts"):
        load_server_config({"upstream_max_attempts": 0})
    omegaconf = pytest.importorskip("omegaconf")
    cfg = load_server_config(omegaconf.OmegaConf.create({"port": 8181, "default_proxy": {"val": {"temperature": 0}}}))
    assert (cfg.host, cfg.port, cfg.default_proxy.val.temperature, cfg.default_proxy.train.temperature) == (
        "127.0.0.1",
        8181,
        0.0,
        1.0,
    )
    assert cfg.default_proxy.include_log_probs is True and cfg.upstream_max_attempts == 6
    assert ServerConfig().store == "memory" and ServerConfig().token_preserving is False


def test_agl_lab_serve_runs_in_the_foreground(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "agl_lab.cli",
        "serve",
        "--port",
        str(port),
        "--key",
        "k",
        "--model-name",
        "m",
        "--store",
        f"sqlite:///{tmp_path}/f.db",
        "--val-temperature",
        "0",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/healthz", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.1)
        r = httpx.post(url + "/api/rollouts", json=[{"input": 1}], headers={"x-api-key": "k"}, trust_env=False)
        assert r.status_code == 201
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    assert (tmp_path / "f.db").exists()


def test_serve_main_rejects_bad_store_url():
    with pytest.raises(SystemExit, match=r"^agl-lab serve: --store: unknown store url 'mysql://x': use 'memory'"):
        serve_main(["--port", "0", "--store", "mysql://x"])


# ---------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------


def test_rollout_endpoints(client):
    created = new_rollout(client, input={"question": "1+1"}, metadata={"batch_idx": 1})
    assert created["input"] == {"question": "1+1"} and created["metadata"]["batch_idx"] == 1
    assert created["status"]["state"] == "queuing" and created["config"]["timeout_seconds"] == 3600
    rid = created["rollout_id"]
    detail = client.get(f"/api/rollouts/{rid}")
    assert detail.status_code == 200 and detail.json()["attempts"] == []
    r = patch(client, rid, state="running", k8s_job_name="job-1")
    assert r.status_code == 200
    status = r.json()["status"]
    assert (status["state"], status["k8s_job_name"], status["version"]) == ("running", "job-1", 2)
    assert status["updated_at"] >= created["status"]["updated_at"]
    r = patch(client, rid, state="queuing")
    assert (r.status_code, r.json()) == (409, {"detail": f"Rollout {rid}: cannot transition running -> queuing"})
    assert patch(client, rid, state="cancelled").status_code == 422
    assert patch(client, rid, cancel_requested=True).status_code == 422
    assert patch(client, rid, state=None).status_code == 409
    # no field set (or only unknown top-level keys): unchanged, no version bump
    r = client.patch(f"/api/rollouts/{rid}", json={"status": {}, "other": 1})
    assert r.status_code == 200 and r.json()["status"]["version"] == 2
    assert patch(client, "missing", state="running").json() == {"detail": "Rollout not found: missing"}
    assert client.get("/api/rollouts/missing").status_code == 404


def test_bad_bodies_are_400_or_422(client):
    bad_json = {"content": b"[{bad", "headers": {"content-type": "application/json"}}
    r = client.post("/api/rollouts", **bad_json)
    assert (r.status_code, r.json()) == (400, {"detail": "Invalid JSON in request body"})
    rid = new_rollout(client)["rollout_id"]
    assert client.patch(f"/api/rollouts/{rid}", **bad_json).status_code == 400
    assert client.post(f"/api/rollouts/{rid}/attempt/0/events", **bad_json).status_code == 400
    assert client.post("/api/rollouts", json={"input": 1}).status_code == 422  # not a list
    assert client.post("/api/rollouts", json=[{"is_train": True}]).status_code == 422  # input missing
    assert client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"data": {}}).status_code == 422
    assert client.post("/api/models", json=[{"model": "m"}]).status_code == 422


def test_list_rollouts_filters_by_state_in(client):
    a = new_rollout(client)["rollout_id"]
    b = new_rollout(client)["rollout_id"]
    patch(client, b, state="running")
    both = client.get("/api/rollouts", params=[("state_in", "queuing"), ("state_in", "running")]).json()
    assert [r["rollout_id"] for r in both] == [a, b]  # creation order
    running = client.get("/api/rollouts", params={"state_in": "running"}).json()
    assert [r["rollout_id"] for r in running] == [b]
    limited = client.get("/api/rollouts", params=[("state_in", "queuing"), ("state_in", "running"), ("limit", 1)])
    assert [r["rollout_id"] for r in limited.json()] == [a]
    assert client.get("/api/rollouts").status_code == 422
    assert client.get("/api/rollouts", params={"state_in": "cancelled"}).status_code == 422


def test_enqueue_with_client_rollout_id_is_idempotent(client):
    first = new_rollout(client, rollout_id="fixed-rollout-id-123", input={"v": 1})
    assert first["rollout_id"] == "fixed-rollout-id-123"
    client.post("/api/rollouts/fixed-rollout-id-123/attempt/0/events", json={"event_type": "custom"})
    again = new_rollout(client, rollout_id="fixed-rollout-id-123", input={"v": 2})
    assert again["rollout_id"] == "fixed-rollout-id-123" and again["input"] == {"v": 1}
    assert client.get("/api/rollouts/fixed-rollout-id-123").json()["attempts"] == ["0"]
    assert len(client.get("/api/rollouts/fixed-rollout-id-123/events").json()) == 1


def test_re_enqueue_does_not_clobber_a_running_rollout(client):
    new_rollout(client, rollout_id="r-run")
    patch(client, "r-run", state="running")
    client.post("/api/rollouts/r-run/attempt/0/events", json={"event_type": "custom", "data": {"a": 1}})
    again = new_rollout(client, rollout_id="r-run")
    assert again["status"]["state"] == "running" and again["status"]["version"] == 2
    detail = client.get("/api/rollouts/r-run").json()
    assert detail["rollout"]["status"]["state"] == "running" and detail["attempts"] == ["0"]


def test_delete_rollout(client):
    rid = new_rollout(client)["rollout_id"]
    client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 1}})
    r = client.delete(f"/api/rollouts/{rid}")
    assert r.status_code == 204 and r.content == b""
    assert client.get(f"/api/rollouts/{rid}").status_code == 404
    assert client.get(f"/api/rollouts/{rid}/events").status_code == 404
    assert client.delete(f"/api/rollouts/{rid}").status_code == 204


def test_terminal_rollouts_cursor_pagination(client):
    new_rollout(client, rollout_id="pending", input={"data_id": "p"})
    for rid, is_train in [("a", True), ("b", False), ("c", True)]:
        new_rollout(client, rollout_id=rid, input={"data_id": rid}, is_train=is_train)
        patch(client, rid, state="running")
        patch(client, rid, state="succeeded")
    page = client.get("/api/rollouts/terminal", params={"after": 0, "limit": 2}).json()
    assert (page["total_terminal"], page["next_after"]) == (3, 2)
    assert page["items"][0] == {"rollout_id": "a", "state": "succeeded", "data_id": "a", "is_train": True}
    assert [it["rollout_id"] for it in page["items"]] == ["a", "b"] and page["items"][1]["is_train"] is False
    page = client.get("/api/rollouts/terminal", params={"after": 2, "limit": 2}).json()
    assert [it["rollout_id"] for it in page["items"]] == ["c"] and page["next_after"] == 3
    assert client.get("/api/rollouts/terminal", params={"after": 3}).json() == {
        "items": [],
        "next_after": 3,
        "total_terminal": 3,
    }
    client.delete("/api/rollouts/b")  # deleted ids are skipped but consumed
    page = client.get("/api/rollouts/terminal", params={"after": -1, "limit": 5}).json()
    assert [it["rollout_id"] for it in page["items"]] == ["a", "c"] and page["next_after"] == 3


def test_terminal_log_is_bounded(embedded_server, store_url):
    server = embedded_server(store=store_url, terminal_log_limit=2)
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        for i in range(4):
            new_rollout(c, rollout_id=f"r{i}", input={"instance_id": f"i{i}"})
            patch(c, f"r{i}", state="failed", error_message="boom")
        page = c.get("/api/rollouts/terminal", params={"after": 0}).json()
    assert [(it["rollout_id"], it["state"], it["data_id"]) for it in page["items"]] == [
        ("r2", "failed", "i2"),
        ("r3", "failed", "i3"),
    ]
    assert (page["next_after"], page["total_terminal"]) == (4, 4)


def test_sqlite_server_restart_serves_the_same_ledger(embedded_server, tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.db"
    first = embedded_server(store=url)
    with httpx.Client(base_url=first.url, trust_env=False) as c:
        new_rollout(c, rollout_id="done", input={"data_id": "d"})
        patch(c, "done", state="running")
        c.post("/api/rollouts/done/attempt/0/events", json={"event_type": "reward", "data": {"value": 0.25}})
        patch(c, "done", state="succeeded")
        new_rollout(c, rollout_id="waiting")
        before = [
            c.get(p).json()
            for p in (
                "/api/rollouts/done",
                "/api/rollouts/done/events",
                "/api/rollouts/terminal",
                "/api/rollouts?state_in=queuing",
            )
        ]
    first.stop()
    first.stop()  # idempotent
    second = embedded_server(store=url)
    with httpx.Client(base_url=second.url, trust_env=False) as c:
        after = [
            c.get(p).json()
            for p in (
                "/api/rollouts/done",
                "/api/rollouts/done/events",
                "/api/rollouts/terminal",
                "/api/rollouts?state_in=queuing",
            )
        ]
    assert after == before and after[2]["items"][0]["rollout_id"] == "done"


# ---------------------------------------------------------------------------------------------
# Events and models
# ---------------------------------------------------------------------------------------------


def test_event_endpoints(client):
    rid = new_rollout(client)["rollout_id"]
    r = client.post(
        f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 0.7, "extra": "drop"}}
    )
    assert r.status_code == 200 and r.json()["event_type"] == "reward" and r.json()["attempt_id"] == "0"
    got = client.get(f"/api/rollouts/{rid}/events", params={"event_type": "reward", "format": "triplet"}).json()
    assert [e["data"] for e in got] == [{"value": 0.7}]
    assert client.get(f"/api/rollouts/{rid}/events").json()[0]["data"] == {"value": 0.7, "extra": "drop"}
    assert client.get(f"/api/rollouts/{rid}").json()["attempts"] == ["0"]
    r = client.post("/api/rollouts/nope/attempt/0/events", json={"event_type": "reward"})
    assert (r.status_code, r.json()) == (404, {"detail": "Rollout not found: nope"})
    # another attempt's events are read once last_attempt_id points to it
    client.post(f"/api/rollouts/{rid}/attempt/retry-1/events", json={"event_type": "custom", "data": {"k": 1}})
    patch(client, rid, state="running", last_attempt_id="retry-1")
    assert [e["data"] for e in client.get(f"/api/rollouts/{rid}/events").json()] == [{"k": 1}]
    assert client.get(f"/api/rollouts/{rid}").json()["attempts"] == ["0", "retry-1"]


def test_triplet_events_keep_last_model_request_for_duplicate_prompt(client):
    rid = new_rollout(client)["rollout_id"]

    def model_request(prompt, response):
        data = {
            "response": {"prompt_token_ids": prompt, "choices": [{"token_ids": response}]},
            "server": {"model": "test-model", "endpoint": "http://x/v1", "version": 3},
        }
        client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "model_request", "data": data})

    model_request([1, 2], [10])
    client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "reward", "data": {"value": 0.5}})
    model_request([3, 4], [20])
    model_request([1, 2], [30])
    raw = client.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    assert [e["data"]["response"]["choices"][0]["token_ids"] for e in raw] == [[10], [20], [30]]
    trip = client.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    assert [e["event_type"] for e in trip] == ["reward", "model_request", "model_request"]
    assert trip[0]["data"] == {"value": 0.5}
    assert [e["data"]["prompt_token_ids"] for e in trip[1:]] == [[3, 4], [1, 2]]
    assert [e["data"]["response_token_ids"] for e in trip[1:]] == [[20], [30]]
    assert trip[1]["data"]["server"] == {"model": "test-model", "version": 3}


def test_model_endpoints(client):
    models = [
        {"model": "test-model", "endpoint": "http://a/v1", "version": 0},
        {"model": "test-model", "endpoint": "http://b/v1", "version": 2},
    ]
    r = client.post("/api/models", json=models)
    assert (r.status_code, r.json()) == (201, models)
    r = client.delete("/api/models")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_embedded_server_overrides_and_errors(embedded_server):
    server = embedded_server(TEST_CONFIG, default_proxy={"model_name": "other"})
    assert server.config.default_proxy.model_name == "other"
    assert server.config.default_proxy.val.temperature == 0.0  # merged key by key
    assert server.config.port == int(server.url.rsplit(":", 1)[1]) and server.config.host == "127.0.0.1"
    with pytest.raises(ValueError, match="no_such_key"):
        EmbeddedServer(no_such_key=1)
