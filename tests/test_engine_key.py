"""The engine's OpenAI server beyond loopback requires a key; the gateway holds it and sends it.

Real HTTP with the tiny model: the engine binds a non-loopback address of this machine (its
default-route address; a wildcard bind, dialled on loopback, where the machine has none), a
call without the key answers 401, and a call proxied by a gateway given the key works.
"""

from __future__ import annotations

import argparse

import httpx
import pytest

from agl_lab.addresses import ENGINE_KEY_ENV, engine_key, is_loopback, machine_address
from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.server.embedded import _parser, serve_config

KEY, ENGINE_KEY = "admin-key", "engine-key-123"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def beyond_loopback_engine():
    """(engine, the base URL to dial): bound to this machine's own non-loopback address."""
    address = machine_address()
    bind = "0.0.0.0" if is_loopback(address) else address
    model, tok = load_model_and_tokenizer(device="cpu")
    server = OpenAIServer(model, tok, host=bind, max_model_len=512, api_key=ENGINE_KEY)
    dial = "127.0.0.1" if bind == "0.0.0.0" else address
    yield server, f"http://{dial}:{server.port}/v1"
    server.stop()


def test_engine_beyond_loopback_refuses_calls_without_its_key(beyond_loopback_engine):
    _, url = beyond_loopback_engine
    body = {"model": "agl-lab-tiny", "messages": MESSAGES, "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = http.post(url + "/chat/completions", json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert ENGINE_KEY_ENV in r.json()["error"]["message"]
        assert http.get(url + "/models").status_code == 401
        assert http.get(url.removesuffix("/v1") + "/health").status_code == 200  # liveness stays open
        ok = http.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {ENGINE_KEY}"})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("client", ["raw", "httpx", "aiohttp"])
def test_gateway_sends_the_engine_key_upstream(beyond_loopback_engine, embedded_server, client):
    _, url = beyond_loopback_engine
    server = embedded_server(
        key=KEY, upstream_key=ENGINE_KEY, upstream_client=client, default_proxy={"model_name": "agl-lab-tiny"}
    )
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=60) as api:
        api.post("/api/models", json=[{"model": "agl-lab-tiny", "endpoint": url}]).raise_for_status()
        api.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {}}]).raise_for_status()
        r = api.post(
            "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions",
            json={"model": "auto", "messages": MESSAGES, "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"]
        (call,) = api.get("/api/rollouts/r1/events", params={"event_type": "model_request"}).json()
        assert call["data"]["http_status"] == 200


def test_a_gateway_without_the_key_gets_the_engines_401(beyond_loopback_engine, embedded_server):
    _, url = beyond_loopback_engine
    server = embedded_server(key=KEY, default_proxy={"model_name": "agl-lab-tiny"})
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False, timeout=60) as api:
        api.post("/api/models", json=[{"model": "agl-lab-tiny", "endpoint": url}]).raise_for_status()
        api.post("/api/rollouts", json=[{"rollout_id": "r1", "input": {}}]).raise_for_status()
        r = api.post(
            "/proxy/rollout/r1/attempt/0/mode/train/openai/v1/chat/completions",
            json={"model": "auto", "messages": MESSAGES, "max_tokens": 2},
        )
        assert r.status_code == 401, r.text


def test_engine_key_is_made_once_beyond_loopback_and_not_on_loopback():
    env: dict[str, str] = {}
    assert engine_key("127.0.0.1", env) == "" and env == {}
    made = engine_key("0.0.0.0", env)
    assert len(made) == 32 and env == {ENGINE_KEY_ENV: made}
    assert engine_key("10.1.2.3", env) == made  # the same key for every server of this process
    assert engine_key("127.0.0.1", {ENGINE_KEY_ENV: "set"}) == ""  # loopback asks for none


def test_serve_reads_the_engine_key_from_env_or_file(tmp_path):
    args = _parser().parse_args([])
    assert serve_config(args, {ENGINE_KEY_ENV: "from-env"}).upstream_key == "from-env"
    key_file = tmp_path / "engine.key"
    key_file.write_text("from-file\n")
    args = _parser().parse_args(["--engine-key-file", str(key_file)])
    assert serve_config(args, {ENGINE_KEY_ENV: "from-env"}).upstream_key == "from-file"
    with pytest.raises(SystemExit, match="--engine-key-file"):
        serve_config(_parser().parse_args(["--engine-key-file", str(tmp_path / "missing")]), {})
    assert isinstance(args, argparse.Namespace)
