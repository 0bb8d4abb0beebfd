"""Idempotent events (issue 40 item 2): an agent's events and the runner's rewards are resent on a
503 or a lost answer under one client-made `event_id`, and the store keeps one copy.

On the store (every backend): a repeated id under one (rollout, attempt) stores nothing. Over real
HTTP: `AgentContext.emit` through a connection that loses the server's answer after the server
stored the event (a fault between the client and the server), and through a PostgreSQL store whose
sessions were all dropped (its next call answers 503, nothing stored): exactly one event each.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from agl_lab.agent import AgentContext
from agl_lab.client import AglClient
from agl_lab.protocol import RolloutCreate
from agl_lab.server.backends import open_store
from agl_lab.server.store import Store

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
