"""SQLite group commit (issue #17): concurrent event appends share a COMMIT, each append returns
only once committed (another connection sees it), and a failure reaches exactly its caller.

Deterministic, no timing: the test holds the store's lock, so appends queue up behind it, and
counts commits (`append_commits`) once it lets go."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest

from agl_lab.protocol import Model, RolloutCreate, RolloutState, RolloutStatusPatch
from agl_lab.server.storable import NotStorable
from agl_lab.server.store import RolloutNotFound, SqliteStore


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(str(tmp_path / "group.db"))
    s.create_rollouts([RolloutCreate(rollout_id=f"r{i}", input={}) for i in range(4)])
    yield s
    s.close()


def rows_on_disk(store: SqliteStore) -> list[tuple[str, str]]:
    with sqlite3.connect(store.path) as db:  # another connection: sees committed rows only
        return db.execute("SELECT rollout_id, event_type FROM events ORDER BY seq").fetchall()


def wait_queued(store: SqliteStore, n: int) -> None:
    """Until `n` appends wait in the queue (they are blocked behind the lock the test holds)."""
    deadline = time.monotonic() + 30
    while len(store._pending) < n:
        assert time.monotonic() < deadline, f"{len(store._pending)} of {n} appends queued"
        time.sleep(0.001)


def append_in_threads(store: SqliteStore, calls: list[tuple[str, str, dict]]) -> list[object]:
    """Run each (rollout_id, event_type, data) append in its own thread while the test holds the
    store's lock; returns each call's Event or exception, in order."""
    outcomes: list[object] = [None] * len(calls)

    def call(i: int, rid: str, etype: str, data: dict) -> None:
        try:
            outcomes[i] = store.append_event(rid, "0", etype, data)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[i] = exc

    threads = [threading.Thread(target=call, args=(i, *c)) for i, c in enumerate(calls)]
    with store._lock:
        for t in threads:
            t.start()
        wait_queued(store, len(calls))
    for t in threads:
        t.join(30)
    return outcomes


def test_concurrent_appends_from_threads_share_one_commit(store):
    commits = store.append_commits
    calls = [(f"r{k % 4}", "custom", {"k": k}) for k in range(16)]
    outcomes = append_in_threads(store, calls)
    assert store.append_commits == commits + 1  # 16 appends, one COMMIT
    assert [e.data for e in outcomes] == [{"k": k} for k in range(16)]  # type: ignore[union-attr]
    assert len(rows_on_disk(store)) == 16


def test_concurrent_async_appends_share_commits_and_are_committed_when_awaited(store):
    commits = store.append_commits
    on_disk_when_done: list[int] = []

    async def agents() -> list[object]:
        async def agent(k: int) -> object:
            rid = "missing" if k == 5 else f"r{k % 4}"
            try:
                event = await store.append_event_async(rid, "0", "model_request", {"k": k})
            except RolloutNotFound as exc:
                return exc
            on_disk_when_done.append(len(rows_on_disk(store)))
            return event

        tasks = [asyncio.ensure_future(agent(k)) for k in range(64)]
        await asyncio.sleep(0)  # every task queues its append; the writer thread waits for the lock
        wait_queued(store, 64)
        store._lock.release()
        try:
            return await asyncio.gather(*tasks)
        finally:
            store._lock.acquire()

    with store._lock:  # held across the loop; released inside it once all 64 have queued
        outcomes = asyncio.run(agents())
    assert store.append_commits == commits + 1
    assert isinstance(outcomes[5], RolloutNotFound) and outcomes[5].rollout_id == "missing"
    assert [e.data["k"] for i, e in enumerate(outcomes) if i != 5] == [k for k in range(64) if k != 5]  # type: ignore[union-attr]
    assert min(on_disk_when_done) == 63  # each awaited append was already committed


def test_a_failure_reaches_exactly_its_caller(store):
    store._db.execute("CREATE TRIGGER poison BEFORE INSERT ON events WHEN NEW.event_type = 'poison' "
                      "BEGIN SELECT RAISE(ABORT, 'disk says no'); END")  # a write the disk refuses
    with store._lock, pytest.raises(NotStorable, match="data"):  # refused before it queues or waits
        store.append_event("r0", "0", "custom", {"x": {2, 3}})  # not JSON
    outcomes = append_in_threads(store, [("r0", "custom", {"n": 0}), ("gone", "custom", {"n": 1}),
                                         ("r1", "poison", {"n": 2}), ("r2", "custom", {"n": 3})])
    ok0, missing, poisoned, ok3 = outcomes
    assert isinstance(missing, RolloutNotFound) and missing.rollout_id == "gone"
    assert isinstance(poisoned, sqlite3.Error) and "disk says no" in str(poisoned)
    assert (ok0.data, ok3.data) == ({"n": 0}, {"n": 3})  # type: ignore[union-attr]
    assert rows_on_disk(store) == [("r0", "custom"), ("r2", "custom")]  # the failed commit left nothing
    assert store.append_event("r1", "0", "custom", {}).rollout_id == "r1"  # the next append is unaffected


def test_appends_renew_the_lease_of_a_running_rollout(store):
    store.patch_status("r0", RolloutStatusPatch(state=RolloutState.RUNNING))
    before = store._activity.get("r0", 0.0)
    asyncio.run(store.append_event_async("r0", "0", "custom", {}))
    assert store._activity["r0"] > before
    assert store.expire_leases(3600) == []


def test_lock_free_reads_see_committed_state_only(store):
    assert store.models_for("m") == []  # cached: the registry is empty
    store.upsert_models([Model(model="m", endpoint="http://a/v1")])
    assert [m.endpoint for m in store.models_for("m")] == ["http://a/v1"]  # the upsert's commit refreshed it
    store.clear_models()
    assert store.models_for("m") == []

    class Boom(Exception):
        pass

    with pytest.raises(Boom), store._lock, store._transaction():  # a transaction that rolls back
        store._replace(store.get_rollout("r0").model_copy(update={"input": {"uncommitted": True}}))
        raise Boom
    assert store.get_rollout("r0").input == {}
    with sqlite3.connect(store.path) as db:
        assert db.execute("SELECT body FROM rollouts WHERE rollout_id='r0'").fetchone()[0].count("uncommitted") == 0


def test_appends_after_close_fail_instead_of_hanging(store):
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        store.append_event("r0", "0", "custom", {})
    with pytest.raises(sqlite3.ProgrammingError):
        asyncio.run(store.append_event_async("r0", "0", "custom", {}))
