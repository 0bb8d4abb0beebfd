"""The OpenAI-compatible engine server, through real HTTP on loopback with the tiny model.

What the gateway and the batch builder rely on: vLLM's `return_token_ids` fields, logprobs
that equal a fresh forward pass (also when requests are batched together), seeded sampling
independent of batching, OpenAI-style 400s, and abort/pause semantics.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import load_model_and_tokenizer
from tests.conftest import scaled

MAX_LEN = 1024


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer(device="cpu")


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    srv = OpenAIServer(model, tok, max_model_len=MAX_LEN)
    yield srv
    srv.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _fresh_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the response ids, from one unbatched forward pass."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def _wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


def test_chat_round_trip_with_openai_sdk(server, tiny):
    model, tok = tiny
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "lookup key 3"}]
    r = client.chat.completions.create(
        model="whatever",
        messages=messages,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    data = r.model_dump()
    prompt_ids, choice = data["prompt_token_ids"], data["choices"][0]
    assert prompt_ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    token_ids = choice["token_ids"]
    assert 1 <= len(token_ids) <= 12 and data["model"] == "agl-lab-tiny"
    assert tok.decode(token_ids, skip_special_tokens=True) == choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([i]) for i in token_ids]
    assert all(c["bytes"] == list(c["token"].encode()) and c["top_logprobs"] == [] for c in content)
    assert {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(token_ids),
        "total_tokens": len(prompt_ids) + len(token_ids),
    }
    assert choice["finish_reason"] == ("stop" if token_ids[-1] == tok.eos_token_id else "length")
    fresh = _fresh_logprobs(model, prompt_ids, token_ids, 1.0)
    assert torch.allclose(fresh, torch.tensor([c["logprob"] for c in content]), atol=1e-4)


def test_without_return_token_ids_fields_are_null(http):
    data = _post(http, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert data["prompt_token_ids"] is None and data["choices"][0]["token_ids"] is None
    assert data["choices"][0]["logprobs"] is None and data["object"] == "chat.completion"


@pytest.mark.parametrize("prompt_form", ["text", "ids", "list_of_text", "list_of_ids"])
def test_completions_prompt_forms(http, tiny, prompt_form):
    model, tok = tiny
    text = "calc 12 + 30 = ? Observation:"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompt = {"text": text, "ids": ids, "list_of_text": [text], "list_of_ids": [ids]}[prompt_form]
    data = _post(
        http,
        "/completions",
        {"prompt": prompt, "max_tokens": 6, "logprobs": 2, "seed": 3, "temperature": 0.7, "return_token_ids": True},
    )
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == ids and data["object"] == "text_completion"
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([i]) for i in choice["token_ids"]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob and len(top) in (2, 3) and max(top.values()) >= logprob
    fresh = _fresh_logprobs(model, ids, choice["token_ids"], 0.7)
    assert torch.allclose(fresh, torch.tensor(lp["token_logprobs"]), atol=1e-4)


def test_completions_logprobs_true_means_one(http):
    """The gateway sends `logprobs: true` to both APIs; vLLM reads it as 1."""
    data = _post(http, "/completions", {"prompt": "hello", "max_tokens": 3, "logprobs": True})
    lp = data["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == data["usage"]["completion_tokens"]


def test_models_and_health(server, http):
    assert http.get("/models").json()["data"][0]["id"] == "agl-lab-tiny"
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200


# ---------------------------------------------------------------------------------------
# Logprobs and seeds under batching
# ---------------------------------------------------------------------------------------


def _concurrent_batch(server, http, bodies: list[dict]) -> list[dict]:
    """Send `bodies` at once while the scheduler is held, so they are prefilled as one batch."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        with server.weights_lock:  # the scheduler cannot step: every request queues
            futures = [pool.submit(_post, http, "/completions", b) for b in bodies]
            _wait_until(lambda: server.scheduler.num_pending()[0] == len(bodies))
        return [f.result() for f in futures]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_batched_logprobs_equal_a_fresh_forward(server, http, tiny, temperature, top_p):
    """The reported logprob is log_softmax(logits / T) at the sampled id — never top-p renormalised."""
    model, tok = tiny
    prompts = ["hi", "lookup key apple_3: the value is", "calc 7 * 8 = ? " * 6, "Answer: 42. " * 12, "tool"]
    bodies = [
        {
            "prompt": p,
            "max_tokens": 5 + 7 * i,
            "temperature": temperature,
            "top_p": top_p,
            "seed": i,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        for i, p in enumerate(prompts)
    ]
    before = dict(server.scheduler.stats)
    results = _concurrent_batch(server, http, bodies)
    assert server.scheduler.stats["prefills"] == before["prefills"] + 1  # one batch: all five together
    for body, data in zip(bodies, results):
        choice = data["choices"][0]
        assert len(choice["token_ids"]) == body["max_tokens"] and choice["finish_reason"] == "length"
        fresh = _fresh_logprobs(model, choice["prompt_token_ids"], choice["token_ids"], temperature)
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert (fresh - served).abs().max().item() < 1e-4
        if temperature == 0:  # greedy: the argmax of a fresh forward
            ids = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
            with torch.no_grad():
                argmax = model(ids).logits[0, len(choice["prompt_token_ids"]) - 1 : -1].argmax(-1)
            assert argmax.tolist() == choice["token_ids"]


def test_prefix_cache_serves_the_next_turn_and_logprobs_stay_exact(server, http, tiny):
    """Turn 2 extends turn 1's prompt and reply: the prefix cache supplies them, nothing else changes."""
    model, tok = tiny
    messages = [
        {"role": "system", "content": "You look up keys. " * 6},
        {"role": "user", "content": "lookup key apple_3"},
    ]
    body = {
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    first = _post(http, "/chat/completions", {**body, "messages": messages})
    reply = first["choices"][0]["message"]["content"]
    follow = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and key pear_1?"}]
    before = dict(server.scheduler.stats)
    second = _post(http, "/chat/completions", {**body, "messages": follow})
    prompt_ids = second["prompt_token_ids"]
    assert server.scheduler.stats["cached_tokens"] - before["cached_tokens"] >= len(first["prompt_token_ids"]) - 16
    choice = second["choices"][0]
    fresh = _fresh_logprobs(model, prompt_ids, choice["token_ids"], 1.0)
    served = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    assert (fresh - served).abs().max().item() < 1e-4


def test_arrivals_merge_into_a_running_batch(server, http, tiny):
    """Requests admitted while others decode join the batch; their logprobs stay exact."""
    model, _ = tiny
    # admitted together (queued while paused) with one length, they decode side by side to the end
    long = [
        {
            "prompt": "lookup " * (3 + i),
            "max_tokens": 300,
            "seed": i,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for i in range(3)
    ]
    late = [
        {
            "prompt": "value " * (20 - 5 * i),
            "max_tokens": 8,
            "seed": 10 + i,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "temperature": 0.7,
        }
        for i in range(3)
    ]
    before = server.scheduler.stats["merges"]
    with ThreadPoolExecutor(6) as pool:
        server.pause()
        try:
            first = [pool.submit(_post, http, "/completions", b) for b in long]
            _wait_until(lambda: server.scheduler.num_pending() == (3, 0))
        finally:
            server.resume()
        _wait_until(lambda: server.scheduler.num_pending() == (0, 3))
        with server.weights_lock:  # hold the decode loop while the late requests queue
            second = [pool.submit(_post, http, "/completions", b) for b in late]
            _wait_until(lambda: server.scheduler.num_pending() == (3, 3))
        results = [f.result() for f in first + second]
    assert server.scheduler.stats["merges"] > before
    for body, data in zip(long + late, results):
        choice = data["choices"][0]
        fresh = _fresh_logprobs(model, choice["prompt_token_ids"], choice["token_ids"], body.get("temperature", 1.0))
        assert (fresh - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max().item() < 1e-4


def test_same_seed_same_completion_alone_or_batched(server, http):
    body = {
        "messages": [{"role": "user", "content": "tell me the value"}],
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 1234,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    alone = _post(http, "/chat/completions", body)["choices"][0]["token_ids"]
    assert _post(http, "/chat/completions", body)["choices"][0]["token_ids"] == alone
    others = [{"prompt": "x " * (i + 1), "max_tokens": 30, "seed": i, "ignore_eos": True} for i in range(5)]
    with ThreadPoolExecutor(6) as pool:
        with server.weights_lock:  # all six queue, then run as one batch
            fs = [pool.submit(_post, http, "/completions", b) for b in others]
            mine = pool.submit(_post, http, "/chat/completions", body)
            _wait_until(lambda: server.scheduler.num_pending()[0] == 6)
        [f.result() for f in fs]
        assert mine.result()["choices"][0]["token_ids"] == alone
    different = _post(http, "/chat/completions", {**body, "seed": 4321})["choices"][0]["token_ids"]
    assert different != alone


# ---------------------------------------------------------------------------------------
# Stopping and limits
# ---------------------------------------------------------------------------------------


def test_stop_string_is_cut_from_the_text(http):
    base = {
        "prompt": "lookup key value answer",
        "temperature": 0,
        "max_tokens": 30,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = _post(http, "/completions", base)["choices"][0]
    stop = full["text"][8:11]
    assert len(stop) == 3
    cut = _post(http, "/completions", {**base, "stop": [stop, "never-seen"]})["choices"][0]
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]  # tokens through the stop string


def test_a_stop_string_late_in_a_long_reply_is_found_by_decoding_only_the_reply_s_tail(server, http, monkeypatch):
    """Each step looks for stop strings in the last few tokens only (the whole reply once, on a hit):
    the cut is where a whole-text search puts it, multi-byte stops included, and no step decodes
    more than the window until the hit."""
    base = {
        "prompt": "lookup key value answer",
        "temperature": 0,
        "max_tokens": 120,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = _post(http, "/completions", base)["choices"][0]
    tokenizer = server.scheduler.tokenizer
    decoded: list[int] = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw))
    text = full["text"]
    # a 4-character stop string whose first occurrence comes late (the tiny model repeats itself)
    first, stop = max((text.index(text[i : i + 4]), text[i : i + 4]) for i in range(len(text) - 4))
    cut = _post(http, "/completions", {**base, "stop": [stop, "\u00e9t\u00e9 never"]})["choices"][0]
    assert cut["text"] == full["text"][:first]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    n = len(cut["token_ids"])
    window = len("\u00e9t\u00e9 never".encode()) + 8  # the longest stop in bytes + the slack
    assert n > 2 * window and cut["token_ids"] == full["token_ids"][:n]
    assert max(decoded[:n]) <= window  # one decode a step, of the reply's tail only
    assert decoded[n] == n  # the hit: the whole reply once, to place the cut (then the reply's text)


def test_stop_token_ids(http):
    base = {"prompt": "the value", "temperature": 0, "max_tokens": 10, "ignore_eos": True, "return_token_ids": True}
    full = _post(http, "/completions", base)["choices"][0]["token_ids"]
    cut = _post(http, "/completions", {**base, "stop_token_ids": [full[2]]})["choices"][0]
    assert cut["token_ids"] == full[: full.index(full[2]) + 1]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == full[2]


def test_tool_call_blocks_become_tool_calls():
    from agl_lab.chat_format import parse_tool_calls as _parse_tool_calls

    content, calls = _parse_tool_calls(
        'Let me check.\n<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    )
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"key": "x"}'}
    assert _parse_tool_calls("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert _parse_tool_calls("plain answer") == ("plain answer", [])


def test_default_max_tokens_fills_the_context(http, tiny):
    _, tok = tiny
    ids = tok("value " * MAX_LEN, add_special_tokens=False)["input_ids"][: MAX_LEN - 3]
    assert len(ids) == MAX_LEN - 3
    data = _post(http, "/completions", {"prompt": ids, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == 3 and data["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

_MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body,param,fragment",
    [
        ("/chat/completions", {}, "messages", "'messages' is required"),
        ("/chat/completions", {"messages": "hi"}, "messages", "non-empty list"),
        ("/chat/completions", {"messages": [{"content": "x"}]}, "messages[0]", "'role'"),
        ("/chat/completions", {"messages": _MSG, "n": 2}, "n", "only n=1"),
        ("/chat/completions", {"messages": _MSG, "stream": True}, "stream", "Streaming"),
        ("/chat/completions", {"messages": _MSG, "temperature": "hot"}, "temperature", "must be a number"),
        ("/chat/completions", {"messages": _MSG, "temperature": -1}, "temperature", "≥ 0"),
        ("/chat/completions", {"messages": _MSG, "top_p": 0}, "top_p", "(0, 1]"),
        ("/chat/completions", {"messages": _MSG, "max_tokens": 0}, "max_tokens", "≥ 1"),
        ("/chat/completions", {"messages": _MSG, "stop": 5}, "stop", "string or a list"),
        ("/chat/completions", {"messages": _MSG, "top_logprobs": 3}, "top_logprobs", "logprobs"),
        (
            "/chat/completions",
            {"messages": _MSG, "max_tokens": 5000},
            "max_tokens",
            "This model's maximum context length is 1024 tokens. However, you requested 5010 tokens "
            "(10 in the messages, 5000 in the completion)",
        ),
        ("/completions", {}, "prompt", "'prompt' is required"),
        ("/completions", {"prompt": []}, "prompt", "empty"),
        ("/completions", {"prompt": [5, 99999]}, "prompt", "[0, 1024)"),
        ("/completions", {"prompt": ["a", "b"]}, "prompt", "batched prompts"),
        (
            "/completions",
            {"prompt": [1] * 1024},
            "messages",
            "maximum context length is 1024 tokens. However, you requested 1025 tokens (1024 in the messages, 1 in",
        ),
        ("/completions", {"prompt": "a", "logprobs": 50}, "logprobs", "[0, 20]"),
        ("/completions", {"prompt": "a", "stop_token_ids": ["x"]}, "stop_token_ids", "integer token ids"),
    ],
)
def test_bad_requests_are_openai_400s(http, path, body, param, fragment):
    resp = http.post(path, json={"model": "m", "unknown_field": 1, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert fragment in err["message"]


def test_invalid_json_is_a_400(http):
    resp = http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "Invalid JSON" in resp.json()["error"]["message"]


# ---------------------------------------------------------------------------------------
# Abort, pause, weights lock
# ---------------------------------------------------------------------------------------


def test_abort_fails_in_flight_requests(server, http):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    errors: list[Exception] = []

    def call() -> None:
        try:
            client.chat.completions.create(model="m", messages=_MSG, max_tokens=500, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    _wait_until(lambda: server.scheduler.num_pending() == (0, 1))
    assert server.abort() == 1
    thread.join(timeout=10)
    assert len(errors) == 1 and errors[0].status_code == 503
    assert "generation aborted" in errors[0].response.json()["error"]["message"]
    assert server.scheduler.num_pending() == (0, 0)
    assert _post(http, "/completions", {"prompt": "still alive", "max_tokens": 2})  # serves again


def test_pause_holds_new_requests_until_resume(server, http):
    server.pause()
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_post, http, "/completions", {"prompt": "paused", "max_tokens": 2})
            _wait_until(lambda: server.scheduler.num_pending() == (1, 0))
            time.sleep(0.05)
            assert not future.done()
            server.resume()
            assert future.result()["usage"]["completion_tokens"] >= 1
    finally:
        server.resume()


# ---------------------------------------------------------------------------------------
# `agl-lab engine`
# ---------------------------------------------------------------------------------------


def test_engine_cli_serves_standalone(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "engine.log"  # a file, not a pipe: nothing blocks on a full pipe or on reading it
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agl_lab.cli", "engine", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    try:
        bound = scaled(180)  # it imports torch and transformers, then builds the model: slow when loaded
        deadline = time.monotonic() + bound
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).json()
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"`agl-lab engine` did not serve in {bound:g} s (exit code {proc.poll()}):\n"
                        + log.read_text()[-3000:]
                    )
                time.sleep(0.2)
        assert models["data"][0]["id"] == "agl-lab-tiny"
        data = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=30,
            json={"prompt": "hello", "max_tokens": 3, "return_token_ids": True},
        ).json()
        assert data["choices"][0]["prompt_token_ids"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/chat/completions", {"messages": [{"role": "user", "content": "word " * 600_000}]}, "messages"),
        ("/completions", {"prompt": "word " * 600_000}, "prompt"),
    ],
)
def test_a_prompt_too_long_in_bytes_is_refused_untokenized(http, server, path, body, param):
    """3 MB cannot fit 1,024 tokens of a byte-level vocabulary: refused from its length in bytes
    (tokenizing it would take seconds), with the context-length error the gateway recognises."""
    resp = http.post(path, json={"max_tokens": 1, **body})
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == param
    assert "maximum context length is 1024 tokens" in error["message"] and "not tokenized" in error["message"]
    floor = int(error["message"].split("at least ")[1].split()[0])
    assert 3_000_000 // 13 <= floor * 13 and floor < 3_000_000  # bytes / the longest token's bytes
    short = {"messages": _MSG} if "chat" in path else {"prompt": "word"}
    assert http.post(path, json={"max_tokens": 1, **short}).status_code == 200  # a short one still passes


def test_a_slow_prompt_does_not_hold_up_another_rollouts_call(server, monkeypatch):
    """While the engine renders one agent's prompt (held here until released: a huge prompt in
    real life), another agent's call is answered: rendering and tokenizing run off the event
    loop. Asserted by order, not time: the short call returns while the slow one is still held.
    With rendering on the loop the short call cannot be read, and its client times out."""
    tok = server.tokenizer  # the server's own copy
    entered, release = threading.Event(), threading.Event()
    render = tok.apply_chat_template

    def held(messages, **kwargs):
        if messages[0].get("content") == "HOLD":
            entered.set()
            release.wait(scaled(300))
        return render(messages, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", held)
    url = server.base_url + "/chat/completions"
    slow_body = {"messages": [{"role": "user", "content": "HOLD"}], "max_tokens": 1}
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, url, json=slow_body, timeout=scaled(300))
        try:
            assert entered.wait(scaled(120)), "the held prompt never reached the chat template"
            small = httpx.post(url, json={"messages": _MSG, "max_tokens": 2}, timeout=scaled(60))
            assert small.status_code == 200, small.text
            assert not slow.done(), "the held call finished before it was released"
        finally:
            release.set()
        assert slow.result().status_code == 200
