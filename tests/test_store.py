"""The store's semantics on every backend (memory, SQLite, PostgreSQL), persistence, the bounded terminal log.

The triplet view the server serves over the store's events is tested in test_records.py."""

from __future__ import annotations

import threading
import time

import pytest

from agl_lab.protocol import Event, Model, RolloutCreate, RolloutState, RolloutStatusPatch
from agl_lab.server.backends import open_store
from agl_lab.server.storable import NotStorable
from agl_lab.server.store import (
    InvalidTransition,
    MemoryStore,
    RolloutNotFound,
    SqliteStore,
)

RUNNING = RolloutStatusPatch(state=RolloutState.RUNNING)
SUCCEEDED = RolloutStatusPatch(state=RolloutState.SUCCEEDED)


@pytest.fixture
def store_url(every_store_url):  # this file runs on every backend: memory, SQLite, PostgreSQL
    return every_store_url


@pytest.fixture
def store(store_url):
    s = open_store(store_url, terminal_log_limit=4)
    yield s
    s.close()


def create(store, rid, **input_):
    return store.create_rollouts([RolloutCreate(rollout_id=rid, input=input_ or {"data_id": rid})])[0]


def finish(store, rid):
    store.patch_status(rid, RUNNING)
    return store.patch_status(rid, SUCCEEDED)


# ---------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store("memory"), MemoryStore)
    s = open_store(f"sqlite:///{tmp_path}/sub/dir/x.db")
    assert isinstance(s, SqliteStore) and (tmp_path / "sub/dir/x.db").exists()
    s.close()
    with pytest.raises(ValueError, match="sqlite:///path/to/store.db' or 'postgresql://"):
        open_store("mysql://x")
    with pytest.raises(ValueError, match="terminal_log_limit must be >= 1"):
        open_store("memory", terminal_log_limit=0)


def test_create_is_idempotent_and_keeps_creation_order(store):
    first = create(store, "a", x=1)
    server_id = store.create_rollouts([RolloutCreate(input=2)])[0]
    assert len(server_id.rollout_id) == 32 and server_id.status.state == "queuing"
    store.patch_status("a", RUNNING)
    again = store.create_rollouts([RolloutCreate(rollout_id="a", input={"x": 99})])[0]
    assert again.input == {"x": 1} and again.status.state == "running"
    assert first.status.created_at == first.status.updated_at
    listed = store.list_rollouts(["queuing", "running"])
    assert [r.rollout_id for r in listed] == ["a", server_id.rollout_id]
    assert [r.rollout_id for r in store.list_rollouts(["running"], limit=1)] == ["a"]
    assert store.list_rollouts(["queuing", "running"], limit=0) == []


def test_patch_transitions_version_and_updated_at(store):
    r = create(store, "a")
    assert store.patch_status("a", RolloutStatusPatch()) == r  # nothing set: unchanged, no bump
    running = store.patch_status("a", RolloutStatusPatch(state="running", k8s_job_name="job-1"))
    assert (running.status.version, running.status.k8s_job_name) == (2, "job-1")
    assert running.status.updated_at >= r.status.updated_at
    with pytest.raises(InvalidTransition, match=r"^Rollout a: cannot transition running -> queuing$"):
        store.patch_status("a", RolloutStatusPatch(state="queuing"))
    with pytest.raises(InvalidTransition, match="running -> running"):
        store.patch_status("a", RUNNING)
    with pytest.raises(InvalidTransition, match="running -> None"):
        store.patch_status("a", RolloutStatusPatch(state=None))
    done = store.patch_status("a", SUCCEEDED)
    # non-state fields can still be patched in a terminal state, and bump the version
    noted = store.patch_status("a", RolloutStatusPatch(error_message="late note"))
    assert (done.status.version, noted.status.version, noted.status.state) == (3, 4, "succeeded")
    assert store.get_rollout("a").status.error_message == "late note"
    create(store, "q")
    with pytest.raises(InvalidTransition, match="queuing -> succeeded"):
        store.patch_status("q", SUCCEEDED)
    with pytest.raises(RolloutNotFound, match="Rollout not found: nope"):
        store.patch_status("nope", RUNNING)


def test_delete_removes_rollout_and_events_but_not_terminal_entry(store):
    create(store, "a")
    store.append_event("a", "0", "reward", {"value": 1.0})
    finish(store, "a")
    store.delete_rollout("a")
    store.delete_rollout("a")  # idempotent
    assert store.get_rollout("a") is None
    with pytest.raises(RolloutNotFound):
        store.events("a")
    page = store.terminal_page()
    assert (page.items, page.next_after, page.total_terminal) == ([], 1, 1)
    create(store, "a")  # re-created: fresh, no events, not listed as terminal while queuing
    assert store.events("a") == [] and store.terminal_page().items == []


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------


def test_events_follow_last_attempt_and_filter(store):
    create(store, "a")
    with pytest.raises(RolloutNotFound):
        store.append_event("zz", "0", "reward", {})
    store.append_event("a", "1", "custom", {"n": 0})
    store.append_event("a", "0", "reward", {"value": 0.5})
    store.append_event("a", "0", "model_request", {"n": 1})
    e = store.append_event("a", "1", "custom", {"n": 2})
    assert isinstance(e, Event) and e.timestamp > 0
    assert store.attempts("a") == ["1", "0"]  # ordered by first event
    assert [x.event_type for x in store.events("a")] == ["reward", "model_request"]  # attempt "0"
    assert [x.data for x in store.events("a", event_type="reward")] == [{"value": 0.5}]
    store.patch_status("a", RolloutStatusPatch(last_attempt_id="1"))
    assert [x.data["n"] for x in store.events("a")] == [0, 2]
    with pytest.raises(TypeError, match="event data must be a dict"):
        store.append_event("a", "0", "reward", [1])  # type: ignore[arg-type]


def test_concurrent_appends_from_threads(store):
    create(store, "a")

    def work(k):
        for i in range(50):
            store.append_event("a", "0", "custom", {"k": k, "i": i})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = store.events("a")
    assert len(events) == 200
    for k in range(4):  # each thread's events keep their relative order
        assert [e.data["i"] for e in events if e.data["k"] == k] == list(range(50))


# ---------------------------------------------------------------------------------------------
# Terminal log (limit 4 in this file's fixture)
# ---------------------------------------------------------------------------------------------


def test_terminal_cursor_window_is_bounded(store):
    for i in range(6):
        create(store, f"r{i}", data_id=f"d{i}")
    for i in [1, 0, 2, 3, 4, 5]:  # completion order differs from creation order
        finish(store, f"r{i}")
    page = store.terminal_page(after=0, limit=3)
    # entries 0 and 1 fell out of the 4-entry window: the cursor restarts at index 2
    assert [it.rollout_id for it in page.items] == ["r2", "r3", "r4"]
    assert (page.next_after, page.total_terminal) == (5, 6)
    page = store.terminal_page(after=page.next_after, limit=3)
    assert [it.data_id for it in page.items] == ["d5"] and page.next_after == 6
    assert store.terminal_page(after=6).model_dump() == {"items": [], "next_after": 6, "total_terminal": 6}
    assert store.terminal_page(after=-5, limit=0).items[0].rollout_id == "r2"  # clamped to 0, 1


def test_sqlite_reopen_keeps_everything(tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.db"
    s = open_store(url, terminal_log_limit=3)
    for i in range(4):
        create(s, f"r{i}", data_id=f"d{i}")
        s.append_event(f"r{i}", "0", "reward", {"value": float(i)})
        finish(s, f"r{i}")
    create(s, "pending")
    s.upsert_models([Model(model="m", endpoint="http://b/v1", version=2), Model(model="m", endpoint="http://a/v1")])
    before = (s.list_rollouts(["queuing", "succeeded"]), s.events("r3"), s.terminal_page())
    s.close()

    s2 = open_store(url, terminal_log_limit=3)
    after = (s2.list_rollouts(["queuing", "succeeded"]), s2.events("r3"), s2.terminal_page())
    assert after == before
    assert [it.rollout_id for it in after[2].items] == ["r1", "r2", "r3"] and after[2].total_terminal == 4
    assert [(m.endpoint, m.version) for m in s2.models_for("m")] == [("http://a/v1", 0), ("http://b/v1", 2)]
    finish(s2, "pending")  # the absolute index continues after a reopen
    assert s2.terminal_page(after=4).items[0].rollout_id == "pending"
    s2.close()
    s3 = open_store(url, terminal_log_limit=1)  # a smaller limit trims at once
    page = s3.terminal_page()
    assert [it.rollout_id for it in page.items] == ["pending"] and page.total_terminal == 5
    s3.close()


def test_model_registry_upsert_sorted_and_clear(store):
    # models_for is cached between model writes: each write must show in the next answer
    assert store.models_for("m") == []
    store.upsert_models([Model(model="m", endpoint="http://z/v1"), Model(model="m", endpoint="http://a/v1")])
    assert [(m.endpoint, m.version) for m in store.models_for("m")] == [("http://a/v1", 0), ("http://z/v1", 0)]
    store.upsert_models([Model(model="m", endpoint="http://z/v1", version=5), Model(model="o", endpoint="http://o")])
    assert [(m.endpoint, m.version) for m in store.models_for("m")] == [("http://a/v1", 0), ("http://z/v1", 5)]
    store.models_for("m").clear()  # the caller's list, not the cache
    assert len(store.models_for("m")) == 2 and len(store.models_for("o")) == 1
    store.clear_models()
    assert store.models_for("m") == [] and store.models_for("o") == []


# ---------------------------------------------------------------------------------------------
# Hot-path storage: SQLite appends committed per call, memory events as JSON bytes
# ---------------------------------------------------------------------------------------------


def _rows_on_disk(path) -> int:
    import sqlite3

    with sqlite3.connect(path) as db:  # another connection: sees committed rows only
        return db.execute("SELECT COUNT(*) FROM events").fetchone()[0]


def test_sqlite_append_is_committed_before_it_returns(tmp_path):
    # an acknowledged event survives a crash: another connection sees it at once, no close needed
    path = tmp_path / "acked.db"
    s = SqliteStore(str(path))
    create(s, "a")
    for i in range(3):
        s.append_event("a", "0", "model_request", {"n": i})
        assert _rows_on_disk(path) == i + 1
    s.close()


def test_sqlite_appends_are_read_deleted_and_reopened_consistently(tmp_path):
    url = f"sqlite:///{tmp_path}/queued.db"
    s = open_store(url)
    create(s, "a"), create(s, "b")
    s.append_event("a", "0", "reward", {"value": 1.0})
    assert [e.data for e in s.events("a")] == [{"value": 1.0}]
    s.append_event("b", "0", "reward", {"value": 2.0})
    s.delete_rollout("b")  # deleted with its rollout
    assert s.append_event("a", "1", "reward", {"value": 3.0}).attempt_id == "1"
    with pytest.raises(RolloutNotFound):
        s.append_event("b", "0", "reward", {})
    s.close()
    s2 = open_store(url)
    assert [e.data for e in s2.events("a", attempt_id="1")] == [{"value": 3.0}]
    assert s2.get_rollout("b") is None and _rows_on_disk(tmp_path / "queued.db") == 2
    s2.close()


def test_sqlite_event_order_survives_deleting_the_newest_rows(tmp_path):
    # events.seq is a plain INTEGER PRIMARY KEY (max + 1): deleting the newest rows may reuse
    # their numbers, which keeps every surviving row before every later one
    s = SqliteStore(str(tmp_path / "order.db"))
    create(s, "a"), create(s, "b")
    s.append_event("a", "0", "reward", {"n": 0})
    s.append_event("b", "0", "reward", {"n": 9})
    s.delete_rollout("b")
    for n in (1, 2):
        s.append_event("a", "0", "reward", {"n": n})
    assert [e.data["n"] for e in s.events("a")] == [0, 1, 2]
    s.close()


def test_sqlite_reads_files_with_text_event_data(tmp_path):
    # files written before event data became a BLOB hold it as TEXT, under AUTOINCREMENT
    import sqlite3

    path = tmp_path / "old.db"
    s = SqliteStore(str(path))
    create(s, "a")
    s.close()
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE events")
        db.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT NOT NULL, "
            "attempt_id TEXT NOT NULL, event_type TEXT NOT NULL, timestamp REAL NOT NULL, data TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO events (rollout_id, attempt_id, event_type, timestamp, data) "
            "VALUES ('a', '0', 'reward', 1.0, '{\"value\": 0.5}')"
        )
    s = SqliteStore(str(path))
    s.append_event("a", "0", "reward", {"value": 1.0})
    assert [e.data for e in s.events("a")] == [{"value": 0.5}, {"value": 1.0}]
    s.close()


def test_memory_event_data_is_a_fresh_copy_and_non_json_data_is_refused():
    s = MemoryStore()
    create(s, "a")
    s.append_event("a", "0", "model_request", {"ids": [1, 2]})
    s.events("a")[0].data["ids"].append(3)  # mutating what a read returned changes nothing stored
    assert s.events("a")[0].data == {"ids": [1, 2]}
    with pytest.raises(NotStorable):  # not JSON: it could never be read back over HTTP
        s.append_event("a", "0", "custom", {"x": {2, 3}})
    assert s.events("a", event_type="custom") == []


# ---------------------------------------------------------------------------------------------
# Claims, attempts, leases, release
# ---------------------------------------------------------------------------------------------

LATER = 10**10  # a `now` long after every lease in these tests


def test_concurrent_claims_hand_each_rollout_to_exactly_one_claimer(store):
    """32 threads claim batches of 1-7 until the queue is empty: disjoint sets whose union is the queue."""
    ids = [f"r{i:04d}" for i in range(600)]
    store.create_rollouts([RolloutCreate(rollout_id=rid, input={}) for rid in ids])
    got: list[list[str]] = [[] for _ in range(32)]
    start, first_round = threading.Barrier(32), threading.Barrier(32)

    def claimer(i: int) -> None:
        start.wait()
        got[i].extend(r.rollout_id for r in store.claim_rollouts(1 + i % 7, runner_id=f"t{i}"))
        first_round.wait()  # 32 claims of ≤ 7 leave most of the 600 for the race that follows
        while claimed := store.claim_rollouts(1 + i % 7, runner_id=f"t{i}"):
            got[i].extend(r.rollout_id for r in claimed)

    import sys

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(32)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the claims interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    flat = [rid for ids_ in got for rid in ids_]
    assert len(flat) == len(set(flat)) == 600 and set(flat) == set(ids)
    assert all(
        got
    )  # every claimer got rollouts (without the first round a loaded machine once let one thread take all)
    for rollout in store.list_rollouts(["running"], limit=1000):
        assert rollout.status.last_attempt_id == "0" and rollout.status.version == 2
    assert store.list_rollouts(["queuing"]) == [] and store.claim_rollouts(5) == []


def test_claim_takes_the_oldest_queued_first_and_skips_the_others(store):
    for rid in ("a", "b", "c", "d"):
        create(store, rid)
    store.patch_status("b", RUNNING)  # claimed the AGL way (PATCH)
    assert [r.rollout_id for r in store.claim_rollouts(2)] == ["a", "c"]
    assert [r.rollout_id for r in store.claim_rollouts(0)] == []
    assert [r.rollout_id for r in store.claim_rollouts(9)] == ["d"]


def test_expired_lease_requeues_as_next_attempt_then_fails_after_max_attempts(store):
    create(store, "r")
    (claimed,) = store.claim_rollouts(1)
    assert claimed.status.last_attempt_id == "0"
    store.append_event("r", "0", "model_request", {"n": 0})
    assert store.expire_leases(60.0, max_attempts=3, now=time.time()) == {}  # active: not expired
    assert store.expire_leases(60.0, max_attempts=3, now=LATER) == {"r": "requeued"}
    status = store.get_rollout("r").status
    assert status.state == "queuing" and status.last_attempt_id == "0"
    assert "attempt 0: lease expired" in status.error_message and "re-queued as attempt 1" in status.error_message
    store.append_event("r", "0", "model_request", {"n": "late"})  # the dead runner's late event: kept
    (again,) = store.claim_rollouts(1)
    assert again.status.last_attempt_id == "1" and again.status.error_message is None
    store.append_event("r", "1", "reward", {"value": 1.0})
    assert [e.data for e in store.events("r")] == [{"value": 1.0}]  # reads follow last_attempt_id
    assert [e.data for e in store.events("r", attempt_id="0")] == [{"n": 0}, {"n": "late"}]
    assert store.attempts("r") == ["0", "1"]
    store.claim_rollouts(1)  # nothing queued: attempt 1 stays
    assert store.expire_leases(60.0, max_attempts=3, now=LATER) == {"r": "requeued"}
    assert store.claim_rollouts(1)[0].status.last_attempt_id == "2"
    assert store.expire_leases(60.0, max_attempts=3, now=LATER) == {"r": "failed"}
    status = store.get_rollout("r").status
    assert status.state == "failed" and "failed after 3 attempt(s) (max_attempts=3)" in status.error_message
    assert [i.rollout_id for i in store.terminal_page().items] == ["r"]  # terminal exactly once
    assert store.expire_leases(60.0, max_attempts=3, now=LATER) == {}


def test_heartbeats_and_events_of_the_running_attempt_renew_its_lease(store):
    for rid in ("hb", "ev", "old"):
        create(store, rid)
    store.claim_rollouts(3)
    store.expire_leases(1.0, max_attempts=2, now=LATER)  # all three re-queued
    store.claim_rollouts(3)  # attempt "1" for each
    time.sleep(0.4)
    renewed_at = time.time()  # the heartbeat and events below come at or after this
    assert store.heartbeat(["hb", "ev", "old", "gone"], ["1", "1", "0", "0"]) == ["old", "gone"]
    store.append_event("ev", "1", "tick")
    store.append_event("old", "0", "tick")  # an old attempt's late event does not keep the new one alive
    with pytest.raises(ValueError, match="attempt_ids has 1 items for 2 rollout_ids"):
        store.heartbeat(["hb", "ev"], ["1"])
    # idle for 0.3 s: only "old", last active at its claim 0.4 s before `renewed_at`. Critical: the
    # sweep's clock is pinned 0.2 s after `renewed_at`; the wall clock could pass the renewals' lease too
    assert store.expire_leases(0.3, max_attempts=2, now=renewed_at + 0.2) == {"old": "failed"}


def test_release_requeues_the_callers_attempt_only(store):
    create(store, "r")
    store.claim_rollouts(1)
    assert store.release_rollouts({"r": "7", "gone": "0"}, "runner x stopped") == []
    assert store.release_rollouts({"r": "0"}, "runner x stopped") == ["r"]
    status = store.get_rollout("r").status
    assert status.state == "queuing" and status.error_message == "attempt 0 released (runner x stopped); re-queued"
    assert store.release_rollouts({"r": "0"}, "again") == []  # queuing: nothing to release
    (again,) = store.claim_rollouts(1)
    assert again.status.last_attempt_id == "1"
    assert store.terminal_page().items == []  # a release is no terminal transition


def test_patch_conditioned_on_an_attempt_applies_only_while_it_runs(store):
    from agl_lab.server.store import StaleAttempt

    create(store, "r")
    store.claim_rollouts(1)
    store.expire_leases(1.0, max_attempts=2, now=LATER)
    with pytest.raises(StaleAttempt, match="attempt 0 is not running"):  # queuing: the old runner's failure
        store.patch_status("r", RolloutStatusPatch(state=RolloutState.FAILED), attempt_id="0")
    store.claim_rollouts(1)
    with pytest.raises(StaleAttempt, match=r"the rollout is running, attempt 1"):
        store.patch_status("r", SUCCEEDED, attempt_id="0")
    assert store.patch_status("r", SUCCEEDED, attempt_id="1").status.state == "succeeded"
    assert [i.rollout_id for i in store.terminal_page().items] == ["r"]


def test_sqlite_requeued_rollouts_and_attempts_survive_reopen(tmp_path):
    url = f"sqlite:///{tmp_path}/attempts.db"
    s = open_store(url)
    s.create_rollouts([RolloutCreate(rollout_id="r", input={})])
    s.claim_rollouts(1)
    s.append_event("r", "0", "e", {"a": 0})
    s.expire_leases(1.0, max_attempts=2, now=LATER)
    s.close()
    s = open_store(url)
    try:
        (again,) = s.claim_rollouts(1)
        assert again.status.last_attempt_id == "1" and s.attempts("r") == ["0"]
    finally:
        s.close()


def test_a_requeued_rollout_cannot_be_claimed_again_under_an_attempt_it_ran(store):
    """AGL clients claim by PATCH running(last_attempt_id="0"): on a re-queued rollout that would
    mix its attempts' events and run it forever; 409 instead, naming the attempt to use."""
    from agl_lab.server.store import ReusedAttempt

    create(store, "r")
    store.patch_status("r", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0"))  # the AGL way
    store.expire_leases(1.0, max_attempts=2, now=LATER)
    with pytest.raises(ReusedAttempt, match="attempt 0 already ran .* claim it as attempt 1"):
        store.patch_status("r", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="0"))
    with pytest.raises(InvalidTransition):  # a 409, like a rollout another runner took first
        store.patch_status("r", RUNNING)
    assert (
        store.patch_status("r", RolloutStatusPatch(state=RolloutState.RUNNING, last_attempt_id="1")).status.state
        == "running"
    )
    assert store.expire_leases(1.0, max_attempts=2, now=LATER) == {"r": "failed"}  # bounded by max_attempts
