"""Idempotent events (issue 40 item 2): an agent's events and the runner's rewards are resent on a
503 or a lost answer under one client-made `event_id`, and the store keeps one copy.

On the store (every backend): a repeated id under one (rollout, attempt) stores nothing. Over real
HTTP: `AgentContext.emit` through a connection that loses the server's answer after the server
stored the event (a fault between the client and the server), and through a PostgreSQL store whose
sessions were all dropped (its next call answers 503, nothing stored): exactly one event each.

An id names one event (issue 53 item 3): the same id with other content (type or data) is refused
— EventIdReused on the store, 409 naming the id over HTTP, also from a second server on the same
PostgreSQL — never silently dropped. Stores made before ids carried a digest open and keep working.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import httpx
import pytest

from agl_lab.agent import AgentContext
from agl_lab.client import AglClient
from agl_lab.protocol import RolloutCreate
from agl_lab.server.backends import open_store
from agl_lab.server.store import EventIdReused, Store

KEY = "events-key"


@pytest.fixture
def store(every_store_url) -> Iterator[Store]:
    s = open_store(every_store_url)
    yield s
    s.close()


def test_a_repeated_event_id_is_stored_once(store):
    store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
    first = store.append_event("a", "0", "reward", {"value": 1.0}, event_id="e1")
    again = store.append_event("a", "0", "reward", {"value": 1.0}, event_id="e1")
    assert first.data == again.data == {"value": 1.0}
    store.append_event("a", "1", "reward", {"value": 2.0}, event_id="e1")  # another attempt: its own ids
    store.append_event("a", "0", "reward", {"value": 3.0}, event_id="e2")
    store.append_event("a", "0", "reward", {"value": 4.0})  # no id: appended every time
    store.append_event("a", "0", "reward", {"value": 4.0})
    assert [e.data["value"] for e in store.events("a", attempt_id="0")] == [1.0, 3.0, 4.0, 4.0]
    assert [e.data["value"] for e in store.events("a", attempt_id="1")] == [2.0]
    store.delete_rollout("a")  # the ids go with the rollout: a re-created one starts afresh
    store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
    store.append_event("a", "0", "reward", {"value": 5.0}, event_id="e1")
    assert [e.data["value"] for e in store.events("a")] == [5.0]


def test_an_event_id_reused_with_other_content_is_refused_naming_the_id(store):
    store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
    store.append_event("a", "0", "reward", {"value": 1.0, "why": "first"}, event_id="e1")
    store.append_event("a", "0", "reward", {"why": "first", "value": 1.0}, event_id="e1")  # key order: the same
    for event_type, data in (("reward", {"value": 2.0, "why": "first"}), ("step", {"value": 1.0, "why": "first"})):
        with pytest.raises(EventIdReused, match=r"Rollout a, attempt 0: event id 'e1' is already stored with other"):
            store.append_event("a", "0", event_type, data, event_id="e1")
    store.append_event("a", "1", "reward", {"value": 9.0}, event_id="e1")  # another attempt: its own ids
    assert [e.data for e in store.events("a", attempt_id="0")] == [{"value": 1.0, "why": "first"}]


def test_a_sqlite_store_made_before_digests_opens_and_its_old_ids_stay_idempotent(tmp_path):
    path = tmp_path / "old.db"
    store = open_store(f"sqlite:///{path}")
    store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
    store.append_event("a", "0", "reward", {"value": 1.0}, event_id="old")
    store.close()
    with sqlite3.connect(path) as db:  # the event_ids table as agl_lab wrote it before issue 53
        db.execute("DROP TABLE event_ids")
        db.execute(
            "CREATE TABLE event_ids (rollout_id TEXT NOT NULL, attempt_id TEXT NOT NULL, event_id TEXT NOT NULL, "
            "PRIMARY KEY (rollout_id, attempt_id, event_id))"
        )
        db.execute("INSERT INTO event_ids VALUES ('a', '0', 'old')")
    store = open_store(f"sqlite:///{path}")
    try:
        store.append_event("a", "0", "reward", {"value": 1.0}, event_id="old")  # no digest kept: a resend
        store.append_event("a", "0", "reward", {"value": 2.0}, event_id="new")
        with pytest.raises(EventIdReused, match="'new'"):
            store.append_event("a", "0", "reward", {"value": 3.0}, event_id="new")
        assert [e.data["value"] for e in store.events("a")] == [1.0, 2.0]
    finally:
        store.close()


def _post(server, event_id: str, data: dict) -> httpx.Response:
    body = {"event_type": "reward", "data": data, "event_id": event_id}
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{server.url}/api/rollouts/r/attempt/0/events", json=body, headers=headers, timeout=30)


def test_an_event_id_reused_over_http_gets_409_naming_it(embedded_server, store_url):
    server = embedded_server(key=KEY, store=store_url)
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(rollout_id="r", input={})])
        assert _post(server, "e1", {"value": 1.0}).status_code == 200
        assert _post(server, "e1", {"value": 1.0}).status_code == 200  # a resend
        refused = _post(server, "e1", {"value": 2.0})
        assert refused.status_code == 409, refused.text
        assert "event id 'e1' is already stored with other content" in refused.json()["detail"]
        assert [e["data"] for e in client.get_events("r")] == [{"value": 1.0}]


def test_the_client_surfaces_the_409_naming_the_id_and_does_not_resend_it(embedded_server, monkeypatch):
    """`AglClient` makes a fresh id per event; two events under one id (forced here: a uuid4
    collision) get the server's line as AglHTTPError, sent once — a 409 is no transient failure."""
    import uuid

    from agl_lab.client import AglHTTPError

    server = embedded_server(key=KEY)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))
    with AglClient(server.url, key=KEY, backoff_base=0.01) as client:
        client.create_rollouts([RolloutCreate(rollout_id="r", input={})])
        client.add_event("r", "0", "reward", {"value": 1.0}, retry=True)
        seen: list[int] = []
        client.http.event_hooks["response"].append(lambda r: seen.append(r.status_code))
        with pytest.raises(AglHTTPError, match=f"409: .*event id '{uuid.UUID(int=7).hex}' is already stored") as e:
            client.add_event("r", "0", "reward", {"value": 2.0}, retry=True)
        assert e.value.status_code == 409 and seen == [409]
        assert [e["data"] for e in client.get_events("r")] == [{"value": 1.0}]


def test_two_servers_on_one_postgresql_refuse_an_id_the_other_stored_with_other_content(
    embedded_server, postgres_database
):
    # a loaded machine: the second server's store may wait on a pooled connection past the 2 s default
    first = embedded_server(key=KEY, store=postgres_database, store_timeout_seconds=30)
    second = embedded_server(key=KEY, store=postgres_database, store_timeout_seconds=30)
    with AglClient(first.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(rollout_id="r", input={})])
        assert _post(first, "e1", {"value": 1.0}).status_code == 200
        assert _post(second, "e1", {"value": 1.0}).status_code == 200  # a resend to the other server
        refused = _post(second, "e1", {"value": 2.0})
        assert refused.status_code == 409 and "'e1'" in refused.json()["detail"], refused.text
        assert [e["data"] for e in client.get_events("r")] == [{"value": 1.0}]


def test_a_postgresql_store_made_before_digests_gains_the_column(postgres_database):
    import psycopg  # with the postgres fixture only (skipped where PostgreSQL is not installed)

    store = open_store(postgres_database)
    store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
    store.append_event("a", "0", "reward", {"value": 1.0}, event_id="old")
    store.close()
    with psycopg.connect(postgres_database, autocommit=True) as conn:  # agl_event_ids as made before issue 53
        conn.execute("ALTER TABLE agl_event_ids DROP COLUMN digest")
    store = open_store(postgres_database)
    try:
        store.append_event("a", "0", "reward", {"value": 5.0}, event_id="old")  # no digest kept: a resend
        store.append_event("a", "0", "reward", {"value": 2.0}, event_id="new")
        with pytest.raises(EventIdReused, match="'new'"):
            store.append_event("a", "0", "reward", {"value": 3.0}, event_id="new")
        assert [e.data["value"] for e in store.events("a")] == [1.0, 2.0]
    finally:
        store.close()


class LoseFirstEventAnswer(httpx.HTTPTransport):
    """Forwards every request; the first event POST's answer is dropped (the server stored it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/events") and request.method == "POST" and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadError("connection reset after the server answered", request=request)
        return response


def _claimed_context(server, client: AglClient) -> AgentContext:
    client.create_rollouts([RolloutCreate(rollout_id="r", input={})])
    (rollout,) = client.claim_rollouts(1, runner_id="t")
    return AgentContext.of(rollout, server.url, KEY, client=client)


def test_an_emit_whose_answer_was_lost_is_stored_once(embedded_server, store_url):
    server = embedded_server(key=KEY, store=store_url)
    transport = LoseFirstEventAnswer()
    with AglClient(server.url, key=KEY, backoff_base=0.01, transport=transport) as client:
        ctx = _claimed_context(server, client)
        ctx.emit("reward", {"value": 1.0})
        assert transport.lost == 1
        assert [e["data"] for e in client.get_events("r", event_type="reward")] == [{"value": 1.0}]


def test_an_emit_the_store_refused_with_503_is_resent_and_stored_once(embedded_server, postgres, postgres_database):
    server = embedded_server(key=KEY, store=postgres_database)
    with AglClient(server.url, key=KEY, backoff_base=0.01) as client:
        ctx = _claimed_context(server, client)
        ctx.emit("step", {"n": 0})
        with postgres.admin() as conn:  # what a PostgreSQL restart does: the server's next call fails (503)
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (postgres_database.split("/")[3].split("?")[0],),
            )
        seen: list[int] = []
        client.http.event_hooks["response"].append(lambda r: seen.append(r.status_code))
        ctx.emit("reward", {"value": 1.0})
        assert seen[0] == 503 and seen[-1] == 200, seen  # refused once, then resent
        events = client.get_events("r")
        assert [(e["event_type"], e["data"]) for e in events] == [("step", {"n": 0}), ("reward", {"value": 1.0})]
