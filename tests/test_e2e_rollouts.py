"""End to end: store + gateway + runner + an openai-SDK multi-turn agent + a vLLM-shaped upstream.

16 rollouts of an agent that makes two chat calls (the second carries the first reply and an
observation) run through the Runner and the gateway against the fake upstream registered as
the served model. Every call must appear as a `model_request` event and as a triplet with the
prompt ids the upstream saw and the response ids/logprobs it sampled.
"""

from __future__ import annotations

import httpx
import pytest

from agl_lab.runner import Runner
from tests.agents_for_tests import OBSERVATION, multi_turn_agent
from tests.fakes import chatml_ids, fake_logprobs, reply_for
from tests.servers import wait_terminal

KEY = "e2e-key"
MODEL = "fake/tiny-chat"


@pytest.fixture
def stack(embedded_server, fake_upstream):
    server = embedded_server(key=KEY, default_proxy={"model_name": MODEL})
    fake_upstream.reply = reply_for
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=10) as api:
        api.post("/api/models", json=[{"model": MODEL, "endpoint": fake_upstream.base_url}]).raise_for_status()
        yield server, api, fake_upstream


def run_to_completion(api: httpx.Client, runner: Runner, rollouts: list[dict]) -> list[str]:
    ids = [r["rollout_id"] for r in api.post("/api/rollouts", json=rollouts).json()]
    with runner:
        final = wait_terminal(api, ids, timeout=60)
    assert {rid: st["state"] for rid, st in final.items()} == dict.fromkeys(ids, "succeeded"), final
    return ids


def check_rollout_calls(api: httpx.Client, rid: str, question: str) -> None:
    """Both calls of one rollout: raw model_request events and their triplets."""
    calls = api.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    assert len(calls) == 2
    first, second = (c["data"] for c in calls)
    for call in (first, second):
        assert call["http_status"] == 200 and call["status"] == "ok" and call["model"] == MODEL
        req = call["request"]  # the body the gateway sent upstream, after the train-mode rewrite
        assert (req["model"], req["temperature"], req["return_token_ids"], req["logprobs"]) == (MODEL, 1.0, True, True)
    assert first["request"]["messages"][1] == {"role": "user", "content": question}
    assert second["request"]["messages"][2:] == [
        {"role": "assistant", "content": "reply-2"},
        {"role": "user", "content": OBSERVATION},
    ]

    triplets = api.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    assert [t["event_type"] for t in triplets] == ["model_request", "model_request", "reward"]
    for call, triplet, reply in zip((first, second), triplets, ("reply-2", "reply-4")):
        data = triplet["data"]
        assert data["prompt_token_ids"] == chatml_ids(call["request"]["messages"])
        assert data["response_token_ids"] == list(reply.encode())
        assert data["response_log_probs"] == fake_logprobs(len(reply))
        assert data["server"] == {"model": MODEL, "version": 0}
    # the second prompt extends the first prompt + its response: the trajectory merges
    p1, r1 = triplets[0]["data"]["prompt_token_ids"], triplets[0]["data"]["response_token_ids"]
    assert triplets[1]["data"]["prompt_token_ids"][: len(p1) + len(r1)] == p1 + r1
    assert triplets[2]["data"] == {"value": 1.0}


def test_sixteen_multi_turn_rollouts_through_runner_and_gateway(stack):
    server, api, fake = stack
    questions = [f"What is {i} + {i}?" for i in range(16)]
    rollouts = [{"rollout_id": f"e2e-{i:02d}", "input": {"question": q}} for i, q in enumerate(questions)]
    runner = Runner(server.url, key=KEY, agent=multi_turn_agent, concurrency=16)
    ids = run_to_completion(api, runner, rollouts)
    assert runner.stats["succeeded"] == 16 and len(fake.requests) == 32
    assert all(r["json"]["model"] == MODEL for r in fake.requests)
    for rid, question in zip(ids, questions):
        check_rollout_calls(api, rid, question)


def test_multi_turn_agl_agent_class_in_subprocesses(stack):
    server, api, fake = stack
    questions = [f"Compute {i} * 3." for i in range(4)]
    rollouts = [
        {
            "rollout_id": f"e2e-sub-{i}",
            "input": {"question": q},
            "config": {
                "local": {
                    "agent_class": "tests.agents_for_tests:MultiTurnOpenAIAgent",
                    "env_map": {"T_QUESTION": "input.question"},
                }
            },
        }
        for i, q in enumerate(questions)
    ]
    ids = run_to_completion(api, Runner(server.url, key=KEY, concurrency=4), rollouts)
    assert len(fake.requests) == 8
    for rid, question in zip(ids, questions):
        check_rollout_calls(api, rid, question)
