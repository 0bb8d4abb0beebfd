"""An OpenAI-compatible server for an in-process model that returns token ids and true logprobs.

This is the CPU stand-in for vLLM. The gateway and the batch builder only trust what a
vLLM server with `return_token_ids` returns, so this server speaks the same dialect:

* `POST /v1/chat/completions` — `prompt_token_ids` at the top level, `choices[0].token_ids`,
  `logprobs: true` → `choices[0].logprobs.content[] = {token, logprob, bytes, top_logprobs}`;
* `POST /v1/completions` — prompt as text, token ids, or a list of one of those;
  `prompt_token_ids` and `token_ids` per choice; `logprobs: k` (or `true` = 1) →
  `{tokens, token_logprobs, top_logprobs, text_offset}`;
* `GET /v1/models`, `GET /health`;
* `POST /v1/agl/request_state` / `POST /v1/agl/abort_request` `{"request_id"}`: whether a call the
  gateway tagged (`X-Agl-Request-Id`) is queued or running here, and stopping it (`inflight.py`);
* bound beyond loopback, every route but `/health` requires `Authorization: Bearer <key>`
  (`$AGL_ENGINE_KEY`, or one made at start: `agl_lab.addresses.engine_key`), else 401;
* errors as `{"error": {"message", "type", "param", "code"}}`: 400 for bad requests (naming
  the field and the fix), 503 "generation aborted" for requests ended by `abort()`.

Sampling, batching and the logprob definition live in `scheduler.py`; this module only
validates, renders (chat template → token ids), and shapes responses. Rendering and
tokenizing run in a thread pool, off the event loop, and a prompt whose length in bytes
already proves it longer than the context is refused untokenized (`_TokenFloor`): one agent's
huge prompt holds up no other agent's call. `OpenAIServer` runs
uvicorn on a background thread so a notebook or a test owns a live endpoint in one line:

    server = OpenAIServer(model, tokenizer)          # port=0 → a free port
    openai.OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(...)
    server.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agl_lab.addresses import ENGINE_KEY_ENV, advertised_host, engine_key, is_loopback, url_host
from agl_lab.chat_format import parse_tool_calls
from agl_lab.engines.serving.inflight import InflightCalls
from agl_lab.engines.serving.scheduler import BatchScheduler, GenerationAborted, GenerationResult, SamplingParams
from agl_lab.rules import BATCH_WINDOW_MS, MAX_BATCH_SIZE, MAX_MODEL_LEN
from agl_lab.server.embedded import ThreadedUvicorn
from agl_lab.server.upstream import ABORT_REQUEST_PATH, REQUEST_ID_HEADER, REQUEST_STATE_PATH

PROMPT_WORKERS = 4  # threads that render and tokenize prompts, off the event loop
DEFAULT_MAX_TOKENS = 256  # completion budget when the request names none (capped by the context)
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """An error the client sees as OpenAI-style JSON with HTTP `status`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


# ---------------------------------------------------------------------------------------
# Validation: request JSON → (prompt ids, SamplingParams), with errors naming the field
# ---------------------------------------------------------------------------------------

_NUMBER = (int, float)


def _field(body: dict, name: str, types: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise OpenAIError(
            f"'{name}' must be {what or types[0].__name__}, got {type(value).__name__} {value!r}", param=name
        )
    return value


def _stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise OpenAIError("'stop' must be a string or a list of strings", param="stop")


def _sampling(
    body: dict, prompt_len: int, max_model_len: int, default_max_tokens: int, top_logprobs: int
) -> SamplingParams:
    """Shared sampling fields of both APIs → SamplingParams (context-length checked)."""
    if body.get("stream"):
        raise OpenAIError("Streaming responses are not supported; send 'stream': false", param="stream")
    n = _field(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise OpenAIError(f"only n=1 is supported, got n={n}; send n separate requests", param="n")
    temperature = float(_field(body, "temperature", _NUMBER, 1.0, "a number"))
    if temperature < 0:
        raise OpenAIError(f"'temperature' must be ≥ 0, got {temperature}", param="temperature")
    top_p = float(_field(body, "top_p", _NUMBER, 1.0, "a number"))
    if not 0 < top_p <= 1:
        raise OpenAIError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    seed = _field(body, "seed", (int,), None, "an integer")
    max_tokens = _max_tokens(body, prompt_len, max_model_len, default_max_tokens)
    stop_ids = _field(body, "stop_token_ids", (list,), [], "a list of token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
        raise OpenAIError("'stop_token_ids' must be a list of integer token ids", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=_stop_list(body),
        stop_token_ids=[int(i) for i in stop_ids],
        ignore_eos=bool(body.get("ignore_eos", False)),
        top_logprobs=top_logprobs,
    )


def _text_of(result: Any, body: dict) -> str:
    """The answer's text: cut before a matched stop string, or through it with vLLM's
    `include_stop_str_in_output` (a `</tool_call>` stop must reach the tool-call parser). The
    token ids hold the stop string's tokens either way (as vLLM's)."""
    keep = _field(body, "include_stop_str_in_output", (bool,), False, "true or false")
    return result.text + result.stop_reason if keep and isinstance(result.stop_reason, str) else result.text


def _max_tokens(body: dict, prompt_len: int, max_model_len: int, default_max_tokens: int) -> int:
    """The completion budget: asked (`max_tokens` / `max_completion_tokens`) or what the context leaves."""
    asked = _field(body, "max_completion_tokens", (int,), None, "an integer")
    asked = _field(body, "max_tokens", (int,), asked, "an integer")
    if asked is not None and asked < 1:
        raise OpenAIError(f"'max_tokens' must be ≥ 1, got {asked}", param="max_tokens")
    max_tokens = asked if asked is not None else max(1, min(default_max_tokens, max_model_len - prompt_len))
    if prompt_len + max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens" if asked is not None else "messages",
        )
    return max_tokens


class _TokenFloor:
    """A cheap lower bound on a text's token count, so that an oversize prompt is refused without
    being tokenized (tokenizing 3 MB takes seconds).

    A byte-level BPE tokenizer covers every byte of the (normalized) text with exactly one token,
    and no token covers more bytes than its vocabulary string's UTF-8 length (a byte-level
    vocabulary string has one character per byte, each 1–2 bytes in UTF-8: an over-estimate, so
    the bound stays safe). Hence tokens ≥ ceil(bytes / max_token_bytes). Tokenizers that are not
    byte-level (an unknown token can cover a whole word) get no bound: `floor` returns 0.
    """

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.max_token_bytes = 0
        self._normalizer = None
        try:
            byte_level = backend is not None and '"ByteLevel"' in json.dumps(
                json.loads(backend.to_str()).get("pre_tokenizer")
            )
        except Exception:  # a backend that cannot describe itself: no bound
            byte_level = False
        if byte_level:
            self.max_token_bytes = max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())
            self._normalizer = backend.normalizer  # NFC can shrink a text: bound the normalized text

    def floor(self, text: str) -> int:
        """At least this many tokens encode `text` (0 when the tokenizer gives no bound)."""
        if not self.max_token_bytes:
            return 0
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)


def _check_floor(floor: int, max_model_len: int, param: str, what: str) -> None:
    """Refuse a prompt whose token floor already exceeds the context (before tokenizing it)."""
    if floor >= max_model_len:  # the completion needs at least one token more
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, {what} at least "
            f"{floor} tokens (counted from its length in bytes, not tokenized). "
            "Please reduce the length of the messages or completion.",
            param=param,
        )


def _check_messages(messages: Any) -> list[dict]:
    if messages is None:
        raise OpenAIError("'messages' is required: a list of {'role', 'content'} objects", param="messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list of {'role', 'content'} objects", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise OpenAIError(
                f"messages[{i}].content must be a string, a list of parts, or null", param=f"messages[{i}].content"
            )
    return messages


def _prompt_ids(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """Completions `prompt`: text, token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"'prompt' token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt")
        ids = list(prompt)
    elif prompt is None:
        raise OpenAIError(
            "'prompt' is required: a string, a list of token ids, or a list of one of those", param="prompt"
        )
    else:
        raise OpenAIError(
            "'prompt' must be a string, a list of token ids, or a list of one of those "
            "(batched prompts are not supported; send one request per prompt)",
            param="prompt",
        )
    if not ids:
        raise OpenAIError("'prompt' is empty", param="prompt")
    return ids


# ---------------------------------------------------------------------------------------
# Response shaping (vLLM's `return_token_ids` dialect)
# ---------------------------------------------------------------------------------------


def _usage(prompt_len: int, result: GenerationResult) -> dict[str, int]:
    n = len(result.token_ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


class _TokenText:
    """id → the text of that single token (`decode([id])`, as vLLM reports it), memoised:
    a response with logprobs names every token, and HF's decode costs ~20 µs a call."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, ids: list[int]) -> list[str]:
        cache = self._cache
        for i in ids:
            if i not in cache:
                cache[i] = self.tokenizer.decode([i])
        return [cache[i] for i in ids]


def _chat_logprobs(token_text: _TokenText, result: GenerationResult) -> dict[str, Any]:
    def entry(tok: str, lp: float) -> dict[str, Any]:
        return {"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode("utf-8"))}

    content = []
    for i, (tok, lp) in enumerate(zip(token_text(result.token_ids), result.logprobs)):
        alts = (result.top_logprobs or [[]] * len(result.token_ids))[i]
        top = [entry(s, v) for s, (_, v) in zip(token_text([a for a, _ in alts]), alts)]
        content.append({**entry(tok, lp), "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(token_text: _TokenText, result: GenerationResult) -> dict[str, Any]:
    tokens = token_text(result.token_ids)
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = []
    for i, (tok, lp) in enumerate(zip(tokens, result.logprobs)):
        alts = (result.top_logprobs or [[]] * len(tokens))[i]
        d = {s: max(v, -9999.0) for s, (_, v) in zip(token_text([a for a, _ in alts]), alts)}
        d.setdefault(tok, max(lp, -9999.0))  # the sampled token is always listed
        top.append(d)
    return {
        "tokens": tokens,
        "token_logprobs": [max(lp, -9999.0) for lp in result.logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


# ---------------------------------------------------------------------------------------
# The FastAPI app
# ---------------------------------------------------------------------------------------


class _Handler:
    """Request handlers bound to one scheduler + tokenizer; shared by the app's routes."""

    def __init__(
        self, scheduler: BatchScheduler, tokenizer: Any, model_name: str, max_model_len: int, default_max_tokens: int
    ):
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.model_name, self.max_model_len, self.default_max_tokens = model_name, max_model_len, default_max_tokens
        self.vocab_size = len(tokenizer)
        self.token_text = _TokenText(tokenizer)
        self.token_floor = _TokenFloor(tokenizer)
        # rendering and tokenizing run here, not on the event loop: one rollout's huge prompt must
        # not hold up every other rollout's call (tokenizers release the GIL while they encode)
        self.prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="agl-engine-prompt")
        self.calls = InflightCalls(scheduler)  # tagged requests: asked about and aborted by the gateway

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        future = self.scheduler.submit(prompt_ids, params)
        self.calls.attach(future)
        try:
            return await asyncio.wrap_future(future)
        except GenerationAborted as exc:
            raise OpenAIError(str(exc), status=503, type="ServiceUnavailableError") from exc
        except asyncio.CancelledError:
            if not future.cancelled():
                raise
            raise OpenAIError("generation aborted", status=503, type="ServiceUnavailableError") from None

    def _chat_prompt(self, body: dict) -> tuple[list[int], SamplingParams, Any, bool]:
        """Validate, render and tokenize a chat request (in `prompt_pool`): prompt ids, sampling,
        tools, whether logprobs were asked for. A rendered prompt longer than the context can
        hold in bytes is refused before it is tokenized."""
        messages = _check_messages(body.get("messages"))
        tools = _field(body, "tools", (list,), None, "a list of tool definitions")
        want_logprobs = _field(body, "logprobs", (bool,), False, "a boolean")
        k = _field(body, "top_logprobs", (int,), 0, "an integer")
        if not 0 <= k <= MAX_TOP_LOGPROBS or (k and not want_logprobs):
            raise OpenAIError(
                f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}] and needs 'logprobs': true", param="top_logprobs"
            )
        kwargs = _field(body, "chat_template_kwargs", (dict,), {}, "an object")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                **kwargs,
            )
        except Exception as exc:  # template errors are the request's fault (bad message shape)
            raise OpenAIError(f"could not render 'messages' with the chat template: {exc}", param="messages") from exc
        _check_floor(self.token_floor.floor(text), self.max_model_len, "messages", "the rendered messages are")
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        params = _sampling(body, len(prompt_ids), self.max_model_len, self.default_max_tokens, k)
        return prompt_ids, params, tools, want_logprobs

    def _completion_prompt(self, body: dict) -> list[int]:
        """The completions prompt's ids (in `prompt_pool`; a text too long in bytes refused untokenized)."""
        prompt = body.get("prompt")
        text = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        if isinstance(text, str):
            _check_floor(self.token_floor.floor(text), self.max_model_len, "prompt", "the prompt is")
        return _prompt_ids(prompt, self.tokenizer, self.vocab_size)

    async def chat(self, body: dict) -> dict[str, Any]:
        prompt_ids, params, tools, want_logprobs = await self._off_loop(self._chat_prompt, body)
        result = await self._generate(prompt_ids, params)
        text = _text_of(result, body)
        content, tool_calls = parse_tool_calls(text) if tools else (text, [])
        finish = "tool_calls" if tool_calls and result.finish_reason == "stop" else result.finish_reason
        ids = bool(body.get("return_token_ids"))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": tool_calls, "reasoning_content": None},
            "logprobs": _chat_logprobs(self.token_text, result) if want_logprobs else None,
            "finish_reason": finish,
            "stop_reason": result.stop_reason,
            "token_ids": result.token_ids if ids else None,
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), result),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if ids else None,
        }

    async def completions(self, body: dict) -> dict[str, Any]:
        prompt_ids = await self._off_loop(self._completion_prompt, body)
        logprobs = body.get("logprobs")
        if isinstance(logprobs, bool):  # the gateway sends `true` to both APIs; vLLM reads it as 1
            logprobs = 1 if logprobs else None
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise OpenAIError(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        params = _sampling(body, len(prompt_ids), self.max_model_len, self.default_max_tokens, logprobs or 0)
        result = await self._generate(prompt_ids, params)
        ids = bool(body.get("return_token_ids"))
        choice = {
            "index": 0,
            "text": _text_of(result, body),
            "logprobs": _completion_logprobs(self.token_text, result) if logprobs is not None else None,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if ids else None,
            "token_ids": result.token_ids if ids else None,
        }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), result),
        }


def create_app(
    scheduler: BatchScheduler,
    tokenizer: Any,
    *,
    model_name: str,
    max_model_len: int,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    api_key: str = "",
) -> FastAPI:
    """The FastAPI app serving `scheduler` OpenAI-style (`api_key`: required on all but /health)."""
    handler = _Handler(scheduler, tokenizer, model_name, max_model_len, default_max_tokens)
    app = FastAPI(title="agl_lab engine")
    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _require_key(request: Request, call_next: Any) -> Any:
            presented = request.headers.get("authorization", "").encode("latin-1")
            if request.url.path == "/health" or secrets.compare_digest(presented, expected):
                return await call_next(request)
            error = OpenAIError(
                f"missing or wrong key: this engine is bound beyond loopback and needs "
                f"'Authorization: Bearer ${ENGINE_KEY_ENV}' (the gateway sends its upstream_key)",
                status=401,
                type="AuthenticationError",
            )
            return JSONResponse(error.body(), status_code=401)

    app.state.prompt_pool = handler.prompt_pool  # OpenAIServer.stop shuts it down

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as exc:
            raise OpenAIError("Invalid JSON in request body") from exc
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        return body

    # JSONResponse directly: FastAPI's jsonable_encoder walk over per-token logprob dicts
    # costs more than the generation of a short reply.
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        with handler.calls.track(request.headers.get(REQUEST_ID_HEADER)):
            return JSONResponse(await handler.chat(await _body(request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        with handler.calls.track(request.headers.get(REQUEST_ID_HEADER)):
            return JSONResponse(await handler.completions(await _body(request)))

    _add_request_routes(app, handler.calls, _body)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "agl_lab",
            "root": model_name,
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def _add_request_routes(app: FastAPI, calls: InflightCalls, read_body: Any) -> None:
    """`POST /v1/agl/request_state` and `/v1/agl/abort_request` `{"request_id"}` (inflight.py)."""

    async def _request_id(request: Request) -> str:
        request_id = (await read_body(request)).get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise OpenAIError("'request_id' must be the X-Agl-Request-Id of a call", param="request_id")
        return request_id

    @app.post(f"/v1/{REQUEST_STATE_PATH}")
    async def request_state(request: Request) -> dict:
        return calls.state(await _request_id(request))

    @app.post(f"/v1/{ABORT_REQUEST_PATH}")
    async def abort_request(request: Request) -> dict:
        return calls.abort(await _request_id(request))


# ---------------------------------------------------------------------------------------
# OpenAIServer: scheduler + uvicorn on a background thread
# ---------------------------------------------------------------------------------------


class OpenAIServer:
    """Serve `model` OpenAI-style on a background thread (port=0 picks a free port).

    `weights_lock` is held by every generation step; hold it yourself around in-place
    weight updates. `pause()` stops admitting requests and waits for running ones to finish;
    `abort()` fails queued and running requests (HTTP 503 "generation aborted").
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_name: str = "agl-lab-tiny",
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int = MAX_MODEL_LEN,
        batch_window_ms: float = BATCH_WINDOW_MS,
        max_batch_size: int = MAX_BATCH_SIZE,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        weights_lock: threading.RLock | None = None,
        num_threads: int | None = 1,
        prefix_cache_mb: float = 256,
        advertise_host: str | None = None,
        api_key: str | None = None,
    ):
        # beyond loopback a key is required (None: $AGL_ENGINE_KEY, or a fresh one put there)
        self.api_key = engine_key(host) if api_key is None else api_key
        if not self.api_key and not is_loopback(host):
            raise ValueError(
                f"an engine's OpenAI server bound to {host} (beyond loopback) needs a key: set {ENGINE_KEY_ENV}"
            )
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; "
                f"pass max_model_len ≤ {limit}"
            )
        self.model_name, self.max_model_len = model_name, max_model_len
        # A private tokenizer copy: a trainer mutating padding/truncation on its own copy can
        # never race the server's encode/decode calls.
        self.tokenizer = copy.deepcopy(tokenizer)
        self.scheduler = BatchScheduler(
            model,
            self.tokenizer,
            batch_window_ms=batch_window_ms,
            max_batch_size=max_batch_size,
            weights_lock=weights_lock,
            num_threads=num_threads,
            prefix_cache_mb=prefix_cache_mb,
        )
        app = create_app(
            self.scheduler,
            self.tokenizer,
            model_name=model_name,
            max_model_len=max_model_len,
            default_max_tokens=default_max_tokens,
            api_key=self.api_key,
        )
        self._prompt_pool = app.state.prompt_pool
        # ThreadedUvicorn binds the socket first (port known, TCP_NODELAY set) and waits for /health.
        try:
            self._http = ThreadedUvicorn(app, host=host, port=port, health_path="/health")
        except BaseException:
            self.scheduler.close()
            raise
        self.host, self.port = host, self._http.port
        # what `base_url` names: the bind host, or `advertise_host` (a wildcard bind needs one;
        # agl_lab/addresses.py: the machine's address by default)
        self.advertise_host = advertised_host(host, advertise_host)

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.advertise_host)}:{self.port}/v1"

    @property
    def weights_lock(self) -> threading.RLock:
        return self.scheduler.weights_lock

    def pause(self, wait: bool = True, timeout: float | None = None) -> None:
        self.scheduler.pause(wait=wait, timeout=timeout)

    def resume(self) -> None:
        self.scheduler.resume()

    def abort(self) -> int:
        return self.scheduler.abort()

    @property
    def running(self) -> bool:
        return self._http.running

    def stop(self) -> None:
        """Stop the scheduler (in-flight requests fail with 503) and uvicorn. Idempotent."""
        self.scheduler.close()
        self._http.stop()
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------
# `agl-lab engine`
# ---------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def engine_main(argv: list[str]) -> int:
    """`agl-lab engine --host 127.0.0.1 --port 8001 [--model-path DIR]`: serve until Ctrl-C."""
    from pathlib import Path

    from agl_lab.engines.tiny import DEFAULT_MODEL_NAME, load_model_and_tokenizer

    parser = argparse.ArgumentParser(prog="agl-lab engine", description="serve a model OpenAI-style")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model-path", default=None, help="HF model dir on disk (default: the tiny model)")
    parser.add_argument("--model-name", default=None, help="served name (default: agl-lab-tiny or the dir name)")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    parser.add_argument("--batch-window-ms", type=float, default=BATCH_WINDOW_MS)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the decode loop (CPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    parser.add_argument("--prefix-cache-mb", type=float, default=256, help="K/V of recent prefixes (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed of the tiny model")
    args = parser.parse_args(argv)
    import os

    if not is_loopback(args.host) and not os.environ.get(ENGINE_KEY_ENV):
        raise SystemExit(
            f"agl-lab engine: refusing to bind {args.host} without a key: set {ENGINE_KEY_ENV} here and "
            "on the gateway's host (agl-lab serve sends it upstream), or bind 127.0.0.1"
        )
    for flag in ("max_model_len", "max_batch_size", "num_threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"agl-lab engine: --{flag.replace('_', '-')} must be ≥ 1, got {getattr(args, flag)}")
    for flag in ("batch_window_ms", "prefix_cache_mb"):
        if not getattr(args, flag) >= 0:
            raise SystemExit(f"agl-lab engine: --{flag.replace('_', '-')} must be ≥ 0, got {getattr(args, flag)}")
    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda"):
        raise SystemExit(f"agl-lab engine: --device {args.device!r}: use cpu or cuda")
    if args.device is not None and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("agl-lab engine: --device cuda: no CUDA device is available here; use --device cpu")
    try:
        model, tokenizer = load_model_and_tokenizer(args.model_path, device=args.device, seed=args.seed)
    except (OSError, ValueError) as exc:  # no such directory, not a model directory, a damaged one
        raise SystemExit(f"agl-lab engine: --model-path: {_first_line(exc)}") from None
    name = args.model_name or (Path(args.model_path).resolve().name if args.model_path else DEFAULT_MODEL_NAME)
    try:
        server = OpenAIServer(
            model,
            tokenizer,
            model_name=name,
            host=args.host,
            port=args.port,
            max_model_len=args.max_model_len,
            batch_window_ms=args.batch_window_ms,
            max_batch_size=args.max_batch_size,
            num_threads=args.num_threads,
            prefix_cache_mb=args.prefix_cache_mb,
        )
    except ValueError as exc:  # --max-model-len beyond the model's positions
        raise SystemExit(f"agl-lab engine: {_first_line(exc)}") from None
    except OSError as exc:  # the port is taken, the host is not this machine's
        raise SystemExit(f"agl-lab engine: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    print(f"agl-lab engine: serving {name!r} at {server.base_url} (Ctrl-C to stop)", flush=True)
    try:
        while server.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
