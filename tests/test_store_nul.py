"""NUL characters (U+0000) and the store (issue 41, findings 2 and 3): one storable rule on every
backend. PostgreSQL's text cannot hold NUL, and one anywhere in a running rollout's JSON made
every lease sweep fail; so a NUL in a rollout's fields, status, an event's type or an id, or a
model name is refused with 422 naming the field (or is simply not found), never a 500; event
data may hold it (stored as JSON bytes on every backend).

Real HTTP on loopback, every store backend (memory, SQLite, PostgreSQL started by the tests).
"""

from __future__ import annotations

import time

import httpx
import pytest

KEY = "k"


@pytest.fixture
def store_url(every_store_url):
    return every_store_url


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server({"key": KEY, "default_proxy": {"model_name": "m"}}, store=store_url, lease_seconds=600)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=60) as c:
        yield c


def _running(client) -> tuple[str, str]:
    client.post("/api/rollouts", json=[{"input": {"q": 1}}]).raise_for_status()
    claimed = client.post("/api/rollouts/claim", json={"limit": 1, "runner_id": "r"}).json()
    return claimed[0]["rollout_id"], claimed[0]["status"]["last_attempt_id"]


def test_a_nul_in_a_running_rollouts_status_is_refused_and_its_lease_still_expires(client, server):
    rid, _ = _running(client)
    r = client.patch(f"/api/rollouts/{rid}", json={"status": {"k8s_job_name": "j\u0000"}})
    assert r.status_code == 422 and "status.k8s_job_name" in r.json()["detail"] and "NUL" in r.json()["detail"], r.text
    # a controlled clock: an hour later, its runner died
    expired = server.store.expire_leases(600, max_attempts=2, now=time.time() + 3600)
    assert rid in expired
    assert client.get(f"/api/rollouts/{rid}").json()["rollout"]["status"]["state"] == "queuing"


def test_a_nul_in_a_new_rollouts_input_is_refused_naming_the_field(client):
    r = client.post("/api/rollouts", json=[{"input": {"q": "a\u0000b"}}])
    assert r.status_code == 422 and "[0].input.q" in r.json()["detail"], r.text


def test_a_nul_in_an_event_type_or_attempt_id_is_never_a_500(client):
    rid, attempt = _running(client)
    r = client.post(f"/api/rollouts/{rid}/attempt/{attempt}/events", json={"event_type": "x\u0000", "data": {}})
    assert r.status_code == 422 and "NUL" in r.json()["detail"], r.text
    r = client.post(f"/api/rollouts/{rid}/attempt/a%00b/events", json={"event_type": "x", "data": {}})
    assert r.status_code == 422 and "NUL" in r.json()["detail"], r.text
    assert client.get(f"/api/rollouts/{rid}/events", params={"attempt_id": "a\u0000b"}).status_code in (200, 404)
    assert client.get("/api/rollouts/a%00b").status_code == 404
    ok = client.post(
        f"/api/rollouts/{rid}/attempt/{attempt}/events", json={"event_type": "x", "data": {"s": "a\u0000"}}
    )
    assert ok.status_code in (200, 201), ok.text  # event data may hold NUL on every backend
    events = client.get(f"/api/rollouts/{rid}/events").json()
    assert [e["data"]["s"] for e in events if e["event_type"] == "x"] == ["a\u0000"]


def test_a_nul_in_a_model_name_is_refused_or_not_found_never_a_500(client):
    r = client.post("/api/models", json=[{"model": "m\u0000", "endpoint": "http://127.0.0.1:9/v1", "version": 1}])
    assert r.status_code == 422 and "NUL" in r.json()["detail"], r.text
    rid, attempt = _running(client)
    r = client.post(
        f"/proxy/rollout/{rid}/attempt/{attempt}/mode/train/openai/v1/chat/completions",
        json={"model": "m\u0000", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code < 500 or r.status_code == 503, r.text  # 503: no endpoint for that name, as on memory
