"""Claims across servers of one PostgreSQL ledger (issue 40 item 4): fair shares and wake-ups.

Real `agl-lab serve` processes on one real PostgreSQL database, real HTTP on loopback. Two runners,
each on its own server, long-poll the claim route with room for the whole queue; 96 rollouts are
queued through one server: each runner gets a share (before, the first claim took all 96), and
every rollout is claimed once. A rollout queued through one store instance wakes the listener of
another (LISTEN/NOTIFY), which is what wakes the waiting claims of every server.
"""

from __future__ import annotations

import threading

import pytest

from agl_lab.client import AglClient
from agl_lab.protocol import RolloutCreate
from agl_lab.server.store.postgresql import PostgresStore
from tests.servers import KEY, Serve

N = 96


@pytest.fixture
def two_servers(postgres_database):
    servers = [Serve(postgres_database), Serve(postgres_database)]
    yield servers
    for server in servers:
        server.stop()


def test_two_runners_on_two_servers_each_get_a_share(two_servers):
    a, b = two_servers
    got: dict[str, list[str]] = {"runner-a": [], "runner-b": []}
    both_polled = threading.Barrier(3, timeout=60)
    queued = threading.Event()
    # each runner's first claim lands before either makes a second: without it a runner whose first
    # claim a loaded host delays could find the other one's four claims (48 + 24 + 12 + 6) done
    first_claimed = threading.Barrier(2, timeout=60)

    def runner(name: str, server: Serve) -> None:
        with AglClient(server.url, key=KEY) as client:
            assert client.claim_rollouts(N, runner_id=name) == []  # an idle poll: this runner now claims
            both_polled.wait()
            queued.wait(60)
            first = True
            while True:  # as a runner does: claim with all its free slots until the queue is empty
                claimed = client.claim_rollouts(N, runner_id=name, wait_seconds=1.0)
                if first:
                    first_claimed.wait()
                    first = False
                if not claimed:
                    return
                got[name] += [r.rollout_id for r in claimed]

    threads = [threading.Thread(target=runner, args=(n, s)) for n, s in (("runner-a", a), ("runner-b", b))]
    for t in threads:
        t.start()
    both_polled.wait()
    threading.Event().wait(1.5)  # past each server's 1 s cache of the claimer count
    with AglClient(a.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(rollout_id=f"r{i:02d}", input={}) for i in range(N)])
    queued.set()
    for t in threads:
        t.join(120)
    flat = got["runner-a"] + got["runner-b"]
    assert sorted(flat) == sorted(f"r{i:02d}" for i in range(N))  # each claimed once
    assert got["runner-a"] and got["runner-b"], {k: len(v) for k, v in got.items()}
    assert max(len(v) for v in got.values()) <= N - N // 8, {k: len(v) for k, v in got.items()}


def test_rollouts_queued_through_one_store_wake_the_listeners_of_another(postgres_database):
    writer, reader = PostgresStore(postgres_database), PostgresStore(postgres_database)
    woken = threading.Event()
    connected = threading.Event()
    calls = []

    def on_queued() -> None:
        calls.append(1)
        (woken if connected.is_set() else connected).set()  # the first call: (re)connected

    stop = reader.listen_queued(on_queued)
    try:
        assert connected.wait(60)
        writer.create_rollouts([RolloutCreate(rollout_id="x", input={})])
        assert woken.wait(60)  # the notification reached the other store's listener
        n = len(calls)
        writer.claim_rollouts(1, "r")  # claims queue nothing: no notification
        (rid,) = [r.rollout_id for r in writer.list_rollouts(["running"])]
        woken.clear()  # before the release: its notification may arrive at once
        writer.release_rollouts({rid: "0"}, "test")  # a release queues again: one
        assert woken.wait(60) and len(calls) > n
    finally:
        stop()
        writer.close()
        reader.close()


class CountingStore(PostgresStore):
    """A PostgresStore that counts the claim transactions it runs."""

    claims = 0

    def claim_rollouts(self, limit: int, runner_id: str = ""):  # type: ignore[override]
        CountingStore.claims += 1
        return super().claim_rollouts(limit, runner_id)


def test_idle_claims_skip_the_database_until_rollouts_are_queued(embedded_server, postgres_database):
    """With the listener running, a queue seen empty stays known empty until a notification (or
    EMPTY_TRUST_SECONDS): idle polls cost no claim transaction each; a rollout queued through
    another store instance (another server) is still claimed at once."""
    store, other = CountingStore(postgres_database), PostgresStore(postgres_database)
    server = embedded_server(key=KEY, store=store)
    try:
        with AglClient(server.url, key=KEY) as client:
            CountingStore.claims = 0
            for _ in range(40):
                assert client.claim_rollouts(4, runner_id="idle") == []
            assert 1 <= CountingStore.claims <= 20, CountingStore.claims  # not one transaction per poll
            got: list[str] = []
            waiter = threading.Thread(
                target=lambda: got.extend(r.rollout_id for r in client.claim_rollouts(4, "idle", wait_seconds=30))
            )
            waiter.start()
            other.create_rollouts([RolloutCreate(rollout_id="new", input={})])  # through "another server"
            waiter.join(60)
            assert got == ["new"]
    finally:
        other.close()
        server.stop()  # a store handed to the server is the caller's to close, after the server is done with it
        store.close()
