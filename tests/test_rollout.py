"""Rollout managers over HTTP (the pure events -> CompletedRollout reduction: test_records.py).

The managers run against a real server on loopback; `FakeRunner` plays runner + agent in a
thread: it claims queued rollouts, writes `model_request` events in the gateway's format and
a reward, and finishes them — so every HTTP path of the managers runs for real.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from agl_lab.client import AglClient, AglHTTPError, RolloutWaitTimeout
from agl_lab.hooks import RolloutHooks
from agl_lab.protocol import Rollout
from agl_lab.records import CompletedRollout, lifecycle_metrics
from agl_lab.rollout import AsyncRolloutManager, SyncRolloutManager
from agl_lab.server.embedded import EmbeddedServer
from tests.conftest import scaled
from tests.fake_runner import KEY, FakeRunner, post_call, reward_of

FAST = dict(poll_interval=0.01, timeout_seconds=30)


# =============================================================================================
# A real server, a fake runner
# =============================================================================================


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(key=KEY, default_proxy={"model_name": "test-model"}) as srv:
        yield srv


@pytest.fixture
def client(server):
    with AglClient(server.url, key=KEY, backoff_base=0.001) as c:
        yield c


def tasks(*names: str, **extra) -> list[dict]:
    return [{"name": name, "x": int(name[1:]), **extra} for name in names]


def test_a_tasks_own_data_id_is_kept_intact(server, client):
    """The group key lives in metadata.group_id; a task's own `data_id` field reaches the agent."""
    manager = SyncRolloutManager(client, n=2, step=0, rollout_config={"timeout_seconds": 60}, **FAST)
    with FakeRunner(server.url):
        completed = manager.run(tasks("t0", "t1", data_id="dataset-row-7"), is_train=True)
    assert {c.input["data_id"] for c in completed} == {"dataset-row-7"}
    assert len({c.data_id for c in completed}) == 2  # still one fresh group per task
    assert all(c.metadata["group_id"] == c.data_id for c in completed)


def key_of(c: CompletedRollout) -> tuple:
    return (c.input["name"], c.metadata["copy_idx"])


class CountingHooks(RolloutHooks):
    """Counts hook calls per rollout; tags inputs on enqueue."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.n_enqueued = 0

    def on_enqueue(self, request):
        assert request.rollout_id is None  # the id is assigned after the hook
        self.n_enqueued += 1
        request.input = {**request.input, "tagged": True}
        return request

    def on_succeeded(self, rollout, events, store):
        self.calls[("succeeded", rollout.rollout_id)] += 1

    def on_failed(self, rollout, store):
        self.calls[("failed", rollout.rollout_id)] += 1


# =============================================================================================
# SyncRolloutManager
# =============================================================================================


def test_sync_manager_collects_groups_in_order_and_deletes(server, client):
    hooks = CountingHooks()
    manager = SyncRolloutManager(client, n=2, step=4, rollout_config={"timeout_seconds": 60}, hooks=hooks, **FAST)
    with FakeRunner(server.url):
        completed = manager.run(tasks("t0", "t1", "t2"), is_train=True)
    assert [key_of(c) for c in completed] == [(t, k) for t in ("t0", "t1", "t2") for k in (0, 1)]
    assert [c.sample_idx for c in completed] == [0, 0, 1, 1, 2, 2] and {c.step for c in completed} == {4}
    groups = [c.data_id for c in completed]
    assert groups[0] == groups[1] != groups[2] == groups[3] and len(set(groups)) == 3
    assert all(c.metadata["group_id"] == c.data_id and c.input["tagged"] for c in completed)
    assert all("data_id" not in c.input for c in completed)  # the input is the task as sent (AGL)
    for c in completed:
        task, k = c.input, c.metadata["copy_idx"]
        assert c.state == "succeeded" and c.final_reward == pytest.approx(reward_of(task, k))
        assert [t.reward for t in c.triplets] == [None, c.final_reward]
        assert c.triplets[1].prompt_ids == [task["x"], k, 100 + k, 7] and c.triplets[1].logprobs == [-0.25, -0.75]
        assert c.policy_version == 0  # oldest model_version of its calls
        assert c.enqueue_time <= c.running_at + 1e-3 and c.running_at <= c.finished_at
        assert [e["event_type"] for e in c.events] == ["model_request", "model_request", "reward"]
        with pytest.raises(AglHTTPError):  # read, then deleted from the store
            client.get_rollout(c.rollout_id)
    assert hooks.n_enqueued == 6 and set(hooks.calls.values()) == {1} and len(hooks.calls) == 6
    assert lifecycle_metrics(completed)["timing/rollout_total_s/max"] >= 0.0


def test_sync_manager_requests_are_per_poll_and_per_rollout_not_per_rollout_per_poll(server):
    seen: list[tuple[str, str]] = []
    hook = lambda request: seen.append((request.method, request.url.path))  # noqa: E731
    with AglClient(server.url, key=KEY, backoff_base=0.001, event_hooks={"request": [hook]}) as c:
        manager = SyncRolloutManager(c, n=2, step=0, rollout_config={}, hooks=EvaluatorHooks(), **FAST)
        with FakeRunner(server.url):
            completed = manager.run(tasks("t1", "t2", "t3"), is_train=True)
    ids = {x.rollout_id for x in completed}
    per_rollout = Counter()  # (method, path after /api/rollouts/{id}) over our rollouts
    for method, path in seen:
        parts = path.split("/", 4)  # ['', 'api', 'rollouts', id, rest]
        if len(parts) >= 4 and parts[3] in ids:
            per_rollout[(method, "/" + parts[4] if len(parts) == 5 else "")] += 1
    # Each rollout: GET it, GET raw events, (the hook wrote) POST event + GET raw again,
    # GET triplets, DELETE — independent of how many polls the phase took.
    n = len(ids)
    assert per_rollout == Counter(
        {("GET", ""): n, ("GET", "/events"): 3 * n, ("POST", "/attempt/0/events"): n, ("DELETE", ""): n}
    )
    n_polls = seen.count(("GET", "/api/rollouts/terminal")) - 1  # the first one places the cursor
    assert n_polls >= 1 and seen.count(("GET", "/api/rollouts")) <= n_polls  # running list: at most 1 per poll
    assert seen.count(("POST", "/api/rollouts")) == 1


def test_sync_manager_validation_runs_one_rollout_per_task(server, client):
    manager = SyncRolloutManager(client, n=4, step=0, rollout_config=None, **FAST)
    with FakeRunner(server.url):
        completed = manager.run(tasks("t5", "t6"), is_train=False)
    assert [key_of(c) for c in completed] == [("t5", 0), ("t6", 0)]


def test_sync_manager_end_to_end_parity_through_the_server(server, client):
    def agent(c: AglClient, r: Rollout) -> str:
        rid = r.rollout_id
        c.add_event(
            rid,
            "0",
            "model_request",
            {"response": {"error": {"message": "too long"}}, "http_status": 400, "status": "error"},
        )
        post_call(c, rid, [9], [], [])
        post_call(c, rid, [1], [2], [-0.1], version=3)
        c.add_event(rid, "0", "reward", {"value": 1.0})
        return "succeeded"

    manager = SyncRolloutManager(client, n=1, step=0, rollout_config={}, **FAST)
    with FakeRunner(server.url, agent=agent):
        (completed,) = manager.run(tasks("t1"), is_train=True)
    (t,) = completed.triplets
    assert (t.prompt_ids, t.response_ids, t.logprobs, t.reward) == ([1], [2], [-0.1], 1.0)
    assert completed.final_reward == 1.0 and completed.policy_version == 0


class EvaluatorHooks(RolloutHooks):
    """Supplies rewards from the trainer side: 0.5 per model call, -1 for failures."""

    def on_succeeded(self, rollout, events, store):
        ((attempt, evs),) = events.items()
        n_calls = sum(e.event_type == "model_request" for e in evs)
        store.add_event(rollout.rollout_id, attempt, "reward", {"value": 0.5 * n_calls, "source": "evaluator"})

    def on_failed(self, rollout, store):
        store.add_event(rollout.rollout_id, "0", "reward", {"value": -1.0, "source": "fallback"})


def test_hook_written_reward_is_seen_by_the_completed_rollout(server, client):
    manager = SyncRolloutManager(client, n=1, step=0, rollout_config={}, hooks=EvaluatorHooks(), **FAST)
    with FakeRunner(server.url):
        ok, bad = manager.run(tasks("t1") + tasks("t2", fail=True), is_train=True)
    assert ok.final_reward == 1.0 and ok.triplets[-1].reward == 1.0  # 2 calls x 0.5 (last reward wins)
    assert ok.events[-1]["data"]["source"] == "evaluator"
    assert bad.state == "failed" and bad.error_message == "agent gave up" and bad.final_reward == -1.0
    assert bad.triplet_events[-1]["data"] == {"value": -1.0, "source": "fallback"}


class RaisingHooks(RolloutHooks):
    def on_succeeded(self, rollout, events, store):
        store.add_event(rollout.rollout_id, "0", "reward", {"value": 99.0})
        if rollout.input["name"] == "t2":
            raise RuntimeError("evaluator crashed")


def test_hook_that_raises_does_not_stop_the_phase_and_its_events_are_dropped(server, client):
    manager = SyncRolloutManager(client, n=1, step=0, rollout_config={}, hooks=RaisingHooks(), **FAST)
    with (
        FakeRunner(server.url),
        pytest.warns(RuntimeWarning, match="RolloutManager: on_succeeded hook failed for rollout"),
    ):
        fine, crashed = manager.run(tasks("t1", "t2"), is_train=True)
    assert fine.final_reward == 99.0 and "hook_error" not in fine.metadata
    assert crashed.final_reward == pytest.approx(reward_of({"x": 2}, 0))  # the agent's, not 99
    assert [e["data"].get("value") for e in crashed.events if e["event_type"] == "reward"] == [pytest.approx(0.2)]
    assert crashed.metadata["hook_error"] == "on_succeeded: RuntimeError: evaluator crashed"
    assert manager.n_hook_errors == 1


def test_sync_timeout_keeps_and_returns_what_finished_and_drops_the_rest(server, client):
    # t8 is held for ever; t7 must finish inside the timeout, so the timeout leaves room for a loaded machine
    manager = SyncRolloutManager(client, n=2, step=0, rollout_config={}, poll_interval=0.01, timeout_seconds=5.0)
    metrics: dict = {}
    with FakeRunner(server.url, hold={"t8"}), pytest.warns(RuntimeWarning) as warned:
        kept = manager.run(tasks("t7", "t8"), is_train=True, metrics=metrics)
    assert [c.input["name"] for c in kept] == ["t7", "t7"] and all(c.state == "succeeded" for c in kept)
    assert metrics == {"training/n_wait_timeout_dropped_rollouts": 2.0}
    message = str(warned[0].message)
    assert "training on the 2 rollouts that finished and dropping 2 unfinished (2 queuing" in message
    assert "raise agl_lab.rollout.wait_timeout_seconds (now 5)" in message
    assert client.list_rollouts(["queuing", "running", "succeeded", "failed"]) == []  # dropped ones deleted


def test_sync_timeout_with_nothing_finished_names_unfinished_rollouts_and_states(server, client):
    manager = SyncRolloutManager(client, n=2, step=0, rollout_config={}, poll_interval=0.01, timeout_seconds=0.5)
    with FakeRunner(server.url, hold={"t8"}), pytest.raises(RolloutWaitTimeout) as err:
        manager.run(tasks("t8"), is_train=True)
    unfinished = err.value.unfinished
    assert len(unfinished) == 2 and set(unfinished.values()) == {"queuing"}
    for rid in unfinished:
        assert client.get_rollout(rid)[0].input["name"] == "t8" and f"{rid} (queuing)" in str(err.value)
        client.delete_rollout(rid)
    assert "2 of 2 rollouts" in str(err.value)


def test_bad_arguments_name_the_key(client):
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.n"):
        SyncRolloutManager(client, n=0, step=0, rollout_config={})
    with pytest.raises(ValueError, match="timeout_seconds"):
        SyncRolloutManager(client, n=1, step=0, rollout_config={"timeout_seconds": "soon"})
    manager = SyncRolloutManager(client, n=1, step=0, rollout_config={})
    with pytest.raises(TypeError, match="task 1 must be a dict"):
        manager.run([{"a": 1}, "not a row"], is_train=True)


# =============================================================================================
# AsyncRolloutManager
# =============================================================================================


@pytest.mark.parametrize(
    "async_size, match",
    [
        (None, r"agentlightning.async_rollout.async_train_batch_size \(None\) must be an int > data.train_batch_size"),
        (2, r"agentlightning.async_rollout.async_train_batch_size \(2\) must be an int > data.train_batch_size \(2\)"),
        (1, r"async_train_batch_size \(1\) must be"),
        ("3", r"async_train_batch_size \('3'\) must be an int"),
    ],
)
def test_async_sizes_are_validated(client, async_size, match):
    with pytest.raises(ValueError, match=match):
        AsyncRolloutManager(client, n=2, train_batch_size=2, async_train_batch_size=async_size, rollout_config={})


def test_async_carry_over_tops_up_only_the_difference_and_hooks_run_once(server, client):
    hooks, trained = CountingHooks(), []
    manager = AsyncRolloutManager(
        client, n=2, train_batch_size=2, async_train_batch_size=3, rollout_config={}, hooks=hooks, **FAST
    )
    assert manager.n_new_tasks_needed() == 3
    hold = {("t2", 1)}
    # t2's first copy runs first, so it is finished (and its hook run) while its group waits.
    with FakeRunner(server.url, hold=hold, priority=lambda r: 0 if r.input["name"] == "t2" else 1):
        # --- step 1: t2 incomplete -> carried over with its finished member kept
        done, m1 = manager.run(tasks("t0", "t1", "t2"), step=1, policy_version=1)
        trained += done
        assert [key_of(c) for c in done] == [("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1)]
        assert manager.carry_over_groups()[0] | {"data_id": None} == {
            "data_id": None,
            "step": 1,
            "policy_version": 1,
            "n_finished": 1,
            "n": 2,
        }
        assert m1 == {
            "training/async/n_prev_carry_over_rollouts": 0.0,
            "training/async/n_completed_rollouts": 4.0,
            "training/async/n_new_carry_over_rollouts": 2.0,
            "training/async/new_carry_over_age_max_steps": 0.0,
            "training/async/carry_over_age_max_versions": 0.0,
            "training/n_wait_timeout_dropped_rollouts": 0.0,
        }
        assert manager.n_new_tasks_needed() == 2  # only the difference is topped up
        with pytest.raises(ValueError, match="pass n_new_tasks_needed"):
            manager.run(tasks("t3", "t4", "t9"), step=2)
        # --- step 2: t2 finishes; t4 held -> oldest complete groups t2 (step 1), t3 (step 2)
        hold.clear()
        hold.add("t4")
        done, m2 = manager.run(tasks("t3", "t4"), step=2, policy_version=2)
        trained += done
        assert [key_of(c) for c in done] == [("t2", 0), ("t2", 1), ("t3", 0), ("t3", 1)]
        assert [c.step for c in done] == [1, 1, 2, 2] and done[0].enqueue_policy_version == 1
        assert (
            m2["training/async/n_prev_carry_over_rollouts"] == 2.0
            and m2["training/async/n_new_carry_over_rollouts"] == 2.0
        )
        # --- step 3: t4 still held -> carried again, now one step and one version old
        done, m3 = manager.run(tasks("t5", "t6"), step=3, policy_version=3)
        trained += done
        assert [key_of(c)[0] for c in done] == ["t5", "t5", "t6", "t6"]
        assert m3["training/async/new_carry_over_age_max_steps"] == 1.0
        assert m3["training/async/carry_over_age_max_versions"] == 1.0
        # --- checkpoint the carry-over, resume it in a new manager, finish t4 there
        state = json.loads(json.dumps(manager.state_dict()))
        resumed = AsyncRolloutManager(
            client, n=2, train_batch_size=2, async_train_batch_size=3, rollout_config={}, hooks=hooks, **FAST
        )
        resumed.load_state_dict(state)
        assert resumed.carry_over_groups() == manager.carry_over_groups() and resumed.n_new_tasks_needed() == 2
        hold.clear()
        done, m4 = resumed.run(tasks("t7", "t8"), step=4, policy_version=4)
        trained += done
        assert key_of(done[0]) == ("t4", 0) and done[0].step == 2 and len(done) == 4
    # Each rollout's hook ran exactly once, including t2's first copy carried across a step
    # and t4 carried across a checkpoint; nothing was trained twice.
    assert len({c.rollout_id for c in trained}) == len(trained) == 16
    assert all(hooks.calls[("succeeded", c.rollout_id)] == 1 for c in trained)
    assert set(hooks.calls.values()) == {1}


def test_async_timeout_trains_the_members_that_finished_and_hooks_run_once(server, client):
    hooks = CountingHooks()
    manager = AsyncRolloutManager(
        client,
        n=2,
        train_batch_size=2,
        async_train_batch_size=3,
        rollout_config={},
        hooks=hooks,
        poll_interval=0.01,
        timeout_seconds=scaled(5.0),  # t0 twice and t1's first copy must finish inside it on a loaded host
    )
    with FakeRunner(server.url, hold={("t1", 1), "t2"}), pytest.warns(RuntimeWarning, match="dropping 3 unfinished"):
        done, metrics = manager.run(tasks("t0", "t1", "t2"), step=1, policy_version=1)
    # t0 whole, t1 with the copy that finished; t2 had none: gone; nothing carried over
    assert [key_of(c) for c in done] == [("t0", 0), ("t0", 1), ("t1", 0)]
    assert metrics["training/n_wait_timeout_dropped_rollouts"] == 3.0
    assert manager.carry_over_groups() == [] and manager.n_new_tasks_needed() == 3
    assert sorted(rid for (_, rid) in hooks.calls) == sorted(c.rollout_id for c in done)
    assert set(hooks.calls.values()) == {1}
    assert client.list_rollouts(["queuing", "running"]) == []


def test_async_resume_rejects_another_n(client):
    manager = AsyncRolloutManager(client, n=2, train_batch_size=1, async_train_batch_size=2, rollout_config={})
    other = AsyncRolloutManager(client, n=3, train_batch_size=1, async_train_batch_size=2, rollout_config={})
    with pytest.raises(ValueError, match="n=2 .* n=3 .*actor_rollout_ref.rollout.n"):
        other.load_state_dict(manager.state_dict())


def test_async_with_everything_finishing_trains_what_sync_trains(server, client):
    def summary(completed: list[CompletedRollout]) -> list[tuple]:
        return sorted(
            (key_of(c), c.final_reward, [(t.prompt_ids, t.response_ids, t.reward) for t in c.triplets])
            for c in completed
        )

    batch = tasks("t0", "t1", "t2")
    with FakeRunner(server.url):
        sync = SyncRolloutManager(client, n=3, step=1, rollout_config={}, **FAST).run(batch, is_train=True)
        manager = AsyncRolloutManager(
            client, n=3, train_batch_size=3, async_train_batch_size=4, rollout_config={}, **FAST
        )
        done, metrics = manager.run(batch + tasks("t3"), step=1, policy_version=0)
    assert summary(done) == summary(sync) and len(done) == 9
    assert metrics["training/async/n_completed_rollouts"] == 9.0
