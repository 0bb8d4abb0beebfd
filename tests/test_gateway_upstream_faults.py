"""The gateway under misbehaving model servers and agents, over real loopback HTTP.

A small misbehaving upstream (`Misbehaving`) answers per URL prefix: HTML or invalid JSON with
200, NaN logprobs, a JSON list, an answer nested too deep to store, a dripping body that never
ends, and 503/429 with Retry-After. The gateway must answer 502/503/504 with the cause, record
an error event, bound every call, cancel what an agent abandoned, and fail fast on a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from agl_lab.server.embedded import ThreadedUvicorn, _parser, serve_config
from tests.conftest import scaled
from tests.fakes import FakeOpenAI

KEY = "k"
MESSAGES = [{"role": "user", "content": "hi"}]
FAST = {"upstream_backoff_base_seconds": 0.001, "upstream_backoff_max_seconds": 0.004}
OK_BODY = (
    b'{"choices": [{"message": {"content": "ok"}, "token_ids": [1], "finish_reason": "stop"}], "prompt_token_ids": [2]}'
)


class Misbehaving:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        app = FastAPI()

        @app.post("/{mode}/v1/chat/completions")
        async def chat(mode: str, request: Request) -> Response:
            await request.body()
            with self.lock:
                n = self.calls[mode] = self.calls.get(mode, 0) + 1
            if mode == "html":
                return Response(b"<html>502 Bad Gateway</html>", media_type="text/html")
            if mode == "badjson":
                return Response(b'{"choices": [', media_type="application/json")
            if mode == "nanlogprob":
                return Response(
                    b'{"choices": [{"token_ids": [1], "logprobs": {"content": [{"logprob": NaN}]}}]}',
                    media_type="application/json",
                )
            if mode == "list":
                return Response(b"[1, 2]", media_type="application/json")
            if mode == "deep":
                return Response(
                    b'{"choices": [{"x": ' + b"[" * 150 + b"]" * 150 + b"}]}", media_type="application/json"
                )
            if mode == "drip":

                async def drip():
                    for _ in range(400):
                        yield b" "
                        await asyncio.sleep(0.05)

                return StreamingResponse(drip(), media_type="application/json")
            seconds = mode.removeprefix("retryafter")
            if mode.startswith("retryafter") and (n % 2 == 1 or int(seconds) >= 100):  # odd calls, or always
                return Response(
                    b'{"error": "busy"}',
                    status_code=503,
                    media_type="application/json",
                    headers={"Retry-After": seconds},
                )
            if mode == "slow":
                await asyncio.sleep(0.4)
                return Response(b'{"error": "overloaded"}', status_code=503, media_type="application/json")
            return Response(OK_BODY, media_type="application/json")

        self.server = ThreadedUvicorn(app)

    def endpoint(self, mode: str) -> str:
        return f"{self.server.url}/{mode}/v1"

    def count(self, mode: str) -> int:
        with self.lock:
            return self.calls.get(mode, 0)


@pytest.fixture(scope="module")
def upstream():
    bad = Misbehaving()
    yield bad
    bad.server.stop()


@pytest.fixture
def gateway(embedded_server, store_url):
    def make(endpoint: str, **overrides):
        server = embedded_server(key=KEY, store=store_url, default_proxy={"model_name": "m"}, **{**FAST, **overrides})
        client = httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=60)
        assert client.post("/api/models", json=[{"model": "m", "endpoint": endpoint}]).status_code == 201
        assert client.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {}}]).status_code == 201
        return server, client

    return make


def chat(client, rid="r1", timeout=60.0):
    return client.post(
        f"/proxy/rollout/{rid}/attempt/0/mode/train/openai/v1/chat/completions",
        json={"model": "x", "messages": MESSAGES},
        timeout=timeout,
    )


def recorded(client, rid="r1"):
    return [e["data"] for e in client.get(f"/api/rollouts/{rid}/events").json()]


def _dead_endpoint() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1", port


# -- finding 15: upstream garbage -> 502 + error event -------------------------------------------------


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
@pytest.mark.parametrize(
    "mode, cause",
    [("html", "text/html"), ("badjson", "invalid JSON"), ("nanlogprob", "invalid JSON"), ("list", "not an object")],
)
def test_upstream_garbage_is_502_with_cause_and_an_error_event(gateway, upstream, mode, cause, upstream_client):
    server, client = gateway(upstream.endpoint(mode), upstream_client=upstream_client)
    r = chat(client)
    assert r.status_code == 502, r.text
    assert cause in r.json()["cause"]
    (data,) = recorded(client)
    assert (data["http_status"], data["status"]) == (502, "error")
    assert cause in data["response"]["error"]["cause"]
    (trip,) = client.get("/api/rollouts/r1/events", params={"format": "triplet"}).json()
    assert trip["data"]["status"] == "error"


def test_upstream_answer_too_deep_to_store_is_502_and_store_stays_readable(gateway, upstream):
    server, client = gateway(upstream.endpoint("deep"))
    r = chat(client)
    assert r.status_code == 502 and "nested deeper" in r.json()["cause"], r.text
    (data,) = recorded(client)
    assert data["status"] == "error" and "not recordable" in data["response"]["error"]["message"]
    assert client.get("/api/rollouts/r1/events", params={"format": "triplet"}).status_code == 200


# -- finding 16: a total deadline per call; CLI flags ------------------------------------------------------


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_dripping_upstream_is_cut_by_the_attempt_timeout_and_the_call_deadline(gateway, upstream, upstream_client):
    server, client = gateway(
        upstream.endpoint("drip"),
        upstream_timeout_seconds=0.3,
        upstream_max_attempts=50,
        upstream_call_deadline_seconds=1.0,
        upstream_client=upstream_client,
    )
    before = upstream.count("drip")
    r = chat(client)  # the drip would last 20 s per attempt, 50 attempts
    assert r.status_code == 504, r.text
    assert "upstream_call_deadline_seconds=1" in r.json()["cause"]
    assert upstream.count("drip") - before < 50
    assert recorded(client)[0]["http_status"] == 504


def test_serve_has_flags_for_the_upstream_bounds():
    args = _parser().parse_args(
        [
            "--upstream-timeout",
            "30",
            "--upstream-max-attempts",
            "2",
            "--upstream-call-deadline",
            "90",
            "--upstream-breaker-seconds",
            "0",
        ]
    )
    cfg = serve_config(args)
    assert (
        cfg.upstream_timeout_seconds,
        cfg.upstream_max_attempts,
        cfg.upstream_call_deadline_seconds,
        cfg.upstream_breaker_seconds,
    ) == (30.0, 2, 90.0, 0.0)


def test_serve_has_flags_for_the_request_and_lease_limits():
    args = _parser().parse_args(
        [
            "--lease-seconds",
            "0",
            "--max-body-bytes",
            "1000",
            "--max-batch-items",
            "5",
            "--terminal-log-limit",
            "7",
            "--max-attempts",
            "4",
        ]
    )
    cfg = serve_config(args)
    assert (cfg.lease_seconds, cfg.max_body_bytes, cfg.max_batch_items, cfg.terminal_log_limit) == (0, 1000, 5, 7)
    assert cfg.max_attempts == 4 and serve_config(_parser().parse_args([])).max_attempts == 3
    with pytest.raises(ValueError, match="max_attempts"):
        serve_config(_parser().parse_args(["--max-attempts", "0"]))
    assert serve_config(_parser().parse_args([])).max_body_bytes == 32 * 2**20  # unset: the default
    with pytest.raises(ValueError, match="max_body_bytes"):
        serve_config(_parser().parse_args(["--max-body-bytes", "0"]))


# -- finding 17: the agent disconnects -> its upstream call and retries stop ------------------------------


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_agent_disconnect_cancels_the_upstream_call_and_its_retries(gateway, upstream, upstream_client):
    server, client = gateway(upstream.endpoint("slow"), upstream_max_attempts=20, upstream_client=upstream_client)
    before = upstream.count("slow")
    with pytest.raises(httpx.TimeoutException):
        chat(client, timeout=0.6)  # the agent gives up during the second upstream attempt
    for _ in range(200):  # the gateway notices the hang-up
        if client.get("/proxy/state").json()["inflight"] == 0:
            break
        time.sleep(0.05)
    assert client.get("/proxy/state").json()["inflight"] == 0
    # Critical: an attempt sent just before the hang-up is counted when the upstream's thread reads
    # it, which a loaded machine can delay past `inflight == 0`; let it land, then count
    time.sleep(1.0)
    attempts = upstream.count("slow") - before
    time.sleep(1.0)  # 20 attempts at 0.4 s would still be running
    assert upstream.count("slow") - before == attempts < 20
    data = recorded(client)
    assert data and data[-1]["http_status"] == 499 and "disconnected" in data[-1]["response"]["error"]["cause"]


# -- finding 18: a dead engine fails fast; Retry-After is honoured ----------------------------------------


@pytest.mark.parametrize("upstream_client", ["raw", "aiohttp", "httpx"])
def test_dead_engine_fails_fast_then_recovers(gateway, upstream_client):
    endpoint, port = _dead_endpoint()
    breaker = scaled(4.0)  # the second call must come within it, on a loaded machine too (stalls reach 1–2 s)
    server, client = gateway(
        endpoint, upstream_breaker_seconds=breaker, upstream_max_attempts=6, upstream_client=upstream_client
    )
    first = chat(client)
    assert first.status_code == 503 and "refused the connection" in first.json()["detail"]
    assert first.headers["retry-after"] == str(max(1, round(breaker)))
    second = chat(client)  # inside the breaker window: no connection attempt at all
    assert second.status_code == 503 and "refused a connection recently" in second.json()["detail"]
    assert "start or restart the model server" in second.json()["cause"]
    assert [d["retry_count"] for d in recorded(client)] == [0, 0]
    revived = FakeOpenAI()
    revived.serve(port=port)
    try:
        deadline = time.monotonic() + breaker + scaled(10)
        while True:  # once the breaker closes, the next call probes and succeeds
            r = chat(client)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    finally:
        revived.stop()


def test_breaker_off_retries_refused_connections(gateway):
    endpoint, _ = _dead_endpoint()
    server, client = gateway(endpoint, upstream_breaker_seconds=0, upstream_max_attempts=3)
    r = chat(client)
    assert r.status_code == 502 and r.json()["detail"] == "Upstream model server request failed"


def test_upstream_retry_after_is_honoured(gateway, upstream, caplog):
    server, client = gateway(upstream.endpoint("retryafter1"))
    with caplog.at_level(logging.WARNING, logger="agl_lab.server.gateway"):
        r = chat(client)
    assert r.status_code == 200
    assert "after HTTP 503 (attempt 1/6, sleeping 1.00s)" in caplog.text  # backoff alone: ~0.001 s
    assert recorded(client)[0]["retry_count"] == 1


def test_retry_after_beyond_the_deadline_returns_the_upstream_answer(gateway, upstream):
    server, client = gateway(upstream.endpoint("retryafter120"), upstream_call_deadline_seconds=5)
    r = chat(client)
    assert r.status_code == 503 and r.headers["retry-after"] == "120"
