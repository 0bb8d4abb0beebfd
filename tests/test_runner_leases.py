"""Running rollouts hold a lease (runner heartbeat, events); a dead runner's
rollouts fail with a reason; a timed-out wait fails its rollouts so no runner runs them later."""

from __future__ import annotations

import time

import pytest

from agl_lab.client import AglClient, RolloutWaitTimeout
from agl_lab.protocol import RolloutCreate, RolloutState, RolloutStatusPatch
from agl_lab.rollout import SyncRolloutManager
from agl_lab.runner import Runner
from agl_lab.server.backends import open_store
from tests.conftest import scaled

KEY = "lease-key"


def _state(client, rid):
    return client.get_rollout(rid)[0].status


def _wait_state(client, rid, state, bound=30.0):
    end = time.monotonic() + scaled(bound)
    while time.monotonic() < end:
        status = _state(client, rid)
        if status.state == state:
            return status
        time.sleep(0.05)
    raise AssertionError(f"{rid} never reached {state}: {_state(client, rid)}")


def test_running_rollout_without_a_runner_is_requeued_then_fails_after_max_attempts(embedded_server, store_url):
    server = embedded_server(
        key=KEY, default_proxy={"model_name": "m"}, store=store_url, lease_seconds=0.5, max_attempts=2
    )
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id="orphan"), RolloutCreate(input={}, rollout_id="q")])
        client.patch_status("orphan", state="running", last_attempt_id="0")  # a runner that then crashed
        status = _wait_state(client, "orphan", "queuing")
        assert "attempt 0: lease expired" in status.error_message and "lease_seconds=0.5" in status.error_message
        assert "re-queued as attempt 1 of max_attempts=2" in status.error_message
        claimed = client.claim_rollouts(5, runner_id="also-crashes")
        assert [(r.rollout_id, r.status.last_attempt_id) for r in claimed] == [("orphan", "1"), ("q", "0")]
        status = _wait_state(client, "orphan", "failed")
        assert "attempt 1: lease expired" in status.error_message and "(max_attempts=2)" in status.error_message
        assert _wait_state(client, "q", "queuing").error_message.startswith("attempt 0: lease expired")
        page = client.terminal_page(after=0)
        assert [i.rollout_id for i in page.items] == ["orphan"]


def test_heartbeats_and_events_keep_a_rollout_alive(embedded_server, store_url):
    # a lease 15 times the beat (scaled): a loaded CI machine once stalled this loop past a 0.6 s lease,
    # and a 1 s lease's beats elsewhere (3 s now: a stall under load can reach 1–2 s)
    lease = scaled(3.0)
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url, lease_seconds=lease)
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id=r) for r in ("hb", "ev")])
        for rid in ("hb", "ev"):
            client.patch_status(rid, state="running", last_attempt_id="0")
        end = time.monotonic() + 2.1 * lease  # > 2 leases
        while time.monotonic() < end:
            answer = client.heartbeat(["hb", "nope"])
            assert answer == {"not_running": ["nope"], "lease_seconds": lease}
            client.add_event("ev", "0", "tick", {})
            time.sleep(lease / 15)
        assert _state(client, "hb").state == "running" and _state(client, "ev").state == "running"


def test_runner_heartbeats_keep_long_quiet_agents_running(embedded_server):
    # 3 s leases, scaled (the runner beats every tenth of a lease): at 0.5 s leases beaten every third
    # a loaded CI machine once missed three beats in a row
    lease = scaled(3.0)
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, lease_seconds=lease)

    def quiet_agent(task, ctx):
        time.sleep(2.2 * lease)  # over two leases without an event or a model call
        return 1.0

    with AglClient(server.url, key=KEY) as client, Runner(server.url, key=KEY, agent=quiet_agent, poll_interval=0.02):
        client.create_rollouts([RolloutCreate(input={}, rollout_id="quiet")])
        status = _wait_state(client, "quiet", "succeeded")
        assert status.error_message is None


def test_sqlite_running_rollouts_of_a_crashed_server_expire_after_restart(embedded_server, tmp_path):
    url = f"sqlite:///{tmp_path}/crash.db"
    store = open_store(url)
    store.create_rollouts([RolloutCreate(input={}, rollout_id="left")])
    store.patch_status("left", RolloutStatusPatch(state=RolloutState.RUNNING))
    store.close()  # the server "crashed" with the rollout running
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=url, lease_seconds=0.3, max_attempts=1)
    with AglClient(server.url, key=KEY) as client:
        assert "lease expired" in _wait_state(client, "left", "failed").error_message


def test_leases_off(embedded_server):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, lease_seconds=0)
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id="forever")])
        client.patch_status("forever", state="running")
        time.sleep(0.5)  # a sweep with a 0 s lease would have failed it at once
        assert _state(client, "forever").state == "running"
        assert client.heartbeat(["forever"]) == {"not_running": [], "lease_seconds": 0.0}


def test_timed_out_wait_drops_its_unfinished_rollouts_and_a_later_runner_runs_none(embedded_server, store_url):
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"}, store=store_url)
    ran = []
    with AglClient(server.url, key=KEY) as client:
        manager = SyncRolloutManager(client, n=2, step=0, rollout_config={}, timeout_seconds=0.3, poll_interval=0.02)
        with pytest.raises(RolloutWaitTimeout) as info:  # nothing finished: nothing to train
            manager.run([{"q": 1}], is_train=True)
        ids = sorted(info.value.unfinished)
        assert len(ids) == 2 and set(info.value.unfinished.values()) == {"queuing"}
        for rid in ids:
            status = _state(client, rid)
            assert status.state == "failed" and "wait for this rollout timed out after 0.3s" in status.error_message
        with Runner(server.url, key=KEY, agent=lambda task, ctx: ran.append(task), poll_interval=0.02):
            time.sleep(0.5)
    assert ran == []


def test_client_heartbeat_and_fail(embedded_server):
    from agl_lab.client import AglClient

    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id="a1")])
        client.patch_status("a1", state="running")
        assert client.heartbeat(["a1"])["not_running"] == []
        assert client.fail_rollouts(["a1", "gone"], "stop") == ["a1"]
        status = client.get_rollout("a1")[0].status
    assert status.state == "failed" and status.error_message == "stop"


def test_async_carry_over_and_hooks_see_a_requeued_rollout_finish_once(embedded_server, store_url):
    """A dead runner's claim (no heartbeat) is re-queued as attempt 1, run by a live runner,
    collected once across carry-over steps; its hook runs once and reads attempt 1 only."""
    from agl_lab.hooks import RolloutHooks
    from agl_lab.rollout import AsyncRolloutManager

    class Hooks(RolloutHooks):
        def __init__(self):
            self.seen: list[tuple[str, tuple[str, ...]]] = []

        def on_succeeded(self, rollout, events_by_attempt, writer):
            self.seen.append((rollout.rollout_id, tuple(sorted(events_by_attempt))))

    server = embedded_server(  # the live runner beats every tenth of the lease: it keeps its claims (3 s: under
        key=KEY, default_proxy={"model_name": "m"}, store=store_url, lease_seconds=scaled(3.0), max_attempts=2
    )  # load a 1 s lease once expired a live claim too)
    hooks = Hooks()

    ran: list[tuple[str, str]] = []  # (rollout, attempt) as the live runner ran them

    def agent(task, ctx):
        ran.append((ctx.rollout_id, ctx.attempt_id))
        ctx.emit("ran", {"attempt": ctx.attempt_id})
        return 1.0

    with AglClient(server.url, key=KEY) as client:
        manager = AsyncRolloutManager(
            client,
            n=2,
            train_batch_size=1,
            async_train_batch_size=2,
            rollout_config={},
            hooks=hooks,
            timeout_seconds=60,
            poll_interval=0.02,
        )
        dead = AglClient(server.url, key=KEY)
        real_create = client.create_rollouts

        live = Runner(server.url, key=KEY, agent=agent, poll_interval=0.02)

        def create_then_die(requests):  # a runner grabs the first rollout and dies with it, then
            out = real_create(requests)  # the live runner starts
            if live._thread is None:
                (victim,) = dead.claim_rollouts(1, runner_id="dies")
                victims.append(victim.rollout_id)
                dead.add_event(victim.rollout_id, "0", "ran", {"attempt": "0"})
                live.start()
            return out

        client.create_rollouts = create_then_die
        trained, victims = [], []
        try:
            step, end = 0, time.monotonic() + 30
            while time.monotonic() < end:  # until the victim's group, carried over while it waits, trained
                if victims and victims[0] in {c.rollout_id for c in trained}:
                    break
                step += 1
                tasks = [{"i": step * 10 + k} for k in range(manager.n_new_tasks_needed())]
                done, _ = manager.run(tasks, step=step)
                trained += done
        finally:
            live.stop()
            dead.close()
    ids = [c.rollout_id for c in trained]
    assert victims[0] in ids and len(ids) == len(set(ids)) and all(c.state == "succeeded" for c in trained)
    carried_finished = sum(len(g.finished) for g in manager._groups.values())
    assert len(hooks.seen) == len(ids) + carried_finished  # hooks: the trained and the carried finished ones
    assert sorted(rid for rid, _ in hooks.seen) == sorted(set(rid for rid, _ in hooks.seen))  # once each
    assert dict(hooks.seen)[victims[0]] == ("1",)  # the victim: its attempt 1 only
    # the ones that ran twice: the victim, and on a loaded machine perhaps a live claim whose beat came
    # late (CI once saw the sweep re-queue two); each hook read its rollout's last attempt only
    seen = {rid for rid, _ in hooks.seen}
    assert {rid for rid, attempts in hooks.seen if attempts == ("1",)} == {
        rid for rid, attempt in ran if attempt == "1" and rid in seen
    }
    assert all(attempts in {("0",), ("1",)} for _, attempts in hooks.seen)
