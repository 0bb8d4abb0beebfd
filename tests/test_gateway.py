"""The gateway over real loopback HTTP: an agent -> EmbeddedServer -> FakeOpenAI (tests/fakes.py)."""

from __future__ import annotations

import hashlib
import logging
import random
import socket
import threading
import time

import httpx
import pytest

from agl_lab.protocol import Model
from agl_lab.server.gateway import ProxyCall, backoff_seconds, proxy_base_url, rewrite_request, select_server
from tests.fakes import chatml_ids, fake_logprobs

KEY = "test-secret-key"
MESSAGES = [{"role": "user", "content": "What is 1+1?"}]
FAST_RETRIES = {"upstream_backoff_base_seconds": 0.001, "upstream_backoff_max_seconds": 0.004}


@pytest.fixture
def make_gateway(embedded_server, fake_upstream, store_url):
    """make_gateway(**overrides) -> (server, client) with the fake registered for 'test-model'."""

    def make(version: int = 0, **overrides):
        overrides.setdefault("default_proxy", {"model_name": "test-model", "val": {"temperature": 0}})
        server = embedded_server(key=KEY, store=store_url, **{**FAST_RETRIES, **overrides})
        client = httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=30)
        r = client.post(
            "/api/models", json=[{"model": "test-model", "endpoint": fake_upstream.base_url, "version": version}]
        )
        assert r.status_code == 201
        return server, client

    return make


def new_rollout(client, rid="r1", **body):
    r = client.post("/api/rollouts", json=[{"rollout_id": rid, "input": {"data_id": "d"}, **body}])
    assert r.status_code == 201
    return rid


def chat(client, rid="r1", mode="train", path="chat/completions", **body):
    body = {"model": "auto", "messages": MESSAGES, **body}
    return client.post(f"/proxy/rollout/{rid}/attempt/0/mode/{mode}/openai/v1/{path}", json=body)


def events(client, rid="r1", **params):
    return client.get(f"/api/rollouts/{rid}/events", params=params).json()


# ---------------------------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_proxy_chat_completion_rewrites_forwards_and_records(make_gateway, fake_upstream, upstream_client):
    server, client = make_gateway(version=7, upstream_client=upstream_client)
    new_rollout(client)
    r = chat(client, temperature=0.1, max_tokens=5, tools=[])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    sent = fake_upstream.requests[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["json"] == {
        "model": "test-model",
        "messages": MESSAGES,
        "temperature": 1.0,
        "max_tokens": 5,
        "tools": [],
        "return_token_ids": True,
        "logprobs": True,
    }
    [event] = events(client)
    data = event["data"]
    assert event["event_type"] == "model_request" and event["attempt_id"] == "0"
    # AGL's keys, after the gateway's note that it served another temperature than the agent asked for
    assert list(data) == [
        "overridden",
        "model",
        "model_version",
        "request",
        "response",
        "server",
        "latency_ms",
        "http_status",
        "status",
        "retry_count",
        "usage",
        "finish_reason",
    ]
    assert data["overridden"] == {"temperature": {"agent": 0.1, "served": 1.0}}
    assert (data["model"], data["model_version"], data["http_status"], data["status"], data["retry_count"]) == (
        "test-model",
        7,
        200,
        "ok",
        0,
    )
    assert data["request"] == sent["json"] and data["response"] == r.json()
    assert data["server"] == {"model": "test-model", "endpoint": fake_upstream.base_url, "version": 7}
    assert data["finish_reason"] == "stop" and data["usage"]["completion_tokens"] == 2 and data["latency_ms"] > 0
    [trip] = events(client, format="triplet")
    assert trip["data"] == {
        "prompt_token_ids": chatml_ids(MESSAGES),
        "response_token_ids": list(b"ok"),
        "response_log_probs": fake_logprobs(2),
        "server": {"model": "test-model", "version": 7},
        "http_status": 200,
        "status": "ok",
        "overridden": {"temperature": {"agent": 0.1, "served": 1.0}},
    }


def test_val_mode_and_completions_api(make_gateway, fake_upstream):
    server, client = make_gateway()
    new_rollout(client, is_train=False)
    assert chat(client, mode="val", logprobs=False).status_code == 200
    assert fake_upstream.requests[-1]["json"] == {
        "model": "test-model",
        "messages": MESSAGES,
        "temperature": 0.0,
        "return_token_ids": True,
        "logprobs": False,
    }
    r = client.post(
        "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/completions",
        json={"model": "auto", "prompt": "2+2=", "max_tokens": 3},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    trip = events(client, format="triplet")[-1]["data"]
    assert trip["prompt_token_ids"] == list(b"2+2=")  # per choice for the completions API
    assert trip["response_token_ids"] == list(b"ok") and trip["response_log_probs"] == fake_logprobs(2)


def test_include_log_probs_false(make_gateway, fake_upstream):
    server, client = make_gateway(default_proxy={"model_name": "test-model", "include_log_probs": False})
    new_rollout(client)
    chat(client)
    assert "logprobs" not in fake_upstream.requests[-1]["json"]
    assert events(client, format="triplet")[0]["data"]["response_log_probs"] is None


def test_openai_sdk_through_the_gateway(make_gateway, fake_upstream):
    openai = pytest.importorskip("openai")
    server, client = make_gateway()
    new_rollout(client, rid="sdk")
    sdk = openai.OpenAI(
        base_url=proxy_base_url(server.url, "sdk"),
        api_key=KEY,
        max_retries=0,
        http_client=httpx.Client(trust_env=False),
    )
    reply = sdk.chat.completions.create(model="auto", messages=MESSAGES)
    assert reply.choices[0].message.content == "ok"
    assert fake_upstream.requests[-1]["json"]["model"] == "test-model"
    assert len(events(client, rid="sdk")) == 1


def test_upstream_error_is_recorded_and_returned(make_gateway, fake_upstream):
    server, client = make_gateway()
    new_rollout(client)
    error = {"error": {"message": "maximum context length is 32768"}}
    fake_upstream.fail_next(1, status=400, body=error)
    r = chat(client)
    assert (r.status_code, r.json()) == (400, error)
    [trip] = events(client, format="triplet")
    assert trip["data"] == {
        "prompt_token_ids": [],
        "response_token_ids": [],
        "response_log_probs": None,
        "server": {"model": "test-model", "version": 0},
        "http_status": 400,
        "status": "error",
        "error": error["error"],
    }
    assert events(client)[0]["data"]["retry_count"] == 0 and len(fake_upstream.requests) == 1  # 400: no retry


def test_non_json_upstream_answer_counts_as_empty_object(make_gateway, fake_upstream):
    server, client = make_gateway()
    new_rollout(client)
    fake_upstream.fail_next(1, status=404, body=b"<html>not found</html>")
    r = chat(client)
    assert (r.status_code, r.json()) == (404, {})
    data = events(client)[0]["data"]
    assert (data["response"], data["status"], data["usage"], data["finish_reason"]) == ({}, "error", None, None)


def test_upstream_client_choice_is_validated():
    from agl_lab.server.config import load_server_config
    from agl_lab.server.upstream import open_upstream_client

    with pytest.raises(ValueError, match="upstream_client"):
        load_server_config({"upstream_client": "requests"})
    with pytest.raises(ValueError, match="'auto', 'raw', 'aiohttp' or 'httpx'"):
        open_upstream_client("requests", 1.0)


# ---------------------------------------------------------------------------------------------
# Validation order and refusals
# ---------------------------------------------------------------------------------------------


def test_validation_errors(make_gateway, fake_upstream):
    server, client = make_gateway()
    new_rollout(client)
    cases = [
        (chat(client, mode="eval"), 404, "Unsupported proxy mode: eval"),
        (chat(client, path="embeddings"), 404, "Unsupported upstream path: embeddings"),
        (chat(client, rid="ghost"), 404, "Rollout not found: ghost"),
        (chat(client, stream=True), 400, "Streaming responses are not supported"),
    ]
    url = "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"
    cases.append((client.post(url, content=b"{nope"), 400, "Invalid JSON in request body"))
    cases.append((client.post(url, json=[1]), 400, "Request body must be a JSON object, got list"))
    for response, status, detail in cases:
        assert (response.status_code, response.json()) == (status, {"detail": detail})
    client.delete("/api/models")
    r = chat(client)
    assert (r.status_code, r.json()) == (503, {"detail": "No servers available for model 'test-model'"})
    assert fake_upstream.requests == [] and events(client) == []
    assert client.get("/proxy/state").json()["inflight"] == 0
    client.post("/api/models", json=[{"model": "test-model", "endpoint": fake_upstream.base_url}])
    empty = client.post(url)  # an empty body is {}: forwarded with the forced keys only
    assert empty.status_code == 200 and fake_upstream.requests[-1]["json"]["model"] == "test-model"


def test_terminal_rollout_is_refused_and_not_recorded(make_gateway, fake_upstream):
    server, client = make_gateway()
    new_rollout(client)
    client.patch("/api/rollouts/r1", json={"status": {"state": "running"}})
    client.patch("/api/rollouts/r1", json={"status": {"state": "failed"}})
    r = chat(client)
    assert r.status_code == 409 and "r1 is failed" in r.json()["detail"]
    assert fake_upstream.requests == [] and events(client) == []


def test_auth_on_proxy_routes(make_gateway):
    server, client = make_gateway()
    new_rollout(client)
    url = server.url + "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions"
    assert httpx.post(url, json={}, trust_env=False).status_code == 401
    assert httpx.post(url, json={}, headers={"x-api-key": KEY}, trust_env=False).status_code == 200


# ---------------------------------------------------------------------------------------------
# Server pinning, rewrite, backoff (pure pieces)
# ---------------------------------------------------------------------------------------------


def test_select_server_hash_pinning(make_gateway, fake_upstream):
    # 4 endpoints: with 3 (or 5) big- and little-endian agree, since 256 = 1 mod 3 (and mod 5)
    pool = [Model(model="m", endpoint=f"http://h{i}/v1") for i in (2, 0, 3, 1)]
    ordered = [f"http://h{i}/v1" for i in range(4)]
    # golden: sha256("rollout-42")[:8] = ea589e54566f74fd, as a big-endian int mod 4 = 1
    assert select_server(pool, "rollout-42").endpoint == "http://h1/v1"
    for i in range(20):
        digest = hashlib.sha256(f"r{i}".encode()).digest()
        assert select_server(pool, f"r{i}").endpoint == ordered[int.from_bytes(digest[:8], "big") % 4]
    assert len({select_server(pool, f"r{i}").endpoint for i in range(50)}) == 4  # spreads over the pool
    # through HTTP: every turn of a rollout hits the same replica
    server, client = make_gateway()
    client.post(
        "/api/models",
        json=[{"model": "test-model", "endpoint": f"{fake_upstream.url}/replica{i}/v1"} for i in range(3)],
    )
    replicas = [Model(model="test-model", endpoint=fake_upstream.base_url)] + [
        Model(model="test-model", endpoint=f"{fake_upstream.url}/replica{i}/v1") for i in range(3)
    ]
    for rid in ("a", "b", "c", "d"):
        new_rollout(client, rid=rid)
        chat(client, rid=rid)
        chat(client, rid=rid)
        want = select_server(replicas, rid).endpoint.removeprefix(fake_upstream.url) + "/chat/completions"
        assert [q["path"] for q in fake_upstream.requests[-2:]] == [want, want]


def test_rewrite_request_and_backoff():
    from agl_lab.server.config import DefaultProxyConfig

    proxy = DefaultProxyConfig(model_name="m")
    body = {"model": "auto", "messages": [], "n": 2, "temperature": 0.0}
    assert rewrite_request(body, "train", proxy) == {
        "model": "m",
        "messages": [],
        "n": 2,
        "temperature": 1.0,
        "return_token_ids": True,
        "logprobs": True,
    }
    assert rewrite_request(body, "val", proxy)["temperature"] == 0.7 and body["model"] == "auto"
    with pytest.raises(ValueError, match="Unsupported proxy mode: x"):
        rewrite_request(body, "x", proxy)
    rng = random.Random(0)
    for attempt, nominal in enumerate([0.5, 1, 2, 4, 8, 8]):
        delay = backoff_seconds(attempt, 0.5, 8.0, rng)
        assert 0.75 * nominal <= delay <= 1.25 * nominal


# ---------------------------------------------------------------------------------------------
# Retries, timeouts, transport errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, upstream_client", [(503, "aiohttp"), (429, "httpx"), (408, "auto")])
def test_retries_then_succeeds(make_gateway, fake_upstream, caplog, status, upstream_client):
    server, client = make_gateway(upstream_client=upstream_client)
    new_rollout(client)
    fake_upstream.fail_next(2, status=status)
    with caplog.at_level(logging.WARNING, logger="agl_lab.server.gateway"):
        r = chat(client)
    assert r.status_code == 200 and len(fake_upstream.requests) == 3
    data = events(client)[0]["data"]
    assert (data["retry_count"], data["http_status"], data["status"]) == (2, 200, "ok")
    assert caplog.text.count("Retrying upstream request") == 2


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_retries_exhausted_returns_last_answer(make_gateway, fake_upstream, upstream_client):
    server, client = make_gateway(upstream_max_attempts=3, upstream_client=upstream_client)
    new_rollout(client)
    fake_upstream.fail_next(5, status=500)
    r = chat(client)
    assert r.status_code == 500 and len(fake_upstream.requests) == 3
    data = events(client)[0]["data"]
    assert (data["retry_count"], data["http_status"], data["status"]) == (2, 500, "error")


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_timeout_is_504_and_refused_connection_is_503_and_both_are_recorded(
    make_gateway, fake_upstream, upstream_client
):
    # 1 s, not less: after each window the gateway asks the fake (which has no such route) about the
    # call, and httpx bounds that question by the same timeout — a 404 slower than the window (a loaded
    # host, once, at 0.2 s) reads as an engine too busy to answer, so the window is extended
    server, client = make_gateway(
        upstream_timeout_seconds=1.0, upstream_max_attempts=2, upstream_client=upstream_client
    )
    new_rollout(client)
    fake_upstream.delay_seconds = 3.0
    r = chat(client)
    assert r.status_code == 504 and r.json()["detail"] == "Upstream model server timed out"
    assert "upstream_timeout_seconds=1" in r.json()["cause"]
    # both attempts reached the fake (a loaded host may record the second after the gateway gave up on it)
    wait_for(lambda: len(fake_upstream.requests) >= 2)
    assert len(fake_upstream.requests) == 2
    fake_upstream.delay_seconds = 0.0
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    client.delete("/api/models")
    client.post("/api/models", json=[{"model": "test-model", "endpoint": dead}])
    r = chat(client)
    assert r.status_code == 503 and "is down" in r.json()["detail"] and r.headers["retry-after"] == "5"
    recorded = [e["data"] for e in events(client)]
    assert [(d["http_status"], d["status"]) for d in recorded] == [(504, "error"), (503, "error")]
    assert "timed out" in recorded[0]["response"]["error"]["cause"]
    assert client.get("/proxy/state").json()["inflight"] == 0


# ---------------------------------------------------------------------------------------------
# Pause gate and inflight
# ---------------------------------------------------------------------------------------------


def test_proxy_admin_endpoints(make_gateway):
    server, client = make_gateway()
    r = client.post("/proxy/pause", json={"retry_after_seconds": 9, "reason": "scale-down"})
    assert r.json() == {"paused": True, "retry_after_seconds": 9, "reason": "scale-down", "inflight": 0}
    assert client.get("/proxy/state").json()["reason"] == "scale-down"
    assert client.post("/proxy/resume").json() == {
        "paused": False,
        "retry_after_seconds": 9,
        "reason": None,
        "inflight": 0,
    }
    assert client.post("/proxy/pause").json()["retry_after_seconds"] == 5  # no body: defaults


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_pause_gate_under_concurrent_calls(make_gateway, fake_upstream):
    server, client = make_gateway()
    fake_upstream.gate.clear()  # the six calls stay in flight until the pause has been checked
    results: dict[str, int] = {}
    rids = [f"c{i}" for i in range(6)]
    for rid in rids:
        new_rollout(client, rid=rid)

    def agent(rid):
        with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=30) as c:
            results[rid] = chat(c, rid=rid).status_code

    threads = [threading.Thread(target=agent, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    wait_for(lambda: client.get("/proxy/state").json()["inflight"] == 6)
    state = client.post("/proxy/pause", json={"retry_after_seconds": 3, "reason": "update"}).json()
    assert state == {"paused": True, "retry_after_seconds": 3, "reason": "update", "inflight": 6}
    new_rollout(client, rid="late")
    refused = chat(client, rid="late")
    assert refused.status_code == 429 and refused.json() == {"error": "gateway paused", "reason": "update"}
    assert refused.headers["retry-after"] == "3" and refused.headers["x-agl-paused"] == "true"
    fake_upstream.gate.set()
    wait_for(lambda: client.get("/proxy/state").json()["inflight"] == 0)  # in-flight calls drain
    for t in threads:
        t.join()
    assert results == {rid: 200 for rid in rids}
    assert all(len(events(client, rid=rid)) == 1 for rid in rids) and events(client, rid="late") == []
    client.post("/proxy/resume")
    assert chat(client, rid="late").status_code == 200


def test_rollout_deleted_during_call_still_answers(make_gateway, fake_upstream, caplog):
    server, client = make_gateway()
    new_rollout(client)
    fake_upstream.gate.clear()  # the call stays in flight until the rollout is gone
    result = {}
    agent = threading.Thread(
        target=lambda: result.update(
            r=chat(httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=30))
        )
    )
    with caplog.at_level(logging.WARNING, logger="agl_lab.server.gateway"):
        agent.start()
        wait_for(lambda: client.get("/proxy/state").json()["inflight"] == 1)
        assert client.delete("/api/rollouts/r1").status_code == 204
        fake_upstream.gate.set()
        agent.join()
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["message"]["content"] == "ok"
    assert "was deleted while its model call was in flight" in caplog.text


# ---------------------------------------------------------------------------------------------
# Request rewriters (plug-in point of the token-preserving mode)
# ---------------------------------------------------------------------------------------------


def test_request_rewriter_changes_body_and_annotates_event(embedded_server, fake_upstream):
    seen: list[ProxyCall] = []

    async def rewriter(call: ProxyCall) -> None:
        seen.append(call)
        call.request["max_tokens"] = 1
        call.annotations["adjusted_params"] = {"max_tokens": 1}
        call.annotations["model"] = "cannot override"

    server = embedded_server(default_proxy={"model_name": "test-model"}, token_preserving=True, rewriters=[rewriter])
    client = httpx.Client(base_url=server.url, trust_env=False)
    client.post("/api/models", json=[{"model": "test-model", "endpoint": fake_upstream.base_url}])
    new_rollout(client)
    assert chat(client).status_code == 200
    assert fake_upstream.requests[-1]["json"]["max_tokens"] == 1
    data = events(client)[0]["data"]
    assert data["adjusted_params"] == {"max_tokens": 1} and data["model"] == "test-model"
    assert data["request"]["max_tokens"] == 1
    assert seen[0].rollout.rollout_id == "r1" and seen[0].server.endpoint == fake_upstream.base_url


def test_rewriter_reroutes_and_reshapes_the_answer(embedded_server, fake_upstream):
    """What the token-preserving mode does: send prompt ids to /completions, answer in chat shape."""

    def reroute(call: ProxyCall) -> None:
        call.upstream_path = "completions"
        call.upstream_request = {
            "model": call.request["model"],
            "prompt": [1, 2, 3],
            "return_token_ids": True,
            "logprobs": 1,
        }

        def to_chat(payload, status):
            choice = payload["choices"][0]
            return {
                "choices": [
                    {
                        "message": {"role": "assistant", "content": choice["text"]},
                        "token_ids": choice["token_ids"],
                        "finish_reason": "stop",
                    }
                ],
                "prompt_token_ids": choice["prompt_token_ids"],
            }

        call.response_hooks.append(to_chat)

    server = embedded_server(default_proxy={"model_name": "test-model"}, rewriters=[reroute])
    client = httpx.Client(base_url=server.url, trust_env=False)
    client.post("/api/models", json=[{"model": "test-model", "endpoint": fake_upstream.base_url}])
    new_rollout(client)
    r = chat(client)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert fake_upstream.requests[-1]["path"] == "/v1/completions"
    data = events(client)[0]["data"]
    assert data["upstream_path"] == "completions" and data["upstream_request"]["prompt"] == [1, 2, 3]
    assert data["request"]["messages"] == MESSAGES and data["response"] == r.json()
    [trip] = events(client, format="triplet")
    assert (trip["data"]["prompt_token_ids"], trip["data"]["response_token_ids"]) == ([1, 2, 3], list(b"ok"))
