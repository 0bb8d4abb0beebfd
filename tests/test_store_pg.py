"""The PostgreSQL store across processes: what the store's own tests (tests/test_store*.py, on every
backend) cannot show from one process.

Real `agl-lab serve` processes on one real PostgreSQL database (tests/postgres.py), real HTTP on
loopback. Two servers may share a store (a second `serve` is allowed, unlike SQLite's); a claim
raced through both is won once; a lease renewed through one is honoured by the other's sweeper; a
model registered through one is served by the other; kill -9 of any server (agl_lab's or a
PostgreSQL backend) loses no acknowledged write; the terminal cursor read through either server
lists every terminal rollout once, in one order. Plus the errors of opening (a bad URL, an
unreachable server, another schema version) and of a database that drops its sessions.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from agl_lab.protocol import RolloutCreate, RolloutState, RolloutStatusPatch
from agl_lab.server.backends import open_store
from agl_lab.server.store import StoreUnavailable
from agl_lab.server.store.postgresql import PostgresStore, SchemaMismatch
from tests.conftest import scaled
from tests.servers import Serve, create_rollouts

RUNNING = RolloutStatusPatch(state=RolloutState.RUNNING)


@pytest.fixture
def serve(postgres_database) -> Iterator:
    """serve(*flags) -> Serve on this test's database; every one is stopped at teardown."""
    started: list[Serve] = []

    def start(*flags: str) -> Serve:
        started.append(Serve(postgres_database, *flags))
        return started[-1]

    yield start
    for server in started:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Opening: errors name the setting and the fix
# ---------------------------------------------------------------------------------------------


def test_open_errors_name_the_url_and_the_fix(postgres, postgres_database, tmp_path):
    with pytest.raises(ValueError, match=r"not a PostgreSQL URL .*badparam.*postgresql://user:password@host"):
        open_store("postgresql://u@/db?badparam=1")
    nowhere = f"postgresql://u:secret@/db?host={tmp_path}&port=1"  # no server on that socket
    with pytest.raises(
        StoreUnavailable,
        match="cannot connect to the PostgreSQL store .*start PostgreSQL or fix "
        r"the URL \(the `store` setting / --store\)",
    ) as err:
        open_store(nowhere)
    assert "secret" not in str(err.value) and "u:***@" in str(err.value)
    done = subprocess.run(
        [sys.executable, "-m", "agl_lab.cli", "serve", "--store", nowhere], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.startswith("agl-lab serve: --store: cannot connect"), done.stderr

    open_store(postgres_database).close()  # creates the tables
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        conn.execute("UPDATE agl_meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(
        SchemaMismatch,
        match="schema version 999, this agl_lab reads version 1: point the `store` setting at another database",
    ):
        open_store(postgres_database)


def test_a_restarted_postgres_answers_503_once_then_serves(postgres, postgres_database):
    """When PostgreSQL drops every session, one call fails as StoreUnavailable (the app's 503:
    nothing stored, retry), not one per pooled connection; the next call works."""
    store = open_store(postgres_database)
    try:
        store.create_rollouts([RolloutCreate(rollout_id="a", input={})])
        together = threading.Barrier(4, timeout=10)

        def hold() -> None:
            with store._session():  # four threads at once: four pooled connections
                together.wait()

        threads = [threading.Thread(target=hold) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert store._pool.get_stats()["pool_size"] >= 4
        with postgres.admin() as conn:  # what a PostgreSQL restart does to every session
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (postgres_database.split("/")[3].split("?")[0],),
            )
        with pytest.raises(StoreUnavailable, match="nothing was stored; retry"):
            store.get_rollout("a")
        assert store.get_rollout("a").rollout_id == "a"
    finally:
        store.close()


def test_kill_9_of_postgres_loses_no_acknowledged_write(postgres, postgres_database):
    """SIGKILL of a PostgreSQL backend makes the postmaster reset every session and replay the WAL
    (crash recovery): what the store acknowledged before is all there afterwards."""
    with postgres.durable():
        store = open_store(postgres_database)
        try:
            store.create_rollouts([RolloutCreate(rollout_id=f"r{i}", input={}) for i in range(10)])
            for i in range(200):
                store.append_event(f"r{i % 10}", "0", "e", {"i": i})
            store.patch_status("r0", RUNNING)
            with postgres.admin() as conn:
                (pid,) = conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s LIMIT 1",
                    (postgres_database.split("/")[3].split("?")[0],),
                ).fetchone()
            os.kill(pid, signal.SIGKILL)
        finally:
            store.close()
        deadline = time.monotonic() + 60
        while True:  # the cluster refuses connections while it recovers
            try:
                store = open_store(postgres_database)
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        try:
            assert [e.data["i"] for e in store.events("r3")] == list(range(3, 200, 10))
            assert store.get_rollout("r0").status.state == "running"
        finally:
            store.close()


# ---------------------------------------------------------------------------------------------
# Two stores (two pools, as two processes would be) on one database
# ---------------------------------------------------------------------------------------------


def test_concurrent_batch_claims_lock_disjoint_rollouts(postgres_database):
    """`_lock_queued` (the batch claim's primitive): two claimers whose transactions overlap get
    disjoint rollouts, oldest first, and neither waits for the other (SKIP LOCKED)."""
    a, b = PostgresStore(postgres_database), PostgresStore(postgres_database)
    try:
        a.create_rollouts([RolloutCreate(rollout_id=f"r{i:02}", input={}) for i in range(12)])
        both_hold_locks = threading.Barrier(2, timeout=10)
        claimed: dict[str, list[str]] = {}

        def claim(store: PostgresStore, name: str) -> None:
            with store._session(), store._transaction():
                rollouts = store._lock_queued(5)
                both_hold_locks.wait()  # the other claimer locks while these rows are locked
                for rollout in rollouts:
                    store.patch_status(rollout.rollout_id, RUNNING)
            claimed[name] = [r.rollout_id for r in rollouts]

        threads = [threading.Thread(target=claim, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(claimed["a"] + claimed["b"]) == [f"r{i:02}" for i in range(10)]  # the oldest 10, once each
        assert [r.rollout_id for r in b.list_rollouts(["queuing"])] == ["r10", "r11"]
        with pytest.raises(RuntimeError, match="inside _transaction"), a._session():
            a._lock_queued(1)
    finally:
        a.close()
        b.close()


def test_racing_creates_of_one_client_id_store_it_once(postgres_database):
    """Two stores POST the same client ids at the same moment (a retried batch reaching two
    servers): each id is stored once and both callers get the stored rollout back."""
    a, b = PostgresStore(postgres_database), PostgresStore(postgres_database)
    try:
        got: dict[str, list] = {"a": [], "b": []}
        start = threading.Barrier(2, timeout=10)

        def create(store: PostgresStore, name: str) -> None:
            for i in range(60):
                start.wait()
                batch = [RolloutCreate(rollout_id=f"c{i}-{k}", input={"by": name}) for k in range(3)]
                got[name].append(store.create_rollouts(batch))

        threads = [threading.Thread(target=create, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got["a"]) == len(got["b"]) == 60  # no caller failed (a unique violation would)
        for batch_a, batch_b in zip(got["a"], got["b"]):
            assert [r.model_dump() for r in batch_a] == [r.model_dump() for r in batch_b]
        assert len(a.list_rollouts(["queuing"], limit=1000)) == 180
    finally:
        a.close()
        b.close()


def test_lease_activity_seen_by_one_store_is_honoured_by_another(postgres_database):
    """Heartbeats and events through store A renew the lease that store B's sweep checks."""
    a, b = PostgresStore(postgres_database), PostgresStore(postgres_database)
    try:
        a.create_rollouts([RolloutCreate(rollout_id=rid, input={}) for rid in ("beat", "event", "idle", "q")])
        for rid in ("beat", "event", "idle"):
            a.patch_status(rid, RUNNING)
        t0 = time.time()
        time.sleep(0.3)
        t1 = time.time()  # Critical: taken before the renewals, so the sweep below is < 10 s after each of them
        assert a.heartbeat(["beat", "q", "nope"]) == ["q", "nope"]  # only running rollouts hold leases
        a.append_event("event", "0", "custom", {})
        # a lease of 10 s, checked 9.9 s after t1: 'idle' was last active before t0, the others after t1
        assert b.expire_leases(10.0, now=t1 + 9.9) == {"idle": "failed"}  # max_attempts=1
        assert b.get_rollout("idle").status.error_message.startswith(
            "attempt 0: lease expired (no heartbeat, event or status"
        )
        assert b.get_rollout("beat").status.state == "running" and b.get_rollout("event").status.state == "running"
        time.sleep(0.3)
        t2 = time.time()  # before the heartbeat, as t1
        a.heartbeat(["beat"])
        assert b.expire_leases(10.0, now=t2 + 9.9) == {"event": "failed"}  # the heartbeat is newer than the event
        assert t0 < t1
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------------------
# Two `agl-lab serve` processes on one store
# ---------------------------------------------------------------------------------------------


def test_racing_claims_through_two_servers_are_won_once(serve):
    """Each rollout is PATCHed queuing -> running through both servers at the same moment:
    exactly one 200 and one 409 per rollout, and each rollout's version is 2."""
    servers = [serve(), serve()]  # a second serve on one PostgreSQL store is allowed
    ids = [f"race-{i}" for i in range(150)]
    with servers[0].client() as c:
        create_rollouts(c, ids)
    start = threading.Barrier(2, timeout=30)
    codes: dict[str, list[int]] = {rid: [] for rid in ids}

    def claimer(server: Serve) -> None:
        with server.client() as c:
            for rid in ids:
                start.wait()
                codes[rid].append(c.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).status_code)

    threads = [threading.Thread(target=claimer, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {rid: sorted(c) for rid, c in codes.items()} == {rid: [200, 409] for rid in ids}
    with servers[1].client() as c:
        listed = c.get("/api/rollouts", params={"state_in": "running", "limit": 1000}).json()
    assert sorted(r["rollout_id"] for r in listed) == sorted(ids)
    assert {r["status"]["version"] for r in listed} == {2}


def test_models_and_leases_are_shared_not_cached_per_server(serve, fake_upstream):
    """A model registered through server A is served by server B's gateway (B's pool is not a
    stale per-process cache), and heartbeats sent to A keep B's lease sweeper off the rollout."""
    lease = scaled(4.0)  # beaten every tenth of it below: a loaded machine's stalls (1–2 s) do not expire it
    a, b = serve("--lease-seconds", str(lease)), serve("--lease-seconds", str(lease))
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    with a.client() as ca, b.client() as cb:
        create_rollouts(ca, ["r"])
        assert ca.patch("/api/rollouts/r", json={"status": {"state": "running"}}).status_code == 200
        chat = "/proxy/rollout/r/attempt/0/mode/train/openai/v1/chat/completions"
        assert cb.post(chat, json=body).status_code == 503  # nothing registered yet (and B has asked once)
        assert ca.post("/api/models", json=[{"model": "m", "endpoint": fake_upstream.base_url}]).status_code == 201
        assert cb.post(chat, json=body).status_code == 200
        assert len(ca.get("/api/rollouts/r/events").json()) == 1  # B's event, read through A

        for _ in range(13):  # 1.3 leases: alive while A hears heartbeats
            assert ca.post("/api/rollouts/heartbeat", json={"rollout_ids": ["r"]}).json()["not_running"] == []
            time.sleep(lease / 10)
        assert cb.get("/api/rollouts/r").json()["rollout"]["status"]["state"] == "running"
        deadline = time.monotonic() + scaled(10) + lease  # then silence: one of the sweepers re-queues it as attempt 1
        while (status := cb.get("/api/rollouts/r").json()["rollout"]["status"])["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status["state"] == "queuing" and status["error_message"].startswith("attempt 0: lease expired")
        assert "re-queued as attempt 1" in status["error_message"]

        assert ca.delete("/api/models").status_code == 200
        create_rollouts(ca, ["r2"])
        ca.patch("/api/rollouts/r2", json={"status": {"state": "running"}})
        assert cb.post(chat.replace("/r/", "/r2/"), json=body).status_code == 503  # the clear, seen by B


def test_kill_9_of_either_server_loses_no_acknowledged_write(serve, postgres):
    """Writers spread over two servers; kill -9 one mid-write: the other still serves and holds
    every acknowledged event and terminal state; kill -9 it too: a third server holds them all."""
    with postgres.durable():
        servers = [serve(), serve()]
        acked_events: dict[str, int] = {}
        acked_terminal: set[str] = set()
        lock = threading.Lock()

        def writer(w: int, phase: int) -> None:
            rng = random.Random(w)
            clients = [s.client(timeout=10) for s in servers]
            try:
                for i in range(10**6):
                    rid = f"p{phase}-w{w}-{i}"
                    c = lambda: rng.choice(clients)  # noqa: E731  # each request to either server
                    c().post("/api/rollouts", json=[{"input": {"i": i}, "rollout_id": rid}]).raise_for_status()
                    c().patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
                    for k in range(3):
                        r = c().post(
                            f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "e", "data": {"k": k}}
                        )
                        r.raise_for_status()
                        with lock:
                            acked_events[rid] = acked_events.get(rid, 0) + 1
                    c().patch(f"/api/rollouts/{rid}", json={"status": {"state": "succeeded"}}).raise_for_status()
                    with lock:
                        acked_terminal.add(rid)
            except httpx.HTTPError:
                return  # a server is gone
            finally:
                for client in clients:
                    client.close()

        def run_writers_then_kill(phase: int, victim: Serve, acked_before: int) -> None:
            threads = [threading.Thread(target=writer, args=(w, phase), daemon=True) for w in range(4)]
            for t in threads:
                t.start()
            while sum(acked_events.values()) < acked_before:
                assert any(t.is_alive() for t in threads) and victim.proc.poll() is None
                time.sleep(0.01)
            victim.kill()  # mid-write: the writers are still going
            for t in threads:
                t.join(30)

        def check(server: Serve) -> None:
            with server.client() as c:
                for rid, n in acked_events.items():
                    events = c.get(f"/api/rollouts/{rid}/events").json()
                    assert [e["data"]["k"] for e in events][:n] == list(range(n)), (rid, n, events)
                page = c.get("/api/rollouts/terminal", params={"after": 0, "limit": 10_000}).json()
                assert acked_terminal <= {i["rollout_id"] for i in page["items"] if i["state"] == "succeeded"}

        run_writers_then_kill(0, servers[0], 120)
        check(servers[1])  # the survivor serves on, and holds what the dead one acknowledged
        servers = [servers[1], serve()]
        before = sum(acked_events.values())
        run_writers_then_kill(1, servers[0], before + 120)
        check(servers[1])
        assert len(acked_terminal) >= 20


def test_terminal_cursor_through_two_servers_lists_each_rollout_once_in_one_order(serve):
    """Writers finish rollouts through both servers while two readers page the terminal cursor,
    each through its own server: each reader sees every terminal rollout exactly once, and both
    see the same order (the log is in commit order and gap-free, so a cursor never passes a
    transition that commits later)."""
    servers = [serve(), serve()]
    per_writer, writers = 40, 6
    done = threading.Event()
    seen: list[list[str]] = [[], []]

    def writer(w: int) -> None:
        rng = random.Random(w)
        clients = [s.client() for s in servers]
        for i in range(per_writer):
            rid = f"t{w}-{i}"
            rng.choice(clients).post("/api/rollouts", json=[{"rollout_id": rid, "input": {}}]).raise_for_status()
            rng.choice(clients).patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
            state = rng.choice(["succeeded", "failed"])
            rng.choice(clients).patch(f"/api/rollouts/{rid}", json={"status": {"state": state}}).raise_for_status()
        for client in clients:
            client.close()

    def reader(n: int) -> None:
        after = 0
        with servers[n].client() as c:
            while True:
                finished = done.is_set()  # read before the page: a page after the last write is complete
                page = c.get("/api/rollouts/terminal", params={"after": after, "limit": 7}).json()
                seen[n].extend(item["rollout_id"] for item in page["items"])
                after = page["next_after"]
                if finished and after >= page["total_terminal"]:
                    return

    readers = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    for t in readers:
        t.join(60)
    expected = {f"t{w}-{i}" for w in range(writers) for i in range(per_writer)}
    for ids in seen:
        assert len(ids) == len(set(ids)) == len(expected) and set(ids) == expected
    assert seen[0] == seen[1]


def test_batch_claims_through_two_stores_are_exactly_once(postgres_database):
    """Two server processes' stores on one database, 8 claiming threads each: disjoint sets that
    cover the queue (`_lock_queued`: FOR NO KEY UPDATE SKIP LOCKED); then an expiry seen by one
    store re-queues as attempt 1 for a claim through the other."""
    a, b = PostgresStore(postgres_database), PostgresStore(postgres_database)
    try:
        ids = [f"p{i:03d}" for i in range(300)]
        a.create_rollouts([RolloutCreate(rollout_id=rid, input={}) for rid in ids])
        got: list[list[str]] = [[] for _ in range(16)]
        start = threading.Barrier(16)

        def claimer(i: int) -> None:
            store = (a, b)[i % 2]
            start.wait()
            while claimed := store.claim_rollouts(1 + i % 5, runner_id=f"t{i}"):
                got[i].extend(r.rollout_id for r in claimed)

        threads = [threading.Thread(target=claimer, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        flat = [rid for g in got for rid in g]
        assert len(flat) == len(set(flat)) == 300 and set(flat) == set(ids)
        assert sum(got[i] != [] for i in range(0, 16, 2)) and sum(got[i] != [] for i in range(1, 16, 2))  # both
        assert a.expire_leases(1.0, max_attempts=2, now=time.time() + 100)["p000"] == "requeued"
        again: list = []
        while batch := b.claim_rollouts(400):  # a fair share at a time while the 16 claimers count as recent
            again += batch
        assert len(again) == 300 and {r.status.last_attempt_id for r in again} == {"1"}
    finally:
        a.close()
        b.close()
