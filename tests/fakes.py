"""A fake OpenAI-compatible model server shaped like vLLM with `return_token_ids`.

    fake = FakeOpenAI(reply="ok"); server = fake.serve()   # ThreadedUvicorn on loopback
    base_url = fake.base_url                                 # http://127.0.0.1:PORT/v1
    fake.fail_next(2, status=503)                            # the next 2 calls answer 503
    fake.delay_seconds = 0.5                                 # every call sleeps first
    fake.delay_jitter = 0.5                                  # ... 0.25 to 0.75 s
    fake.gate.clear(); ...; fake.gate.set()                  # calls wait in flight until the gate opens

Answers (any path prefix works, so several "replicas" are `/{name}/v1`):
- POST .../chat/completions: top-level `prompt_token_ids`, `choices[0].token_ids`, and
  `choices[0].logprobs.content[*].logprob` when the request asks for logprobs.
- POST .../completions: per-choice `prompt_token_ids` and `token_ids`, and
  `choices[0].logprobs.token_logprobs` when asked.
Token ids are UTF-8 bytes (of a ChatML rendering for chat), logprob of token k is
-0.01*(k+1); token ids are only returned when `return_token_ids` is true, like vLLM.
Every received request is kept in `requests` as {"path", "json", "headers"}. `reply_for` is a
reply that names the turn (`fake.reply = reply_for`).

The other fakes: tests/fake_runner.py (a runner + agent in a thread), tests/fake_wandb.py (W&B's
module and run), tests/verl_fakes.py (what the verl engine needs GPUs for); hand-built rollouts
and a tiny model are in tests/hand_built.py.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agl_lab.server.embedded import ThreadedUvicorn


def chatml_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The fake's prompt ids for chat: UTF-8 bytes of a ChatML rendering + generation prompt."""
    text = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n" for m in messages)
    return list((text + "<|im_start|>assistant\n").encode())


def fake_logprobs(n: int) -> list[float]:
    return [round(-0.01 * (k + 1), 6) for k in range(n)]


def reply_for(body: dict) -> str:
    """A reply that tells the turns apart: "reply-2" to a first chat call, "reply-4" to the second."""
    return f"reply-{len(body['messages'])}"


class FakeOpenAI:
    def __init__(
        self, reply: str | Callable[[dict[str, Any]], str] = "ok", delay_seconds: float = 0.0, delay_jitter: float = 0.0
    ):
        self.reply = reply
        self.delay_seconds = delay_seconds
        self.delay_jitter = delay_jitter  # each delay is delay_seconds * U(1 - jitter, 1 + jitter)
        self.gate = threading.Event()  # cleared: calls stay in flight until it is set (no race with a delay)
        self.gate.set()
        self.requests: list[dict[str, Any]] = []
        self._script: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self.server: ThreadedUvicorn | None = None
        self.app = self._build_app()

    # --- control ----------------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 500, body: Any = None) -> None:
        """The next `n` calls answer `status` with `body` (default an OpenAI-style error; bytes
        are sent as text/html)."""
        body = body if body is not None else {"error": {"message": f"fake failure {status}", "code": status}}
        with self._lock:
            self._script.extend([(status, body)] * n)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self.requests.clear()
        self.reply, self.delay_seconds, self.delay_jitter = "ok", 0.0, 0.0
        self.gate.set()

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> ThreadedUvicorn:
        self.server = ThreadedUvicorn(self.app, host, port)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def url(self) -> str:
        assert self.server is not None, "call serve() first"
        return self.server.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    # --- the app ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/{prefix:path}/chat/completions")
        async def chat(request: Request, prefix: str) -> JSONResponse:
            return await self._answer(request, "chat/completions")

        @app.post("/{prefix:path}/completions")
        async def completions(request: Request, prefix: str) -> JSONResponse:
            return await self._answer(request, "completions")

        return app

    async def _answer(self, request: Request, kind: str) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append({"path": request.url.path, "json": body, "headers": dict(request.headers)})
            scripted = self._script.popleft() if self._script else None
        if self.delay_seconds:
            await asyncio.sleep(self.delay_seconds * random.uniform(1 - self.delay_jitter, 1 + self.delay_jitter))
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        if scripted is not None:
            status, payload = scripted
            if isinstance(payload, bytes):  # a non-JSON answer (e.g. a proxy's HTML error page)
                return Response(payload, status_code=status, media_type="text/html")
            return JSONResponse(payload, status_code=status)
        reply = self.reply(body) if callable(self.reply) else self.reply
        builder = _chat_response if kind == "chat/completions" else _completion_response
        return JSONResponse(builder(body, reply))


class _Discard(list):
    def append(self, item: Any) -> None:
        pass


def _chat_response(body: dict[str, Any], reply: str) -> dict[str, Any]:
    ids = list(reply.encode())
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
    out: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": body.get("model"),
        "choices": [choice],
    }
    prompt = chatml_ids(body.get("messages") or [])
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
        out["prompt_token_ids"] = prompt
    if body.get("logprobs"):
        choice["logprobs"] = {
            "content": [
                {"token": chr(t), "logprob": lp, "bytes": [t], "top_logprobs": []}
                for t, lp in zip(ids, fake_logprobs(len(ids)))
            ]
        }
    out["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    return out


def _completion_response(body: dict[str, Any], reply: str) -> dict[str, Any]:
    ids = list(reply.encode())
    prompt = body.get("prompt")
    prompt_ids = prompt if isinstance(prompt, list) else list(str(prompt or "").encode())
    choice: dict[str, Any] = {"index": 0, "text": reply, "finish_reason": "length"}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = prompt_ids
    if body.get("logprobs"):
        choice["logprobs"] = {
            "tokens": [chr(t) for t in ids],
            "token_logprobs": fake_logprobs(len(ids)),
            "text_offset": list(range(len(ids))),
            "top_logprobs": None,
        }
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": body.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        },
    }


if __name__ == "__main__":  # python -m tests.fakes --port 9000 [--delay 0.02]: a standalone fake
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each call sleeps (model time)")
    parser.add_argument("--jitter", type=float, default=0.0, help="delay * U(1 - jitter, 1 + jitter)")
    args = parser.parse_args()
    fake = FakeOpenAI(delay_seconds=args.delay, delay_jitter=args.jitter)
    fake.requests = _Discard()  # a long-running fake keeps no request log
    uvicorn.run(fake.app, host=args.host, port=args.port, log_level="warning", access_log=False)


# ---------------------------------------------------------------------------------------------
# An agent driven by hand: a scripted OpenAI-SDK-shaped client and a context around it
# ---------------------------------------------------------------------------------------------


class ScriptedClient:
    """An OpenAI-SDK-shaped client that replies with the given texts in order (no model)."""

    def __init__(self, replies):
        self.replies, self.seen = list(replies), []
        self.chat = self
        self.completions = self

    def create(self, *, messages, **kwargs):
        self.seen.append([dict(m) for m in messages])
        text = self.replies.pop(0)

        class Msg:
            content = text

        class Choice:
            message = Msg()

        class Resp:
            choices = [Choice()]

        return Resp()


class Ctx:
    """An AgentContext stand-in for driving an agent function by hand: the client, and the events it emits."""

    def __init__(self, client):
        self.client, self.events = client, []

    def openai_client(self):
        return self.client

    def emit(self, event_type, data=None):
        self.events.append((event_type, data))
        return {}


class ScriptedToolModel:
    """An OpenAI SDK client and agent context in one, replying from a script of
    (content, [calculator expressions to call]) as SDK objects — what calc's tool loop reads. Each
    call's messages land in `seen` and its options in `options`; the agent's events in `events`.
    Tool call ids are `c<call>_<k>` (`c1_0`: the first call's first tool call)."""

    def __init__(self, replies):
        self.replies, self.seen, self.options, self.events = list(replies), [], [], []
        self.chat = self.completions = self

    def openai_client(self):
        return self

    def emit(self, event_type, data=None):
        self.events.append((event_type, data))

    def create(self, *, messages, **options):
        import json

        from openai.types.chat import ChatCompletion

        self.seen.append([dict(m) for m in messages])
        self.options.append(options)
        content, expressions = self.replies.pop(0)
        calls = [
            {
                "id": f"c{len(self.seen)}_{k}",
                "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": e})},
            }
            for k, e in enumerate(expressions)
        ]
        message = {"role": "assistant", "content": content, "tool_calls": calls or None}
        choice = {"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": message}
        return ChatCompletion.model_validate(
            {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
        )
