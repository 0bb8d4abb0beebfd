"""AglClient against a real agl server on loopback (and a flaky fake one).

Covered: every route the learning side calls, retry policy (5xx/429/transport retried,
401/404/409/422 not), the 401 message naming the config key, cursor waiting with one request
per poll, and the timeout error that names unfinished rollouts and their states.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agl_lab.client import (
    AUTH_FIX,
    AglAuthError,
    AglClient,
    AglConnectionError,
    AglHTTPError,
)
from agl_lab.protocol import Model, RolloutCreate, RolloutState, new_rollout_id
from agl_lab.server.embedded import EmbeddedServer, ThreadedUvicorn

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(key=KEY, default_proxy={"model_name": "test-model"}) as srv:
        yield srv


class RequestLog:
    """httpx event hook recording (method, path) of every request the client sends."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> None:
        self.calls.append((request.method, request.url.path))

    def paths(self) -> list[str]:
        return [p for _, p in self.calls]


@pytest.fixture
def log() -> RequestLog:
    return RequestLog()


@pytest.fixture
def client(server, log):
    with AglClient(server.url, key=KEY, backoff_base=0.001, event_hooks={"request": [log]}) as c:
        yield c


def _create(client: AglClient, n: int, **input_extra) -> list[str]:
    ids = [new_rollout_id() for _ in range(n)]
    client.create_rollouts([RolloutCreate(input={"i": i, **input_extra}, rollout_id=rid) for i, rid in enumerate(ids)])
    return ids


# =============================================================================================
# Routes
# =============================================================================================


def test_healthz_and_idempotent_create(client):
    assert client.healthz() == {"status": "ok"}
    rid = new_rollout_id()
    first = client.create_rollouts([RolloutCreate(input={"q": "a"}, rollout_id=rid)])
    client.patch_status(rid, state="running", last_attempt_id="0")
    # A retried batch POST (same id, different input) returns the existing rollout untouched.
    again = client.create_rollouts([RolloutCreate(input={"q": "changed"}, rollout_id=rid)])
    assert first[0].rollout_id == again[0].rollout_id == rid
    assert again[0].input == {"q": "a"} and again[0].status.state == RolloutState.RUNNING


def test_rollout_status_events_and_delete(client):
    (rid,) = _create(client, 1)
    rollout, attempts = client.get_rollout(rid)
    assert rollout.status.state == RolloutState.QUEUING and attempts == []
    client.patch_status(rid, state=RolloutState.RUNNING, last_attempt_id="0")
    client.add_event(rid, "0", "note", {"x": 1})
    event = client.add_event(rid, "0", "reward", {"value": 0.5, "message": "dropped in triplets"})
    assert event.rollout_id == rid and event.data["value"] == 0.5
    done = client.patch_status(rid, state="succeeded")
    assert done.status.state == RolloutState.SUCCEEDED and done.status.version == 3
    assert client.get_rollout(rid)[1] == ["0"]
    assert [e["event_type"] for e in client.get_events(rid)] == ["note", "reward"]
    assert client.get_events(rid, event_type="reward")[0]["data"]["message"] == "dropped in triplets"
    assert client.get_events(rid, event_type="reward", fmt="triplet")[0]["data"] == {"value": 0.5}
    assert rid in {r.rollout_id for r in client.list_rollouts(["succeeded"], limit=10_000)}
    assert client.delete_rollout(rid) is True
    with pytest.raises(AglHTTPError) as err:
        client.get_rollout(rid)
    assert err.value.status_code == 404 and rid in err.value.detail


def test_models_pause_resume(client):
    models = client.register_models([Model(model="test-model", endpoint="http://127.0.0.1:1/v1", version=3)])
    assert models[0].version == 3
    assert client.delete_models() is True
    paused = client.pause(reason="update", retry_after_seconds=7)
    assert paused.paused and paused.reason == "update" and paused.retry_after_seconds == 7
    assert client.proxy_state().paused and client.proxy_state().inflight == 0
    assert client.resume().paused is False and client.proxy_state().paused is False


def test_terminal_page_cursor(client):
    start = client.terminal_page(after=0, limit=1).total_terminal
    ids = _create(client, 3)
    for rid in ids:
        client.patch_status(rid, state="failed", error_message="boom")
    page = client.terminal_page(after=start)
    assert [i.rollout_id for i in page.items] == ids and page.next_after == start + 3
    assert client.terminal_page(after=page.next_after).items == []


# =============================================================================================
# Errors that must not be retried
# =============================================================================================


def test_wrong_key_fails_at_once_with_the_fix(server):
    log = RequestLog()
    with AglClient(server.url, key="wrong", backoff_base=0.001, event_hooks={"request": [log]}) as c:
        with pytest.raises(AglAuthError) as err:
            c.create_rollouts([RolloutCreate(input={}, rollout_id=new_rollout_id())])
    assert str(err.value).startswith(AUTH_FIX)
    assert "Invalid or missing API key" in str(err.value)
    assert len(log.calls) == 1  # AGL v1 retried a 401 for ~3.5 minutes


def test_no_key_is_rejected_too(server):
    with AglClient(server.url, backoff_base=0.001) as c:
        assert c.healthz() == {"status": "ok"}  # /healthz is open
        with pytest.raises(AglAuthError):
            c.list_rollouts(["queuing"])


@pytest.mark.parametrize("kind", ["404", "409", "422"])
def test_client_errors_are_not_retried_and_carry_detail(client, log, kind):
    (rid,) = _create(client, 1)
    log.calls.clear()
    with pytest.raises(AglHTTPError) as err:
        if kind == "404":
            client.get_events("no-such-rollout")
        elif kind == "409":
            client.patch_status(rid, state="succeeded")  # queuing -> succeeded is invalid
        else:
            client.list_rollouts(["not-a-state"])
    assert err.value.status_code == int(kind) and len(log.calls) == 1
    if kind == "404":
        assert "Rollout not found: no-such-rollout" in str(err.value)
    if kind == "409":
        assert f"Rollout {rid}: cannot transition queuing -> succeeded" in str(err.value)


def test_unknown_status_field_is_rejected_before_sending(client, log):
    with pytest.raises(ValueError, match="statee"):
        client.patch_status("x", statee="running")
    assert log.calls == []


# =============================================================================================
# Retries: a fake server that fails N times, a transport that drops N connections
# =============================================================================================


def _flaky_app(fail_with: int, n_failures: int) -> tuple[FastAPI, list[int]]:
    app, seen = FastAPI(), []

    @app.post("/api/rollouts")
    async def create(request: Request):
        body = await request.json()
        seen.append(len(body))
        if len(seen) <= n_failures:
            headers = {"Retry-After": "0"} if fail_with == 429 else {}
            return JSONResponse({"detail": f"flaky {fail_with}"}, status_code=fail_with, headers=headers)
        now = time.time()
        return JSONResponse(
            [
                {"rollout_id": r["rollout_id"], "input": r["input"], "status": {"created_at": now, "updated_at": now}}
                for r in body
            ],
            status_code=201,
        )

    return app, seen


@pytest.mark.parametrize("status", [500, 503, 429])
def test_post_with_retry_retries_5xx_and_429(status):
    app, seen = _flaky_app(status, n_failures=3)
    fake = ThreadedUvicorn(app)
    try:
        with AglClient(fake.url, max_retries=5, backoff_base=0.001) as c:
            rollouts = c.create_rollouts([RolloutCreate(input={"a": 1}, rollout_id="r1")])
        assert [r.rollout_id for r in rollouts] == ["r1"] and len(seen) == 4
        with AglClient(fake.url, max_retries=2, backoff_base=0.001) as c:
            seen.clear()
            with pytest.raises(AglHTTPError) as err:
                c.create_rollouts([RolloutCreate(input={}, rollout_id="r2")])
        assert err.value.status_code == status and err.value.attempts == 3
        assert f"flaky {status}" in str(err.value) and "after 3 attempts" in str(err.value)
    finally:
        fake.stop()


def test_create_without_ids_is_not_retried():
    app, seen = _flaky_app(503, n_failures=1)
    fake = ThreadedUvicorn(app)
    try:
        with AglClient(fake.url, backoff_base=0.001) as c, pytest.raises(AglHTTPError):
            c.create_rollouts([RolloutCreate(input={})])  # no rollout_id: a retry could duplicate
        assert len(seen) == 1
    finally:
        fake.stop()


class DropFirst(httpx.BaseTransport):
    """Raise ConnectError for the first `n` requests, then send over real HTTP."""

    def __init__(self, n: int):
        self.n, self.attempts, self.inner = n, 0, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        if self.attempts <= self.n:
            raise httpx.ConnectError("connection refused (injected)", request=request)
        return self.inner.handle_request(request)


def test_transport_errors_are_retried(server):
    transport = DropFirst(2)
    with AglClient(server.url, key=KEY, backoff_base=0.001, transport=transport) as c:
        (rollout,) = c.create_rollouts([RolloutCreate(input={}, rollout_id=new_rollout_id())])
    assert transport.attempts == 3 and rollout.status.state == RolloutState.QUEUING


def test_unreachable_server_names_url_and_attempts():
    with AglClient("http://127.0.0.1:9", max_retries=2, backoff_base=0.001) as c:
        with pytest.raises(AglConnectionError, match=r"127.0.0.1:9 .*after 3 attempt"):
            c.terminal_page()


def test_non_idempotent_calls_are_sent_once(server):
    transport = DropFirst(1)
    with AglClient(server.url, key=KEY, backoff_base=0.001, transport=transport) as c:
        with pytest.raises(AglConnectionError):
            c.add_event("r", "0", "note", {})
    assert transport.attempts == 1


# =============================================================================================
# Waiting on the terminal cursor
# =============================================================================================


def _finish_later(server, ids: list[str], delay: float) -> threading.Thread:
    def run() -> None:
        with AglClient(server.url, key=KEY) as other:
            time.sleep(delay)
            for rid in ids:
                other.patch_status(rid, state="running", last_attempt_id="0")
                other.patch_status(rid, state="succeeded")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_poll_terminal_is_one_request_however_many_ids_are_pending(server, client, log):
    after = client.terminal_page(after=0, limit=1).total_terminal
    ids = _create(client, 40)
    _finish_later(server, ids[:25], delay=0.0).join()
    log.calls.clear()
    items, cursor = client.poll_terminal(ids, after=after)
    assert sorted(i.rollout_id for i in items) == sorted(ids[:25])
    assert all(i.state == RolloutState.SUCCEEDED for i in items) and cursor == after + 25
    assert log.paths() == ["/api/rollouts/terminal"]  # one GET for 40 pending ids, none per rollout
    _finish_later(server, ids[25:], delay=0.0).join()
    items, cursor = client.poll_terminal(ids, after=cursor)  # from the cursor: only what is new
    assert sorted(i.rollout_id for i in items) == sorted(ids[25:]) and cursor == after + 40


def test_states_of_names_each_rollout_and_missing_ones(client):
    done, running, queued = _create(client, 3)
    client.patch_status(done, state="failed")
    client.patch_status(running, state="running")
    assert client.states_of([done, running, queued, "ghost"]) == {
        done: "failed",
        running: "running",
        queued: "queuing",
        "ghost": "missing",
    }
    first, *rest = sorted([done, running, queued])  # fetched in id order, up to `limit`
    assert client.states_of([done, running, queued], limit=1) == {
        first: {done: "failed", running: "running", queued: "queuing"}[first],
        **{r: "not fetched" for r in rest},
    }
