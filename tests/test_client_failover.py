"""`agentlightning.agl_base_url` with several servers of one ledger: two real servers on one
PostgreSQL database (tests/postgres.py), the client given both; the first server is stopped
mid-run and the client carries on with the second (creates, reads, the terminal log), one
failover counted; a runner on the second server finishes every rollout."""

from __future__ import annotations

import time

import pytest

from agl_lab.client import AglClient, server_urls
from agl_lab.protocol import RolloutCreate
from agl_lab.runner import Runner
from tests.agents_for_tests import remote_agent

KEY = "failover-key"


def test_server_urls_take_a_comma_list_or_a_list_and_name_the_key_when_empty():
    assert server_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert server_urls(["http://a:1", "http://b:2/"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match=r"^agentlightning\.agl_base_url=' , ' names no server"):
        server_urls(" , ")


def test_the_client_fails_over_to_the_next_server_when_the_first_is_stopped(embedded_server, postgres_database):
    s0 = embedded_server(key=KEY, store=postgres_database, default_proxy={"model_name": "m"})
    s1 = embedded_server(key=KEY, store=postgres_database, default_proxy={"model_name": "m"})
    with AglClient(f"{s0.url},{s1.url}", key=KEY, backoff_base=0.05) as client:
        client.create_rollouts([RolloutCreate(rollout_id=f"a{i}", input={}) for i in range(3)])
        assert client.base_url == s0.url and client.failovers == 0 and client.urls == [s0.url, s1.url]
        s0.stop()  # its port now refuses connections
        client.create_rollouts([RolloutCreate(rollout_id=f"b{i}", input={}) for i in range(3)])
        assert client.base_url == s1.url and client.failovers == 1
        ids = [f"{p}{i}" for p in "ab" for i in range(3)]
        assert {r.rollout_id for r in client.list_rollouts(["queuing"])} == set(ids)
        with Runner(s1.url, key=KEY, agent=remote_agent, concurrency=3, poll_interval=0.02):
            done: set[str] = set()
            cursor, end = 0, time.monotonic() + 120
            while done != set(ids) and time.monotonic() < end:
                items, cursor = client.poll_terminal(ids, cursor)
                done |= {item.rollout_id for item in items}
                time.sleep(0.1)
        assert done == set(ids)
        for rid in ids:
            rollout, attempts = client.get_rollout(rid)
            assert rollout.status.state == "succeeded" and attempts == ["0"], rollout.status
        assert client.failovers == 1  # the second server answered everything after the move
