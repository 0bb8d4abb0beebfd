"""The claim route over real HTTP: exactly-once under 16+ concurrent claimers on every store
backend, its errors, the attempt-conditioned PATCH and heartbeat, and release, as a client sees them."""

from __future__ import annotations

import threading

import httpx
import pytest

from agl_lab.client import AglClient, AglHTTPError
from agl_lab.protocol import RolloutCreate, rollout_token
from tests.conftest import scaled

KEY = "claims-key"


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url, max_batch_items=50)


def test_twenty_concurrent_http_claimers_get_disjoint_sets_covering_the_queue(server):
    with AglClient(server.url, key=KEY) as client:
        ids = [f"c{i:03d}" for i in range(400)]
        for i in range(0, 400, 50):
            client.create_rollouts([RolloutCreate(rollout_id=rid, input={}) for rid in ids[i : i + 50]])
    got: list[list[str]] = [[] for _ in range(20)]
    start, first_round = threading.Barrier(20), threading.Barrier(20)

    def claimer(i: int) -> None:
        with AglClient(server.url, key=KEY) as mine:
            start.wait()
            got[i].extend(r.rollout_id for r in mine.claim_rollouts(1 + i % 4, runner_id=f"http-{i}"))
            first_round.wait()  # 20 claims of ≤ 4 leave most of the 400 for the race that follows
            while claimed := mine.claim_rollouts(1 + i % 4, runner_id=f"http-{i}"):
                got[i].extend(r.rollout_id for r in claimed)
                assert all(r.status.state == "running" and r.status.last_attempt_id == "0" for r in claimed)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [rid for g in got for rid in g]
    assert len(flat) == len(set(flat)) == 400 and set(flat) == set(ids)
    assert all(got)  # every claimer got rollouts


def test_claim_route_errors_name_the_field(server):
    with httpx.Client(base_url=server.url, headers=server.headers) as http:
        assert http.post("/api/rollouts/claim", json={"limit": 0}).status_code == 422
        bad = http.post("/api/rollouts/claim", json={"limit": 1, "runnerid": "x"})
        assert bad.status_code == 422 and "runnerid" in bad.text
        assert http.post("/api/rollouts/claim", json={"limit": 5}).json() == []  # nothing queued
        assert httpx.post(f"{server.url}/api/rollouts/claim", json={"limit": 1}).status_code == 401  # no key
        hb = http.post("/api/rollouts/heartbeat", json={"rollout_ids": ["a", "b"], "attempt_ids": ["0"]})
        assert hb.status_code == 422 and "one attempt id per rollout id" in hb.text


def test_a_lost_attempt_can_neither_end_feed_nor_renew_the_next(server):
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(rollout_id="r", input={})])
        (first,) = client.claim_rollouts(1)
        token0 = rollout_token(KEY, "r", first.status.created_at, "0")
        assert client.release_rollouts({"r": "0"}, "test") == ["r"]
        (second,) = client.claim_rollouts(1)
        assert second.status.last_attempt_id == "1"
        with pytest.raises(AglHTTPError) as err:  # the old runner's terminal PATCH
            client.patch_status("r", state="succeeded", attempt_id="0")
        assert err.value.status_code == 409 and "attempt 0 is not running" in err.value.detail
        assert client.heartbeat(["r"], ["0"])["not_running"] == ["r"]
        assert client.heartbeat(["r"], ["1"])["not_running"] == []
        token1 = rollout_token(KEY, "r", first.status.created_at, "1")
        with httpx.Client(base_url=server.url) as agent:

            def post(token: str, attempt: str) -> int:
                return agent.post(
                    f"/api/rollouts/r/attempt/{attempt}/events",
                    json={"event_type": "x"},
                    headers={"Authorization": f"Bearer {token}"},
                ).status_code

            assert post(token0, "0") == 401 and post(token0, "1") == 401  # the old token opens nothing
            assert post(token1, "1") == 200

            def call(token: str, attempt: str) -> int:
                return agent.post(
                    f"/proxy/rollout/r/attempt/{attempt}/mode/train/openai/v1/chat/completions",
                    json={"messages": []},
                    headers={"Authorization": f"Bearer {token}"},
                ).status_code

            assert call(token0, "0") == 401 and call(token0, "1") == 401
            assert call(token1, "1") == 503  # authorised: no model registered in this test
        client.add_event("r", "0", "late", {})  # an admin-key late event of attempt 0: kept, not read
        assert client.patch_status("r", state="succeeded", attempt_id="1").status.state == "succeeded"
        rollout, attempts = client.get_rollout("r")
        assert attempts == ["1", "0"]  # by first event: attempt 0 had none before the late one
        assert [e["event_type"] for e in client.get_events("r")] == ["x"]


def test_a_claim_hands_at_most_max_batch_items(server):
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(rollout_id=f"m{i}", input={}) for i in range(50)])
        client.create_rollouts([RolloutCreate(rollout_id=f"n{i}", input={}) for i in range(10)])
        assert len(client.claim_rollouts(1000)) == 50 and len(client.claim_rollouts(1000)) == 10


def test_a_waiting_claim_returns_as_soon_as_a_rollout_is_queued(server, monkeypatch):
    import time

    import agl_lab.server.app

    # the re-check far off (30 s): only the create's wake-up can answer the waiter within the bound,
    # and the bound can be generous (a loaded host once took > 0.5 s between the create and the join)
    monkeypatch.setattr(agl_lab.server.app, "CLAIM_RECHECK_SECONDS", 30.0)
    with AglClient(server.url, key=KEY) as waiter, AglClient(server.url, key=KEY) as producer:
        t0 = time.monotonic()
        assert waiter.claim_rollouts(1, wait_seconds=0.3) == []  # none queued: answers after the wait
        assert 0.3 <= time.monotonic() - t0 < scaled(10)
        got: list = []
        thread = threading.Thread(target=lambda: got.extend(waiter.claim_rollouts(1, wait_seconds=20)))
        thread.start()
        time.sleep(0.3)
        created = time.monotonic()
        producer.create_rollouts([RolloutCreate(rollout_id="soon", input={})])
        thread.join(20)
        assert [r.rollout_id for r in got] == ["soon"]
        assert time.monotonic() - created < scaled(10)  # woken by the create: the re-check is 30 s off
