"""Long polls over real HTTP on loopback (#51 item 2): `GET /api/rollouts/terminal?wait_seconds=`
holds an empty page until a rollout changes state and times out cleanly; a request without the
parameter (an AGL client) gets today's answer at once; the rollout managers' completion check
costs requests per state change, not per poll interval."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from agl_lab.client import AglClient
from agl_lab.protocol import RolloutCreate
from agl_lab.rollout import TERMINAL_WAIT_SECONDS, SyncRolloutManager
from agl_lab.server.app import MAX_TERMINAL_WAIT_SECONDS
from tests.conftest import scaled
from tests.fake_runner import KEY, FakeRunner, scripted_agent


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(fn()))
    thread.start()
    return thread, got


def test_an_empty_terminal_wait_times_out_cleanly_with_the_same_cursor(server):
    with AglClient(server.url, key=KEY) as client:
        t0 = time.monotonic()
        page = client.terminal_page(after=0, wait_seconds=0.3)
        assert time.monotonic() - t0 >= 0.3  # held for the wait, then answered
        assert page.items == [] and page.next_after == 0 and page.total_terminal == 0


def test_a_waiting_terminal_poll_answers_when_a_rollout_finishes(server):
    with AglClient(server.url, key=KEY) as waiter, AglClient(server.url, key=KEY) as runner:
        runner.create_rollouts([RolloutCreate(rollout_id="r1", input={})])
        (claimed,) = runner.claim_rollouts(1)
        thread, got = _in_thread(lambda: waiter.terminal_page(after=0, wait_seconds=20))
        time.sleep(0.2)
        finished = time.monotonic()
        runner.patch_status("r1", state="succeeded", attempt_id=claimed.status.last_attempt_id)
        thread.join(20)
        assert [item.rollout_id for item in got[0].items] == ["r1"] and got[0].next_after == 1
        assert time.monotonic() - finished < 10  # the change answered it, not the 20 s wait


def test_a_claim_answers_a_waiting_terminal_poll_with_an_empty_page(server):
    """Any state change answers (a caller tracking `running` looks again), cursor unchanged."""
    with AglClient(server.url, key=KEY) as waiter, AglClient(server.url, key=KEY) as runner:
        runner.create_rollouts([RolloutCreate(rollout_id=f"r{i}", input={}) for i in range(3)])
        thread, got = _in_thread(lambda: waiter.terminal_page(after=0, wait_seconds=20))
        time.sleep(0.2)
        for _ in range(3):  # a claim made before the poll has parked answers nothing: claim again
            claimed_at = time.monotonic()
            assert len(runner.claim_rollouts(1)) == 1
            thread.join(scaled(2))
            if not thread.is_alive():
                break
        thread.join(20)
        assert got[0].items == [] and got[0].next_after == 0
        assert time.monotonic() - claimed_at < 10


def test_an_old_client_sends_no_wait_and_gets_todays_answer_at_once(server):
    sent: list[httpx.URL] = []
    with AglClient(server.url, key=KEY, event_hooks={"request": [lambda r: sent.append(r.url)]}) as client:
        client.terminal_page(after=0)
        client.poll_terminal(["x"], 0)
    assert all("wait_seconds" not in url.params for url in sent) and len(sent) == 2
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as raw:
        answer = raw.get("/api/rollouts/terminal", params={"after": 0, "limit": 10}, timeout=2.0)
        assert answer.status_code == 200
        assert answer.json() == {"items": [], "next_after": 0, "total_terminal": 0}  # AGL's shape


def test_a_wait_over_the_cap_names_the_parameter(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as raw:
        answer = raw.get("/api/rollouts/terminal", params={"wait_seconds": MAX_TERMINAL_WAIT_SECONDS + 1})
    assert answer.status_code == 422 and "wait_seconds" in answer.text


def _slow_agent(client: AglClient, rollout) -> str:
    time.sleep(1.0)
    return scripted_agent(client, rollout)


def test_the_managers_completion_check_follows_changes_not_the_poll_interval(server):
    """Two rollouts of 1 s each, run in series, polled at a 10 ms interval: a clock-driven check
    would take ~200 terminal polls; long polls answer at the claims and finishes (4 changes), and
    wait at most RUNNING_LOOK_SECONDS while a rollout has not been seen running (its start time)."""
    seen: list[tuple[str, str]] = []
    hook = lambda request: seen.append((request.method, request.url.path))  # noqa: E731
    with AglClient(server.url, key=KEY, backoff_base=0.001, event_hooks={"request": [hook]}) as client:
        manager = SyncRolloutManager(
            client, n=2, step=0, rollout_config={}, poll_interval=0.01, timeout_seconds=4 * TERMINAL_WAIT_SECONDS
        )
        with FakeRunner(server.url, agent=_slow_agent):
            completed = manager.run([{"name": "t1", "x": 1}], is_train=True)
    assert sorted(c.copy_idx for c in completed) == [0, 1]
    assert all(c.running_at is not None and c.running_at < c.finished_at for c in completed), [
        (c.running_at, c.finished_at) for c in completed
    ]
    calls = Counter(seen)
    # while a rollout waits to be seen running the wait is short (RUNNING_LOOK_SECONDS), then long
    assert 1 <= calls[("GET", "/api/rollouts/terminal")] <= 40, calls
    assert calls[("GET", "/api/rollouts")] <= calls[("GET", "/api/rollouts/terminal")]
