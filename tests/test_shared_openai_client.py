"""`agent.shared_openai_client` (#51 item 2): each rollout's `openai.OpenAI` is bound to its own
URL and token, yet all share the process's one HTTP pool — checked on a real loopback server that
records which path and token each call arrived with, from concurrent agent threads."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agl_lab.agent import AgentContext, shared_openai_client
from agl_lab.protocol import Rollout, RolloutLifecycleStatus
from agl_lab.tasks.lookup import openai_client


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, self.headers.get("Authorization", "")))
        body = json.dumps(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _context(server: str, rid: str) -> AgentContext:
    status = RolloutLifecycleStatus(state="running", created_at=1.0, updated_at=1.0, last_attempt_id="0")
    return AgentContext.of(Rollout(rollout_id=rid, input={}, status=status), server, key="server-key")


def test_rollout_clients_keep_their_url_and_token_and_share_one_pool(upstream):
    contexts = [_context(upstream, f"r{i}") for i in range(6)]
    clients: dict[str, object] = {}

    def agent(ctx: AgentContext) -> None:  # as the runner runs it: a thread per rollout
        client = clients[ctx.rollout_id] = ctx.openai_client(max_retries=0, timeout=10)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": ctx.rollout_id}])

    threads = [threading.Thread(target=agent, args=(ctx,)) for ctx in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = {
        (ctx.base_url.removeprefix(upstream) + "/chat/completions", f"Bearer {ctx.api_key}") for ctx in contexts
    }
    assert set(_Recorder.seen) == expected and len(_Recorder.seen) == 6
    assert len({id(c._client) for c in clients.values()}) == 1  # one httpx pool for every rollout
    assert {c.max_retries for c in clients.values()} == {0} and {c.timeout for c in clients.values()} == {10}


def test_a_context_without_its_own_factory_gets_the_shared_pool(upstream):
    class Bare:  # an AGL-style context: only the URL and the key
        base_url, api_key = upstream + "/v1", ""

    client = openai_client(Bare())
    assert str(client.base_url) == upstream + "/v1/" and client.api_key == "EMPTY"
    assert client._client is shared_openai_client(upstream, "x")._client


def test_the_agents_client_outwaits_the_gateways_bound_on_a_call():
    # the gateway answers first (504 naming its limits); the agent never resends a call in progress
    from agl_lab.agent import AGENT_CALL_TIMEOUT_SECONDS
    from agl_lab.server.config import ServerConfig

    assert AGENT_CALL_TIMEOUT_SECONDS > ServerConfig().upstream_call_deadline_seconds
    import inspect

    assert inspect.signature(AgentContext.openai_client).parameters["timeout"].default == AGENT_CALL_TIMEOUT_SECONDS
    client = shared_openai_client("http://127.0.0.1:9/v1", "k", timeout=AGENT_CALL_TIMEOUT_SECONDS)
    assert client.timeout == AGENT_CALL_TIMEOUT_SECONDS
