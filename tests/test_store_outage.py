"""A PostgreSQL outage freezes no server (issue 40 item 1).

A real `agl-lab serve` on a real PostgreSQL cluster of its own (tests/postgres.py; this module's,
because the test stops it with `pg_ctl stop`), real HTTP on loopback. With the database down,
`/healthz` still answers (store calls run in worker threads, not on the event loop), every route
that needs the store answers 503 within the store timeout (2 s) instead of the connect timeout, and
concurrent calls wait side by side, not one after another. The bounds are generous (the machine
may be loaded): they separate "waits in turn" (N x timeout) from "waits together" (~1 x timeout).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from agl_lab.protocol import rollout_token
from tests.postgres import PostgresCluster
from tests.servers import KEY, Serve, create_rollouts

CALLS = 10  # concurrent proxied calls during the outage
STORE_TIMEOUT = 2.0  # the server's store_timeout_seconds (its default)


@pytest.fixture
def own_cluster() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster.start()
    yield cluster
    cluster.stop()


def _timed(fn):  # -> (seconds, result)
    started = time.monotonic()
    result = fn()
    return time.monotonic() - started, result


def test_a_database_outage_answers_503_at_once_and_stalls_no_loop(own_cluster, fake_upstream):
    url = own_cluster.create_database()
    server = Serve(url, "--lease-seconds", "0")
    chat = "/proxy/rollout/r/attempt/0/mode/train/openai/v1/chat/completions"
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    try:
        with server.client(timeout=60) as c:
            create_rollouts(c, ["r"])
            claimed = c.post("/api/rollouts/claim", json={"limit": 1}).json()
            assert [r["rollout_id"] for r in claimed] == ["r"]
            assert c.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).status_code == 201
            assert c.post(chat, json=body).status_code == 200
            token = rollout_token(KEY, "r", claimed[0]["status"]["created_at"], "0")

            own_cluster._run("pg_ctl", "-D", own_cluster.data, "-m", "fast", "-w", "stop")

            def proxied(headers: dict[str, str] | None = None) -> int:
                with httpx.Client(base_url=server.url, trust_env=False, timeout=120) as agent:
                    return agent.post(chat, json=body, headers=headers or {"x-api-key": KEY}).status_code

            with concurrent.futures.ThreadPoolExecutor(CALLS) as pool:
                started = time.monotonic()
                calls = [pool.submit(proxied) for _ in range(CALLS)]
                health_s, health = _timed(lambda: c.get("/healthz").status_code)  # while the calls wait
                codes = [f.result() for f in calls]
                together_s = time.monotonic() - started
            assert health == 200 and health_s < 5, health_s  # the loop is free (it took 30 s before)
            assert codes == [503] * CALLS
            serial_s = CALLS * STORE_TIMEOUT
            assert together_s < serial_s / 2, f"{CALLS} calls took {together_s:.1f}s: serialised? ({serial_s}s)"

            for request in (  # every route that needs the store: 503 (nothing stored; retry), promptly
                lambda: c.get("/api/rollouts/r"),
                lambda: c.post("/api/rollouts/r/attempt/0/events", json={"event_type": "e"}),
                lambda: c.post("/api/rollouts/heartbeat", json={"rollout_ids": ["r"]}),
            ):
                seconds, answer = _timed(request)
                assert answer.status_code == 503 and seconds < 5 * STORE_TIMEOUT, (answer.text, seconds)
                assert "nothing was stored" in answer.json()["detail"]
            seconds, code = _timed(lambda: proxied({"Authorization": f"Bearer {token}"}))  # the token check reads
            assert code == 503 and seconds < 5 * STORE_TIMEOUT, seconds  # the store too: 503, not 401 / a stall

            own_cluster._run("pg_ctl", "-D", own_cluster.data, "-l", f"{own_cluster.root}/log", "-w", "start")
            deadline = time.monotonic() + 60
            while (code := proxied({"Authorization": f"Bearer {token}"})) == 503:  # back once PostgreSQL is
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert code == 200
            assert len(c.get("/api/rollouts/r/events").json()) == 2  # one before, one after: none in between
    finally:
        server.stop()
