"""The runner key: what a runner host needs and nothing more (server/guard.py RUNNER_SCOPE).

A real Runner holding only the runner key runs multi-turn rollouts through the gateway (its
agents' tokens are made from that key), and the same key is refused, with 403 naming its scope,
everything a compromised runner host could do harm with: deleting rollouts or models,
registering models, creating rollouts, pausing the gateway.
"""

from __future__ import annotations

import httpx
import pytest

from agl_lab.runner import Runner
from agl_lab.server.config import load_server_config
from agl_lab.server.embedded import RUNNER_KEY_ENV, _parser, serve_config
from tests.agents_for_tests import multi_turn_agent
from tests.fakes import reply_for
from tests.servers import wait_terminal

ADMIN, RUNNER = "admin-key", "runner-key"
MODEL = "fake/tiny-chat"


@pytest.fixture
def stack(embedded_server, fake_upstream):
    server = embedded_server(key=ADMIN, runner_key=RUNNER, default_proxy={"model_name": MODEL})
    fake_upstream.reply = reply_for
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    runner = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {RUNNER}"}, timeout=30)
    admin.post("/api/models", json=[{"model": MODEL, "endpoint": fake_upstream.base_url}]).raise_for_status()
    server.registered = fake_upstream.base_url
    yield server, admin, runner
    admin.close()
    runner.close()


def test_a_runner_with_the_runner_key_runs_rollouts_through_the_gateway(stack):
    server, admin, _ = stack
    ids = [f"rk-{i}" for i in range(4)]
    rollouts = [{"rollout_id": rid, "input": {"question": f"{i} + {i}?"}} for i, rid in enumerate(ids)]
    admin.post("/api/rollouts", json=rollouts).raise_for_status()
    with Runner(server.url, key=RUNNER, agent=multi_turn_agent, concurrency=4) as runner:
        final = wait_terminal(admin, ids, timeout=60)
    assert {rid: st["state"] for rid, st in final.items()} == dict.fromkeys(ids, "succeeded"), final
    assert runner.stats["succeeded"] == 4
    for rid in ids:  # both proxied calls (agent tokens made from the runner key) and the reward
        kinds = [e["event_type"] for e in admin.get(f"/api/rollouts/{rid}/events").json()]
        assert kinds.count("model_request") == 2 and "reward" in kinds, kinds


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("DELETE", "/api/models", None),
        ("POST", "/api/models", [{"model": MODEL, "endpoint": "http://127.0.0.1:9/v1"}]),
        ("DELETE", "/api/rollouts/victim", None),
        ("POST", "/api/rollouts", [{"rollout_id": "new", "input": {}}]),
        ("POST", "/proxy/pause", {}),
        ("GET", "/api/rollouts/victim/events", None),
    ],
)
def test_the_runner_key_is_refused_outside_its_scope(stack, method, path, body):
    server, admin, runner = stack
    admin.post("/api/rollouts", json=[{"rollout_id": "victim", "input": {}}]).raise_for_status()
    r = runner.request(method, path, json=body)
    assert r.status_code == 403, r.text
    detail = r.json()["detail"]
    assert "runner key" in detail and "claim, heartbeat" in detail and "admin key" in detail
    assert admin.get("/api/rollouts/victim").status_code == 200  # nothing was deleted
    assert [m.endpoint for m in server.store.models_for(MODEL)] == [server.registered]  # not erased or replaced


def test_the_runner_key_may_claim_heartbeat_patch_post_events_and_release(stack):
    _, admin, runner = stack
    admin.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {}}]).raise_for_status()
    (claimed,) = runner.post("/api/rollouts/claim", json={"limit": 1, "runner_id": "rk"}).json()
    attempt = claimed["status"]["last_attempt_id"] or "0"
    assert runner.post("/api/rollouts/heartbeat", json={"rollout_ids": ["r1"]}).status_code == 200
    ev = runner.post(f"/api/rollouts/r1/attempt/{attempt}/events", json={"event_type": "x", "data": {}})
    assert ev.status_code == 200, ev.text
    assert runner.get("/api/rollouts/r1").status_code == 200
    released = runner.post("/api/rollouts/release", json={"attempts": {"r1": attempt}})
    assert released.json()["released"] == ["r1"], released.text
    (again,) = runner.post("/api/rollouts/claim", json={"limit": 1, "runner_id": "rk"}).json()
    assert again["status"]["last_attempt_id"] == "1"
    assert runner.patch("/api/rollouts/r1", json={"state": "succeeded"}).status_code == 200
    assert runner.get("/healthz").status_code == 200
    wrong = httpx.get(admin.base_url.join("/api/rollouts"), headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_serve_takes_the_runner_key_from_env_or_file_and_needs_an_admin_key(tmp_path):
    env = {"AGL_KEY": ADMIN, RUNNER_KEY_ENV: RUNNER}
    assert serve_config(_parser().parse_args([]), env).runner_key == RUNNER
    (tmp_path / "runner.key").write_text("from-file\n")
    args = _parser().parse_args(["--runner-key-file", str(tmp_path / "runner.key")])
    assert serve_config(args, env).runner_key == "from-file"
    with pytest.raises(SystemExit, match="needs the admin key"):
        serve_config(_parser().parse_args([]), {RUNNER_KEY_ENV: RUNNER})
    with pytest.raises(ValueError, match="runner_key must differ from key"):
        load_server_config({"key": ADMIN, "runner_key": ADMIN})
