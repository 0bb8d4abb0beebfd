"""Built-in tasks: the `lookup` environment, its reward, its agents and the warm start.

The environment and the reward are tested with hand-written replies (golden rewards);
every agent runs end to end against the real tiny model behind the real OpenAI server,
through the `openai` SDK, with a context object built here (no gateway needed).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch

from agl_lab.diagnose import diagnose_break
from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.engines.warmstart import transcript_to_ids, warm_start
from agl_lab.tasks import Task, get_task, lookup, merge_breakers, task_names
from agl_lab.tasks.lookup import Action, LookupEnv, episode_reward, parse_action
from tests.fakes import ScriptedToolModel

TASK = {
    "task_id": "t0",
    "key": "c",
    "value": "red",
    "table": {
        "a": "blue",
        "b": "green",
        "c": "red",
        "d": "apple",
        "e": "banana",
        "f": "paris",
        "g": "london",
        "h": "tokyo",
    },
}


def play_replies(replies: list[Any], task: dict = TASK) -> tuple[LookupEnv, list[str | None]]:
    env = LookupEnv(task)
    observations = [env.step(r) for r in replies]
    return env, observations


# ---------------------------------------------------------------------------------------------
# Registry and datasets
# ---------------------------------------------------------------------------------------------


def test_registry_returns_the_lookup_spec():
    spec = get_task("lookup")
    assert isinstance(spec, Task) and spec.name == "lookup" and "lookup" in task_names()
    assert spec.agent is lookup.lookup_agent and spec.reward is lookup.reward
    assert set(spec.agents) == {"append_only", "history_editing", "reasoning_dropping"}
    assert spec.warm_start_steps > 0 and spec.description


def test_unknown_task_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown task 'nope'.*'lookup'"):
        get_task("nope")


def test_datasets_are_deterministic_disjoint_and_json():
    spec = get_task("lookup")
    a, b = spec.train_tasks(50, 3), spec.train_tasks(50, 3)
    assert a == b and a != spec.train_tasks(50, 4)
    val = spec.val_tasks(50, 3)
    assert {t["task_id"] for t in a}.isdisjoint(t["task_id"] for t in val)
    assert [t["table"] for t in a] != [t["table"] for t in val]  # a separate seed stream
    for task in a + val:
        assert json.loads(json.dumps(task)) == task
        assert len(set(task["table"].values())) == len(task["table"])  # distinct values
        assert task["table"][task["key"]] == task["value"]
    with pytest.raises(ValueError, match="split='test' is unknown"):
        lookup.make_tasks(1, 0, "test")


# ---------------------------------------------------------------------------------------------
# Parsing and the environment (golden rewards)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("get c", Action("get", "c")),
        ("  Answer  red \n", Action("answer", "red")),
        ("<think>find c</think>get c", Action("get", "c")),
        ("get", None),
        ("get c d", None),
        ("fetch c", None),
        ("", None),
        (None, None),
        (42, None),
        ("answer red<|im_end|>garbage", None),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    "replies, reward, observations",
    [
        (["get c", "answer red"], 1.0, ["c is red", None]),  # look up, then answer
        (["get a", "answer blue"], 0.1, ["a is blue", None]),  # well-formed, wrong key
        (["get c", "answer blue"], 0.4, ["c is red", None]),  # right key, wrong value
        (["answer red"], 0.6, [None]),  # lucky guess, no tool call
        (["get c", "get c", "get c"], 0.0, ["c is red", "c is red", None]),  # never answers
        (["get z", "answer red"], 0.7, ["no key z", None]),  # bad key, right answer
        (["blah", "", "%%"], 0.0, ["invalid reply", "invalid reply", None]),  # garbage, 3 calls
        ([None, "get c", "answer red"], 0.9, ["invalid reply", "c is red", None]),  # one bad reply
    ],
)
def test_episode_rewards(replies, reward, observations):
    env, obs = play_replies(replies)
    assert obs == observations
    assert env.episode.done and env.episode.n_calls == len(replies)
    assert env.reward() == pytest.approx(reward)


def test_env_contract_errors():
    env, _ = play_replies(["get c", "answer red"])
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("answer red")
    with pytest.raises(KeyError, match="missing 'table'"):
        LookupEnv({"key": "c", "value": "red"})
    assert lookup.reward(TASK, "red") == 1.0 and lookup.reward(TASK, None) == 0.0
    assert episode_reward(TASK, lookup.Episode()) == 0.0


# ---------------------------------------------------------------------------------------------
# History functions of the merge breakers
# ---------------------------------------------------------------------------------------------


def test_history_functions_edit_what_they_claim():
    sent = LookupEnv(TASK).first_messages(lookup.THINK_SYSTEM_PROMPT)
    reply = "<think>find c</think>get c"
    appended = lookup.append_turn(sent, reply, "c is red")
    assert appended[:2] == sent and appended[2:] == [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "c is red"},
    ]
    dropped = merge_breakers.drop_reasoning_history(sent, reply, "c is red")
    assert dropped[2] == {"role": "assistant", "content": "get c"} and dropped[3] == appended[3]
    narrowed = merge_breakers.narrow_tools_history(sent, reply, "c is red")
    assert narrowed[0] == {"role": "system", "content": "Reply answer VALUE."} and narrowed[1:] == appended[1:]


# ---------------------------------------------------------------------------------------------
# Warm start: transcripts, determinism, cache
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer(device="cpu")


def test_transcript_mask_covers_exactly_the_replies(tiny):
    _, tok = tiny
    messages = lookup.demo_messages(TASK, random.Random(0))
    ids, mask = transcript_to_ids(tok, messages)
    learnt = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learnt == "get c<|im_end|>answer red<|im_end|>"


def test_demonstrations_learn_then_blur():
    demos = lookup.demonstrations(200, 0, blur_fraction=0.25, think_fraction=0.5)
    asked = [m[1]["content"].split()[1].rstrip(".") for m in demos]
    called = [lookup.parse_action(m[2]["content"]).arg for m in demos]
    assert all(a == c for a, c in zip(asked[:150], called[:150]))  # clean part: the right key
    assert sum(a != c for a, c in zip(asked[150:], called[150:])) > 30  # blurred part: random keys
    assert 60 < sum("<think>" in m[2]["content"] for m in demos) < 140
    observed = [m[3]["content"].split(" is ")[1] for m in demos]
    answered = [lookup.parse_action(m[4]["content"]).arg for m in demos]
    assert observed == answered  # every answer copies the observation (value_noise=0)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_warm_start_is_deterministic_and_cached(tmp_path, tiny):
    model, tok = tiny
    fresh = lambda: copy.deepcopy(model)  # noqa: E731  (the untrained tiny model)
    fit = {"steps": 3, "batch_size": 4}
    m1, m2 = fresh(), fresh()
    init = _state(m1)
    warm_start(m1, tok, get_task("lookup"), seed=1, cache_dir=tmp_path / "a", **fit)
    warm_start(m2, tok, get_task("lookup"), seed=1, cache_dir=tmp_path / "b", **fit)  # fitted again, not loaded
    w1, w2 = _state(m1), _state(m2)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert any(not torch.equal(w1[k], init[k]) for k in w1)
    cached = list((tmp_path / "a").glob("warmstart-lookup-*.pt"))
    assert len(cached) == 1
    cached[0].write_bytes(b"")  # a load must now fail loudly: proves the next call loads the file
    with pytest.raises(EOFError):
        warm_start(fresh(), tok, get_task("lookup"), seed=1, cache_dir=tmp_path / "a", **fit)
    torch.save(w1, cached[0])
    m4 = warm_start(fresh(), tok, get_task("lookup"), seed=1, cache_dir=tmp_path / "a", **fit)
    assert all(torch.equal(w1[k], v) for k, v in m4.state_dict().items())
    m5 = fresh()
    warm_start(m5, tok, get_task("lookup"), seed=2, cache_dir=tmp_path / "a", **fit)  # other seed: other file
    assert len(list((tmp_path / "a").glob("warmstart-lookup-*.pt"))) == 2
    assert warm_start(m5, tok, get_task("lookup"), steps=0, seed=0) is m5
    with pytest.raises(ValueError, match="steps=-1"):
        warm_start(m5, tok, get_task("lookup"), steps=-1, seed=0)


# ---------------------------------------------------------------------------------------------
# Agents end to end: real tiny model, real OpenAI server, the openai SDK
# ---------------------------------------------------------------------------------------------


@dataclass
class RecordingCtx:
    """The agent context of agl_lab.runner (base_url, api_key, emit, openai_client), recording
    every request body the SDK sends and every event the agent emits."""

    base_url: str
    api_key: str = ""
    rollout_id: str = "rollout-test"
    is_train: bool = True
    requests: list[dict] = field(default_factory=list)
    events: list[tuple[str, dict]] = field(default_factory=list)

    def emit(self, event_type: str, data: dict) -> dict:
        self.events.append((event_type, data))
        return {"event_type": event_type, "data": data}

    def openai_client(self) -> openai.OpenAI:
        def record(request: httpx.Request) -> None:
            self.requests.append(json.loads(request.content))

        return openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key or "EMPTY",
            max_retries=0,
            http_client=httpx.Client(event_hooks={"request": [record]}, timeout=60),
        )


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    srv = OpenAIServer(model, tok)
    yield srv
    srv.stop()


def _rendered(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["append_only", "history_editing", "reasoning_dropping"])
def test_agents_run_end_to_end(name, server, tiny):
    _, tok = tiny
    spec = get_task("lookup")
    task = spec.train_tasks(1, 0)[0]
    ctx = RecordingCtx(base_url=server.base_url)
    value = spec.agents[name](task, ctx)
    assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert len(ctx.requests) >= 2  # the untrained model babbles: every call is an invalid reply
    assert all(r["max_tokens"] <= lookup.THINK_MAX_TOKENS for r in ctx.requests)
    ((event_type, data),) = ctx.events
    assert event_type == "task_result" and data["n_calls"] == len(ctx.requests) and data["reward"] == value
    first, second = (_rendered(tok, r["messages"]) for r in ctx.requests[:2])
    if name == "history_editing":  # the merge break it exists for: the next prompt is no extension
        assert not second.startswith(first) and ctx.requests[1]["messages"][0]["content"] == "Reply answer VALUE."
    else:
        assert second.startswith(first)
    if name == "reasoning_dropping":
        assert ctx.requests[0]["messages"][0]["content"] == lookup.THINK_SYSTEM_PROMPT


def test_agent_builds_its_own_client_without_openai_client(server):
    ctx = SimpleNamespace(base_url=server.base_url, api_key="")  # a bare context: no emit either
    value = lookup.lookup_agent(lookup.val_tasks(1, 0)[0], ctx)
    assert 0.0 <= value <= 1.0


# ---------------------------------------------------------------------------------------------
# The merge breaks each agent causes, diagnosed on the ids the server really sampled
# ---------------------------------------------------------------------------------------------


class TokenIdsTransport(httpx.BaseTransport):
    """What the gateway does to each call, in miniature: ask the server for token ids and
    keep `(prompt_ids, response_ids)` per call."""

    def __init__(self, seed: int | None = None) -> None:
        self.inner, self.calls, self.seed = httpx.HTTPTransport(), [], seed

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = {**json.loads(request.content), "return_token_ids": True}
        if self.seed is not None:  # the engine seeds each request's sampler from OS entropy otherwise
            body["seed"] = self.seed + len(self.calls)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
        response = self.inner.handle_request(httpx.Request(request.method, request.url, headers=headers, json=body))
        response.read()
        data = response.json()
        self.calls.append((data["prompt_token_ids"], data["choices"][0]["token_ids"]))
        return response


def transport_ctx(base_url: str, transport: TokenIdsTransport) -> SimpleNamespace:
    """A minimal agent context whose OpenAI client sends every call through `transport`."""

    def client() -> openai.OpenAI:
        return openai.OpenAI(
            base_url=base_url, api_key="EMPTY", max_retries=0, http_client=httpx.Client(transport=transport, timeout=60)
        )

    return SimpleNamespace(base_url=base_url, api_key="", openai_client=client)


def merge_break_kinds(calls: list[tuple[list[int], list[int]]], tok) -> list[str]:
    """The kind of every merge break between consecutive calls of one rollout."""
    kinds = []
    for (p0, r0), (p1, _) in zip(calls, calls[1:]):
        context = p0 + r0
        if p1[: len(context)] != context:
            kinds.append(diagnose_break(context, p1, tok, model_mask=[0] * len(p0) + [1] * len(r0)).kind)
    return kinds


@pytest.fixture(scope="module")
def warm_server(tiny):
    """The tiny model after the task's recommended warm start (cached in the user cache)."""
    model, tok = tiny
    warm = warm_start(copy.deepcopy(model), tok, get_task("lookup"), get_task("lookup").warm_start_steps, seed=0)
    srv = OpenAIServer(warm, tok)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_each_merge_breaker_causes_its_kind_of_break(warm_server, tiny):
    _, tok = tiny
    spec = get_task("lookup")
    found: dict[str, list[str]] = {}
    for name in ("append_only", "history_editing", "reasoning_dropping"):
        found[name] = []
        for i, task in enumerate(spec.val_tasks(6, 0)):
            transport = TokenIdsTransport(seed=100 * i)  # seeded calls: the same replies on every run
            ctx = transport_ctx(warm_server.base_url, transport)
            assert 0.0 <= spec.agents[name](task, ctx) <= 1.0
            assert len(transport.calls) >= 2
            found[name] += merge_break_kinds(transport.calls, tok)
    # The warm-started model samples canonical tokens: an append-only history merges cleanly
    # (with an untrained model its babble re-encodes differently: retokenization breaks).
    assert len(found["append_only"]) <= 1, found
    assert found["history_editing"] == ["history_edit"] * 6, found  # one break per rollout
    kinds = found["reasoning_dropping"]
    assert kinds.count("template") >= 4 and not {"history_edit", "other"} & set(kinds), found


def test_untrained_babble_breaks_append_only_merges_by_retokenization(server, tiny):
    _, tok = tiny
    kinds = []
    for i, task in enumerate(get_task("lookup").val_tasks(4, 0)):
        transport = TokenIdsTransport(seed=100 * i)
        ctx = transport_ctx(server.base_url, transport)
        merge_breakers.append_only_agent(task, ctx)
        kinds += merge_break_kinds(transport.calls, tok)
    assert "retokenization" in kinds


# ---------------------------------------------------------------------------------------
# calc: arithmetic through a calculator tool (the real-model task)
# ---------------------------------------------------------------------------------------


def test_calc_tasks_tool_and_reward():
    import json

    from agl_lab.tasks import calc, get_task

    spec = get_task("calc")
    train, val = spec.train_tasks(50, 0), spec.val_tasks(50, 0)
    assert train == calc.train_tasks(50, 0) and {t["task_id"] for t in train}.isdisjoint(t["task_id"] for t in val)
    t = train[0]
    assert calc.calculator(json.dumps({"expression": t["expression"]})) == str(t["value"])
    assert calc.calculator("not json").startswith("error") and calc.calculator('{"expression": "2 ** 9"}').startswith(
        "error"
    )
    assert calc.reward(t, f"{t['expression']} is {t['value']}.") == 1.0 and calc.reward(t, "no idea") == 0.0
    assert calc.reward(t, f"{t['value']} is wrong, it is {t['value'] + 1}") == 0.0  # the conclusion counts
    assert calc.reward(t, None) == 0.0
    # a transcript renders through the tiny model's template (tool_calls with content None included)
    from agl_lab.engines.tiny import load_tokenizer

    text = load_tokenizer().apply_chat_template(spec.demonstrations(1, 0)[0], tools=calc.TOOLS, tokenize=False)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": ' in text


def test_calc_chain_needs_two_calls_the_second_on_the_first_result():
    from agl_lab.tasks import calc, get_task

    spec = get_task("calc_chain")
    train, val = spec.train_tasks(40, 0), spec.val_tasks(40, 0)
    assert {t["task_id"] for t in train}.isdisjoint(t["task_id"] for t in val)
    assert {t["task_id"] for t in train}.isdisjoint(t["task_id"] for t in calc.train_tasks(40, 0))
    for t in train:
        first, second = t["steps"]
        assert calc.calculator(json.dumps({"expression": first})) == second.split(" ")[0]  # chained on the result
        assert calc.calculator(json.dumps({"expression": second})) == str(t["value"])
        assert calc.calculator(json.dumps({"expression": t["expression"]})).startswith("error")  # one operator
    t = train[1]
    demo = spec.demonstrations(1, 0)[0]
    assert [m["role"] for m in demo[-6:]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert demo[-1]["content"] == str(train[0]["value"])
    # the agent's loop: two calls, each result sent back as a `tool` message, then the answer
    model = ScriptedToolModel([(None, [t["steps"][0]]), (None, [t["steps"][1]]), (str(t["value"]), [])])
    assert calc.calc_agent(t, model) == 1.0
    assert model.seen[1][-1] == {"role": "tool", "tool_call_id": "c1_0", "content": t["steps"][1].split(" ")[0]}
    assert model.seen[0][-1] == {"role": "user", "content": t["question"]}
    assert sum(1 for m in model.seen[0] if m.get("tool_calls")) == 4  # the examples: two calls each
    # one call on the whole expression gets an error back; a wrong answer after it keeps only the tool share
    model = ScriptedToolModel([(None, [t["expression"]]), ("12", [])])
    assert calc.calc_agent(t, model) == pytest.approx(calc.TOOL_WEIGHT)
    assert model.seen[1][-1]["content"].startswith("error")


def test_parallel_warm_starts_compute_once_and_the_others_load(tmp_path, tiny, monkeypatch):
    # two runs of a sweep starting together: the cache lock lets one fit, the other waits and loads
    import threading

    from agl_lab.engines import warmstart

    model, tok = tiny
    fits, real_fit = [], warmstart.fit_transcripts
    monkeypatch.setattr(warmstart, "fit_transcripts", lambda *a, **k: (fits.append(1), real_fit(*a, **k)))
    models = [copy.deepcopy(model) for _ in range(3)]
    threads = [
        threading.Thread(
            target=warm_start,
            args=(m, tok, get_task("lookup")),
            kwargs={"seed": 1, "cache_dir": tmp_path, "steps": 3, "batch_size": 4},
        )
        for m in models
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(fits) == 1
    states = [_state(m) for m in models]
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in s)
    assert len(list(tmp_path.glob("warmstart-lookup-*.pt.lock"))) == 1


# =============================================================================================
# calc's serial tail (#51 item 3): stop at </tool_call>, the answer call capped, the merge kept
# =============================================================================================


def _rendered_ids(tok, messages, tools=None) -> list[int]:
    """The prompt ids the engine sends for `messages` (its template, then its tokenizer)."""
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_calc_calls_stop_at_the_tool_call_and_cap_only_the_answer_call():
    from agl_lab.tasks import calc

    for spec_name, n_calls in (("calc", 1), ("calc_chain", 2)):
        t = get_task(spec_name).train_tasks(3, 0)[1]
        model = ScriptedToolModel([*[(None, [step]) for step in t["steps"]], (str(t["value"]), [])])
        assert calc.calc_agent(t, model) == 1.0
        assert all(o["stop"] == ["</tool_call>"] for o in model.options)
        assert all(o["extra_body"] == {"include_stop_str_in_output": True} for o in model.options)
        caps = [o["max_tokens"] for o in model.options]
        assert caps == [calc.MAX_TOKENS] * n_calls + [calc.ANSWER_MAX_TOKENS], spec_name


def test_the_engine_keeps_the_stop_string_in_text_and_tokens_and_the_next_prompt_extends_them(server, tiny):
    """A stop string met mid-answer: with `include_stop_str_in_output` the text ends with it and
    the token ids decode to that text, so the next prompt (the reply as an assistant message, then
    an observation) extends prompt + response: one merged row, no merge break."""
    from agl_lab.batch import merge_triplets
    from agl_lab.records import Triplet

    _, tok = tiny
    messages = [{"role": "user", "content": "get a"}]
    base = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    base["return_token_ids"] = True
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        full = http.post("/chat/completions", json=base).json()
        text = full["choices"][0]["message"]["content"]
        stop = text[6:9]
        body = {**base, "stop": [stop], "include_stop_str_in_output": True}
        answer = http.post("/chat/completions", json=body).json()
        cut = http.post("/chat/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == text[: text.index(stop) + len(stop)]
    assert cut["message"]["content"] == text[: text.index(stop)]  # vLLM's default: cut before it
    assert choice["token_ids"] == cut["token_ids"]  # the tokens hold the stop string either way
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    follow = [
        *messages,
        {"role": "assistant", "content": choice["message"]["content"]},
        {"role": "user", "content": "b"},
    ]
    second = _rendered_ids(tok, follow)
    calls = [
        Triplet(prompt_ids=answer["prompt_token_ids"], response_ids=choice["token_ids"]),
        Triplet(prompt_ids=second, response_ids=[tok.eos_token_id]),
    ]
    segments, breaks = merge_triplets(calls)
    assert len(segments) == 1 and breaks == []


def test_a_stopped_tool_call_renders_back_as_a_prefix_of_the_next_prompt(tiny):
    """calc's call 1 as the engine returns it with the stop (through `</tool_call>`, no end of turn):
    parsed into `tool_calls`, sent back as the SDK's assistant message plus the tool result, the next
    prompt starts with prompt + response ids."""
    from agl_lab.chat_format import parse_tool_calls
    from agl_lab.tasks import calc

    _, tok = tiny
    t = calc.train_tasks(2, 0)[0]
    first = calc.first_messages(t)
    prompt = _rendered_ids(tok, first, calc.TOOLS)
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "' + t["steps"][0] + '"}}</tool_call>'
    assert reply.endswith(calc.TOOL_CALL_STOP[0])
    response = tok(reply, add_special_tokens=False)["input_ids"]
    content, tool_calls = parse_tool_calls(reply)
    assert content is None and len(tool_calls) == 1
    sent = [
        *first,
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": str(t["value"])},
    ]
    second = _rendered_ids(tok, sent, calc.TOOLS)
    assert len(response) > 20 and second[: len(prompt) + len(response)] == prompt + response
