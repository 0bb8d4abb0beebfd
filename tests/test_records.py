"""Records: the triplet view, events -> CompletedRollout, lifecycle metrics, the rollout order.

All pure (`agl_lab.records`): tested on hand-built events (parity with AGL v1's tests/verl/test_agl_rollout_manager.py, golden
lifecycle numbers). The same events travel over HTTP in test_rollout.py and test_server.py.
"""

from __future__ import annotations

import math

import pytest

from agl_lab.protocol import Event, Rollout, RolloutLifecycleStatus
from agl_lab.records import (
    CompletedRollout,
    Triplet,
    clean_logprobs,
    completed_rollout_from_dict,
    completed_rollout_to_dict,
    critical_path_metrics,
    events_to_completed_rollout,
    extract_log_probs,
    final_reward_from_events,
    lifecycle_metrics,
    sort_rollouts,
    triplet_events,
    triplets_from_events,
)

# =============================================================================================
# Triplet view (what the server answers for format=triplet)
# =============================================================================================


def ev(event_type, data):
    return Event(event_type=event_type, rollout_id="r", attempt_id="0", timestamp=1.0, data=data)


def mr(prompt, response, **extra):
    body = {"prompt_token_ids": prompt, "choices": [{"token_ids": response}]}
    return ev("model_request", {"response": body, "server": {"model": "m", "endpoint": "e", "version": 3}, **extra})


def test_triplet_keeps_last_model_request_per_prompt():
    events = [
        mr([1, 2], [10]),
        ev("reward", {"value": 0.5, "message": "m", "source": "agent"}),
        mr([3, 4], [20]),
        mr([1, 2], [30]),
        ev("custom", {"x": 1}),
    ]
    out = triplet_events(events)
    assert [e.event_type for e in out] == ["reward", "model_request", "model_request", "custom"]
    assert out[0].data == {"value": 0.5, "source": "agent"}
    assert [e.data["prompt_token_ids"] for e in out[1:3]] == [[3, 4], [1, 2]]
    assert [e.data["response_token_ids"] for e in out[1:3]] == [[20], [30]]
    assert out[1].data["server"] == {"model": "m", "version": 3} and out[3].data == {"x": 1}


def test_triplet_shapes_completions_errors_and_legacy_chunks():
    completions = ev(
        "model_request",
        {
            "response": {
                "choices": [{"prompt_token_ids": [7], "token_ids": [8, 9], "logprobs": {"token_logprobs": [-1, -2.5]}}]
            },
            "http_status": 200,
            "status": "ok",
        },
    )
    error = ev("model_request", {"response": {"error": {"message": "too long"}}, "http_status": 400, "status": "error"})
    legacy = ev(
        "model_request",
        {
            "response": [
                {"prompt_token_ids": [5], "choices": [{"token_ids": [1]}]},
                {"choices": [{"token_ids": [2]}]},
                "junk",
            ]
        },
    )
    broken = ev("model_request", {"response": {"choices": ["not a dict"]}})
    out = triplet_events([completions, error, legacy, broken])
    assert out[0].data == {
        "prompt_token_ids": [7],
        "response_token_ids": [8, 9],
        "response_log_probs": [-1.0, -2.5],
        "server": {"model": None, "version": None},
        "http_status": 200,
        "status": "ok",
    }
    # the error and the broken call both have empty prompt ids: only the last of them is kept
    assert [e.data["prompt_token_ids"] for e in out] == [[7], [5], []]
    assert out[1].data["response_token_ids"] == [1, 2] and out[1].data["response_log_probs"] is None
    assert triplet_events([error])[0].data["error"] == {"message": "too long"}


@pytest.mark.parametrize(
    "logprobs, expected",
    [
        ({"content": [{"logprob": -0.5}, {"logprob": "-1"}]}, [-0.5, -1.0]),  # chat schema
        ({"token_logprobs": [-0.25]}, [-0.25]),  # completions schema
        ({"content": [{"logprob": float("nan")}]}, None),
        ({"token_logprobs": [None]}, None),
        ({"content": [{"token": "x"}]}, None),
        ({"content": ["x"]}, None),
        ({"other": 1}, None),
        ("not a dict", None),
        ({"token_logprobs": [float("inf")]}, None),
        ({"token_logprobs": ["abc"]}, None),
    ],
)
def test_extract_log_probs_never_raises(logprobs, expected):
    got = extract_log_probs({"logprobs": logprobs})
    assert got == expected and (got is None or all(math.isfinite(x) for x in got))
    assert extract_log_probs({}) is None


# =============================================================================================
# Events -> CompletedRollout
# =============================================================================================


def _mr(prompt, response, logprobs=None, *, version=0, **extra) -> dict:
    """A model_request event in the server's triplet format."""
    data = {
        "prompt_token_ids": prompt,
        "response_token_ids": response,
        "response_log_probs": logprobs,
        "server": {"model": "test-model", "version": version},
        **extra,
    }
    return {"event_type": "model_request", "rollout_id": "r", "attempt_id": "0", "timestamp": 0.0, "data": data}


def _reward(value) -> dict:
    return {"event_type": "reward", "rollout_id": "r", "attempt_id": "0", "timestamp": 0.0, "data": {"value": value}}


def _rollout(state: str = "succeeded") -> Rollout:
    return Rollout(
        rollout_id="r",
        input={"q": 1},
        status=RolloutLifecycleStatus(state=state, created_at=10.0, updated_at=12.5, error_message=None),
    )


def _build(triplet_events, raw_events=()) -> CompletedRollout:
    return events_to_completed_rollout(_rollout(), list(raw_events), triplet_events, data_id="d", step=3, sample_idx=1)


def test_parity_skips_error_and_empty_model_requests():
    """AGL v1 tests/verl/test_agl_rollout_manager.py, same events, same expectations."""
    events = [
        _mr([], [], http_status=400, status="error", error={"message": "maximum context length"}),
        _mr([1], [], http_status=200, status="ok"),
        _mr([1], [2], [-0.1], version=3, http_status=200, status="ok"),
        _reward(1.0),
    ]
    completed = _build(events)
    assert completed.final_reward == 1.0 and len(completed.triplets) == 1
    (t,) = completed.triplets
    assert (t.prompt_ids, t.response_ids, t.logprobs, t.reward) == ([1], [2], [-0.1], 1.0)
    assert t.metadata == {"server": {"model": "test-model", "version": 3}}
    assert (completed.step, completed.sample_idx, completed.data_id) == (3, 1, "d")
    assert completed.finished_at == 12.5 and completed.state == "succeeded"


def test_the_gateways_timeout_extensions_reach_the_call_row():
    events = triplet_events([mr([1], [2], timeout_extensions=2), mr([3], [4])])
    assert [e.data.get("timeout_extensions") for e in events] == [2, None]  # the triplet view keeps the count
    assert [t.timeout_extensions for t in triplets_from_events([e.model_dump() for e in events])] == [2, 0]
    saved = completed_rollout_to_dict(_build([_mr([1], [2], timeout_extensions=1)]))  # a checkpoint keeps it
    assert completed_rollout_from_dict(saved).triplets[0].timeout_extensions == 1


def test_error_status_alone_or_http_status_alone_skips_the_call():
    events = [_mr([1], [2], status="error"), _mr([3], [4], http_status=502), _mr([5], [6], http_status=200)]
    assert [t.prompt_ids for t in triplets_from_events(events)] == [[5]]


def test_last_reward_wins_and_lands_on_the_last_triplet():
    completed = _build([_mr([1], [2]), _reward(0.2), _mr([1, 2, 3], [4]), _reward(0.9)])
    assert completed.final_reward == 0.9
    assert [t.reward for t in completed.triplets] == [None, 0.9]


@pytest.mark.parametrize("value", [True, "1.0", None, [1.0]])
def test_non_numeric_last_reward_gives_none(value):
    assert final_reward_from_events([_reward(1.0), _reward(value)]) is None


def test_reward_without_triplets_is_kept_on_the_rollout():
    completed = _build([_reward(0.5)])
    assert completed.final_reward == 0.5 and completed.triplets == []


@pytest.mark.parametrize("logprobs", ["bad", [-0.1, "x"], [-0.1, float("nan")], [-0.1], [True, -0.2], None])
def test_malformed_logprobs_become_none(logprobs):
    (t,) = triplets_from_events([_mr([1], [2, 3], logprobs)])
    assert t.logprobs is None and t.response_ids == [2, 3]


def test_clean_logprobs_accepts_ints_and_floats():
    assert clean_logprobs([0, -1.5], 2) == [0.0, -1.5]


def test_policy_version_is_the_oldest_model_version():
    raw = [
        {"event_type": "model_request", "data": {"model_version": 7}},
        {"event_type": "model_request", "data": {"model_version": 5}},
        {"event_type": "model_request", "data": {"model_version": None}},
        {"event_type": "reward", "data": {"value": 1.0, "model_version": 1}},
    ]
    assert _build([], raw).policy_version == 5
    assert _build([], []).policy_version is None


def test_lifecycle_metrics_golden_numbers():
    def c(enqueue, running, finished):
        return CompletedRollout("r", "d", 0, 0, enqueue_time=enqueue, running_at=running, finished_at=finished)

    m = lifecycle_metrics([c(0.0, 1.0, 4.0), c(0.0, 3.0, 4.0), c(1.0, None, 5.0)])
    assert m["timing/rollout_n_missing_running_ts"] == 1
    assert m["timing/rollout_queue_wait_s/mean"] == 2.0 and m["timing/rollout_queue_wait_s/p90"] == pytest.approx(2.8)
    assert m["timing/rollout_run_duration_s/max"] == 3.0 and m["timing/rollout_run_duration_s/p50"] == 2.0
    assert m["timing/rollout_total_s/mean"] == 4.0 and m["timing/rollout_total_s/p90"] == 4.0
    assert lifecycle_metrics([]) == {"timing/rollout_n_missing_running_ts": 0.0}


def test_critical_path_is_the_slowest_rollouts_decode_steps_in_series():
    from tests.hand_built import R, T

    # calc-shaped: call 1 (a tool call) then the answer. A call's first token comes from its prefill,
    # each further one from a decode step: the slowest is r2, (29 - 1) + (48 - 1) = 75 decode steps
    rollouts = [
        R("r1", [T([1, 2], [5] * 25), T([1, 2, 5], [6] * 3)]),  # 24 + 2 = 26
        R("r2", [T([1, 2], [5] * 29), T([1, 2, 5], [6] * 48)]),  # 28 + 47 = 75
        R("r3", [T([1, 2], [7] * 4), T([1, 2, 7], [7])]),  # 3 + 0: a one-token call is its prefill alone
        R("r4", []),  # no call recorded: 0
    ]
    m = critical_path_metrics(rollouts)
    assert m == {
        "rollout/critical_path_decode_steps": 75.0,
        "rollout/critical_path_calls": 2.0,
        "rollout/mean_decode_steps": (26 + 75 + 3 + 0) / 4,
    }
    assert critical_path_metrics(list(reversed(rollouts))) == m  # the order of collection does not matter
    assert critical_path_metrics([]) == {}


# =============================================================================================
# One logprob validator, one rollout order
# =============================================================================================


def test_triplet_view_and_completed_rollout_share_the_logprob_rules():
    """Bools and non-finite values are rejected the same way on both sides of the wire."""
    for bad in ([True, -0.2], [-0.1, float("inf")], [-0.1, None]):
        assert extract_log_probs({"logprobs": {"token_logprobs": bad}}) is None
        assert clean_logprobs(bad, 2) is None
    assert extract_log_probs({"logprobs": {"token_logprobs": [0, -1.5]}}) == clean_logprobs([0, -1.5], 2)


def test_copy_idx_is_a_field_read_from_the_rollout_metadata_and_kept_in_checkpoints():
    rollout = _rollout()
    rollout.metadata = rollout.metadata.model_validate({"copy_idx": 2})
    completed = events_to_completed_rollout(rollout, [], [], data_id="d", step=0, sample_idx=0)
    assert completed.copy_idx == 2
    assert events_to_completed_rollout(rollout, [], [], data_id="d", step=0, sample_idx=0, copy_idx=5).copy_idx == 5
    completed.triplets = [Triplet([1], [2], [-0.5], 1.0)]
    assert completed_rollout_from_dict(completed_rollout_to_dict(completed)) == completed


def test_sort_rollouts_orders_by_step_sample_copy_then_id():
    def c(rid, step, sample, copy):
        return CompletedRollout(rid, "d", step, sample, copy_idx=copy)

    rollouts = [c("a", 1, 0, 0), c("z", 0, 1, 1), c("b", 0, 1, 0), c("y", 0, 0, 1), c("x", 0, 0, 1)]
    assert [r.rollout_id for r in sort_rollouts(rollouts)] == ["x", "y", "b", "z", "a"]
