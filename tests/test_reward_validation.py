"""A reward is a finite float32, else the rollout is FAILED with the reason;
collection never loses a step or deletes what it did not read; failed rollouts can be excluded."""

from __future__ import annotations

import math
import time

import httpx
import numpy as np
import pytest

from agl_lab import batch
from agl_lab.client import AglClient, AglHTTPError
from agl_lab.logger import format_console_line
from agl_lab.protocol import FLOAT32_MAX, Rollout, is_number, reward_problem
from agl_lab.records import CompletedRollout, Triplet
from agl_lab.rollout import SyncRolloutManager
from tests.fake_runner import KEY, FakeRunner, post_call

FAST = dict(poll_interval=0.01, timeout_seconds=30)


@pytest.mark.parametrize(
    "value, why",
    [
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        (-math.inf, "not finite"),
        (1e39, "beyond float32"),
        (-1e39, "beyond float32"),
        (10**400, "beyond float32"),
        ("abc", "not a number"),
        ("0.5", "not a number"),
        ([1], "not a number"),
        (True, "not a number"),
        (None, "not a number"),
        ({"v": 1}, "not a number"),
    ],
)
def test_reward_problem_names_why(value, why):
    assert why in reward_problem(value)


@pytest.mark.parametrize("value", [0, 1, -3, 0.5, 3.4e38, -1e-45, 2**63 - 1, np.float32(0.5), np.int64(2)])
def test_finite_float32_rewards_are_accepted(value):
    assert reward_problem(value) is None


def test_numbers_are_told_apart_without_importing_numpy():
    # protocol.py does not import numpy (the runner checks a returned reward without it), yet a
    # numpy scalar still counts as a number and a numpy bool does not, as bool does not
    assert FLOAT32_MAX == float(np.finfo(np.float32).max)
    assert [is_number(v) for v in (1, 0.5, np.float32(1), np.int8(1))] == [True] * 4
    assert [is_number(v) for v in (True, np.bool_(True), "1", None, 1j)] == [False] * 5
    assert "beyond float32" in reward_problem(np.float64(1e39))


def _reward_agent(values: dict[int, object]):
    def agent(client: AglClient, rollout: Rollout) -> str:
        rid, x = rollout.rollout_id, rollout.input["x"]
        post_call(client, rid, [x, 1], [100], [-0.5])
        client.add_event(rid, "0", "reward", {"value": values[x]})
        return "succeeded"

    return agent


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server(key=KEY, default_proxy={"model_name": "test-model"}, store=store_url)


def test_bad_rewards_fail_their_rollout_with_the_reason(server):
    values = {1: 0.5, 2: "abc", 3: [1], 4: 1e39, 5: 7}
    with AglClient(server.url, key=KEY, backoff_base=0.001) as client, FakeRunner(server.url, _reward_agent(values)):
        manager = SyncRolloutManager(client, n=1, step=0, rollout_config={}, **FAST)
        done = manager.run([{"x": x} for x in values], is_train=True)
    by_x = {c.input["x"]: c for c in done}
    assert by_x[1].state == "succeeded" and by_x[1].final_reward == 0.5
    assert by_x[5].state == "succeeded" and by_x[5].final_reward == 7.0
    for x, why in ((2, "not a number"), (3, "not a number"), (4, "beyond float32")):
        assert by_x[x].state == "failed" and by_x[x].final_reward is None, x
        assert why in by_x[x].error_message and why in by_x[x].metadata["reward_error"]


@pytest.mark.parametrize("text", ['{"value": NaN}', '{"value": Infinity}', '{"value": ' + "9" * 401 + "}"])
def test_rewards_json_cannot_store_are_refused_at_post(server, text):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as c:
        rid = c.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
        r = c.post(
            f"/api/rollouts/{rid}/attempt/0/events",
            content=f'{{"event_type": "reward", "data": {text}}}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422 and "data.value" in r.json()["detail"], r.text


def test_a_rollout_that_cannot_be_built_is_failed_and_kept_not_lost(server, monkeypatch):
    """Fault injection: the builder raises for one rollout; the step still returns all of them."""
    import agl_lab.rollout as rollout_mod

    real = rollout_mod.events_to_completed_rollout

    def flaky(rollout, raw, trip, **kw):
        if raw and rollout.input["x"] == 2:
            raise OverflowError("int too large to convert to float")
        return real(rollout, raw, trip, **kw)

    monkeypatch.setattr(rollout_mod, "events_to_completed_rollout", flaky)
    values = {1: 1.0, 2: 1.0, 3: 1.0}
    with AglClient(server.url, key=KEY, backoff_base=0.001) as client, FakeRunner(server.url, _reward_agent(values)):
        manager = SyncRolloutManager(client, n=1, step=0, rollout_config={}, **FAST)
        done = manager.run([{"x": x} for x in values], is_train=True)
        by_x = {c.input["x"]: c for c in done}
        assert [by_x[x].state for x in (1, 2, 3)] == ["succeeded", "failed", "succeeded"]
        assert "OverflowError" in by_x[2].error_message and manager._collector.n_build_errors == 1
        kept, _ = client.get_rollout(by_x[2].rollout_id)  # not deleted: it was never fully read
        assert kept.rollout_id == by_x[2].rollout_id
        with pytest.raises(AglHTTPError, match="404"):
            client.get_rollout(by_x[1].rollout_id)  # read in full, deleted as before


def _completed(rid, state, reward):
    return CompletedRollout(
        rollout_id=rid,
        data_id="d",
        step=0,
        sample_idx=0,
        state=state,
        final_reward=reward,
        triplets=[Triplet([1, 2], [3, 4], [-0.1, -0.1], reward=reward)],
    )


def test_failed_rollouts_train_by_default_and_can_be_excluded():
    rollouts = [_completed("a", "succeeded", 1.0), _completed("b", "failed", None), _completed("c", "failed", None)]
    kwargs = dict(max_prompt_length=8, max_response_length=8, reward_fillna_value=-1.0)
    parity = batch.build_batch(rollouts, **kwargs)
    assert len(parity.data) == 3 and "training/n_failed_rollouts" not in parity.metrics  # the rollout stage's count
    assert parity.metrics["training/n_failed_rollouts_excluded"] == 0
    assert parity.metrics["training/reward"] == pytest.approx((1.0 - 1.0 - 1.0) / 3)
    excluded = batch.build_batch(rollouts, exclude_failed=True, **kwargs)
    assert len(excluded.data) == 1
    assert excluded.metrics["training/n_failed_rollouts_excluded"] == 2
    assert excluded.metrics["training/reward"] == 1.0
    from agl_lab.rollout import report_failures

    assert report_failures(rollouts, step=0, is_train=True) == {
        "training/n_failed_rollouts": 2,
        "training/n_rerun_rollouts": 0,
    }
    assert "failed 2" in format_console_line(1, {**report_failures(rollouts, 0, True), **excluded.metrics})
    with pytest.raises(RuntimeError, match="2 FAILED ones excluded"):
        batch.build_batch(rollouts[1:], exclude_failed=True, **kwargs)


def test_exclude_failed_is_a_config_key():
    from agl_lab.config import AGL_LAB_DEFAULTS

    assert AGL_LAB_DEFAULTS["agl_lab"]["algorithm"]["exclude_failed_rollouts"] is False


@pytest.mark.parametrize(
    "value, why",
    [(1e39, "beyond float32"), (10**400, "beyond float32"), (math.nan, "not finite"), (math.inf, "not finite")],
)
def test_runner_fails_a_callable_that_returns_an_unusable_reward(server, value, why):
    from agl_lab.protocol import RolloutCreate
    from agl_lab.runner import Runner

    with AglClient(server.url, key=KEY) as client:
        client.create_rollouts([RolloutCreate(input={}, rollout_id="big")])
        with Runner(server.url, key=KEY, agent=lambda task, ctx: value, poll_interval=0.02):
            deadline = time.monotonic() + 30
            while client.get_rollout("big")[0].status.state not in ("succeeded", "failed"):
                assert time.monotonic() < deadline, "the runner never finished the rollout"
                time.sleep(0.02)
        status = client.get_rollout("big")[0].status
        assert status.state == "failed" and why in status.error_message
        assert client.get_events("big", event_type="reward") == []
