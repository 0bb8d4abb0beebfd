"""Token-preserving gateway mode (agl_lab/server/token_preserving.py), on the real tiny BPE
tokenizer and ChatML template.

Part 1 — the pure core: plan_request on hand-built turns (extension, every fallback reason),
the /completions request and the chat response it is shaped back into, the memory.
Part 2 — end to end: the lookup agent (openai SDK) → the real gateway → the real tiny
OpenAIServer; events → CompletedRollout → build_batch. Mode off: append-only rollouts break
on retokenization at a measurable rate. Mode on: one row per rollout, and the ids the batch
trains on are the ids the engine sampled, turn by turn. A history-editing agent falls back
with the reason recorded; chat logprobs equal a fresh forward pass of the engine's model.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from agl_lab.engines.tiny import CHAT_TEMPLATE, load_tokenizer
from agl_lab.server.token_preserving import (
    FORWARDED_KEYS,
    ConversationMemory,
    Turn,
    chat_response,
    completions_request,
    plan_request,
    render_text,
    turn_from_exchange,
)

SYSTEM = {"role": "system", "content": "Reply get KEY or answer VALUE."}
USER = {"role": "user", "content": "Find c."}
OBS = {"role": "user", "content": "c is 7"}


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def byte_ids(tok: Any, text: str) -> list[int]:
    """A valid but non-canonical tokenisation of ASCII `text`: one token per byte, the way a
    sampler can produce it (canonical BPE would merge them)."""
    return [tok.convert_tokens_to_ids("Ġ" if c == " " else c) for c in text]


def first_turn(
    tok: Any,
    reply: str,
    response_ids: list[int],
    *,
    finish: str = "stop",
    stop_reason: Any = None,
    messages: list[dict] | None = None,
    **extra: Any,
) -> tuple[dict, Turn]:
    """(request body, remembered Turn) of a first call answered on the normal chat path."""
    body = {
        "model": "m",
        "messages": messages or [SYSTEM, USER],
        "max_tokens": 8,
        "temperature": 1.0,
        "return_token_ids": True,
        "logprobs": True,
        **extra,
    }
    response = {
        "prompt_token_ids": encode(tok, render_text(tok, body)),
        "choices": [
            {
                "message": {"role": "assistant", "content": reply, "tool_calls": []},
                "token_ids": response_ids,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        ],
    }
    turn = turn_from_exchange(body, response)
    assert turn is not None
    return body, turn


def next_body(body: dict, reply: dict | str, *new: dict, **changes: Any) -> dict:
    reply = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
    return {**body, "messages": body["messages"] + [reply, *new], **changes}


# =============================================================================================
# Part 1 — the pure core
# =============================================================================================


def test_extension_keeps_the_sampled_ids_where_retokenization_drifts(tok):
    sampled = byte_ids(tok, "get c") + [tok.eos_token_id]
    body, turn = first_turn(tok, "get c", sampled)
    body2 = next_body(body, "get c", OBS)
    canonical = encode(tok, render_text(tok, body2))
    context = turn.prompt_ids + sampled
    assert canonical[: len(context)] != context  # the normal path breaks the merge (BPE drift)

    plan = plan_request(turn, body2, tok)
    assert plan.used and plan.kind == "extended"
    assert plan.prompt_ids[: len(context)] == context  # the model's own ids, verbatim
    assert tok.decode(plan.prompt_ids) == render_text(tok, body2)  # same text as the template renders
    # the continuation starts after the sampled <|im_end|>: its "\n" is an observation token
    assert plan.prompt_ids[len(context) :] == encode(
        tok, "\n<|im_start|>user\nc is 7<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (plan.reused_tokens, plan.new_tokens) == (len(context), len(plan.prompt_ids) - len(context))


def test_reply_cut_by_max_tokens_gets_its_end_of_turn_as_observation(tok):
    sampled = byte_ids(tok, "get c")  # finish_reason length: no <|im_end|> was sampled
    body, turn = first_turn(tok, "get c", sampled, finish="length")
    plan = plan_request(turn, next_body(body, "get c", OBS), tok)
    assert plan.used
    n = len(turn.prompt_ids) + len(sampled)
    assert plan.prompt_ids[:n] == turn.prompt_ids + sampled and plan.prompt_ids[n] == tok.eos_token_id


def test_special_token_sampled_inside_a_reply_is_kept_though_the_agent_never_saw_it(tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    sampled = byte_ids(tok, "get") + [im_start] + byte_ids(tok, " c") + [tok.eos_token_id]
    reply = tok.decode(sampled, skip_special_tokens=True)  # what the chat API shows the agent
    assert reply == "get c"
    body, turn = first_turn(tok, reply, sampled)
    body2 = next_body(body, reply, OBS)
    plan = plan_request(turn, body2, tok)
    assert plan.used and plan.prompt_ids[: len(turn.prompt_ids) + len(sampled)] == turn.prompt_ids + sampled
    continuation = plan.prompt_ids[len(turn.prompt_ids) + len(sampled) :]
    visible = turn.prompt_ids + [i for i in sampled if i != im_start] + continuation
    assert tok.decode(visible) == render_text(tok, body2)  # the text check ignores only the hidden token
    # the next call still extends: the hidden token now sits inside the *prompt* it builds on
    reply2 = byte_ids(tok, "answer 7") + [tok.eos_token_id]
    turn2 = turn_from_exchange(
        body2,
        {
            "prompt_token_ids": plan.prompt_ids,
            "choices": [{"message": {"role": "assistant", "content": "answer 7"}, "token_ids": reply2}],
        },
        plan.text,
    )
    plan3 = plan_request(turn2, next_body(body2, "answer 7", OBS), tok)
    assert plan3.used and plan3.prompt_ids[: len(plan.prompt_ids) + len(reply2)] == plan.prompt_ids + reply2


def test_reply_cut_by_max_tokens_on_a_special_token_other_than_eos(tok):
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    sampled = byte_ids(tok, "get c") + [endoftext]  # finish_reason length, last token hidden from the agent
    body, turn = first_turn(tok, "get c", sampled, finish="length")
    body2 = next_body(body, "get c", OBS)
    plan = plan_request(turn, body2, tok)
    n = len(turn.prompt_ids) + len(sampled)
    assert plan.used and plan.prompt_ids[:n] == turn.prompt_ids + sampled
    assert plan.prompt_ids[n] == tok.eos_token_id  # the template's end of turn follows, as an observation


def test_three_turns_chain_on_the_plans_own_prompts(tok):
    body, turn = first_turn(tok, "get c", byte_ids(tok, "get c") + [tok.eos_token_id])
    body2 = next_body(body, "get c", OBS)
    plan2 = plan_request(turn, body2, tok)
    reply2 = byte_ids(tok, "answer 7") + [tok.eos_token_id]
    turn2 = turn_from_exchange(
        body2,
        {
            "prompt_token_ids": plan2.prompt_ids,
            "choices": [
                {"message": {"role": "assistant", "content": "answer 7"}, "token_ids": reply2, "finish_reason": "stop"}
            ],
        },
    )
    body3 = next_body(body2, "answer 7", {"role": "user", "content": "wrong, try again"})
    plan3 = plan_request(turn2, body3, tok)
    assert plan3.used and plan3.prompt_ids[: len(plan2.prompt_ids) + len(reply2)] == plan2.prompt_ids + reply2
    assert tok.decode(plan3.prompt_ids) == render_text(tok, body3)


@pytest.mark.parametrize(
    "case, kind, needle",
    [
        ("first call", "first_call", "first call"),
        ("system dropped", "history_edited", "messages[0] differs"),
        ("conversation cut", "history_edited", "cut or restarted"),
        ("reply stripped", "reply_edited", "content differs"),
        ("temperature", "setup_changed", "temperature 1.0 → 0.5"),
        ("tools", "setup_changed", "tools"),
        ("n=2", "unsupported", "n=2"),
        ("tool_choice", "unsupported", "tool_choice"),
        ("unknown key", "unsupported", "['guided_choice']"),
    ],
)
def test_fallbacks_name_their_reason(tok, case, kind, needle):
    body, turn = first_turn(tok, "get c ", byte_ids(tok, "get c ") + [tok.eos_token_id])
    good = next_body(body, "get c ", OBS)
    requests = {
        "first call": (None, good),
        "system dropped": (turn, {**good, "messages": good["messages"][1:]}),
        "conversation cut": (turn, {**good, "messages": good["messages"][:2]}),
        "reply stripped": (turn, next_body(body, "get c", OBS)),
        "temperature": (turn, {**good, "temperature": 0.5}),
        "tools": (turn, {**good, "tools": [{"type": "function", "function": {"name": "lookup"}}]}),
        "n=2": (turn, {**good, "n": 2}),
        "tool_choice": (turn, {**good, "tool_choice": "required"}),
        "unknown key": (turn, {**good, "guided_choice": ["a"]}),
    }
    previous, request = requests[case]
    assert plan_request(turn, good, tok).used  # the unedited request does extend
    plan = plan_request(previous, request, tok)
    assert (plan.used, plan.kind, plan.prompt_ids) == (False, kind, None)
    assert needle in plan.reason
    assert plan.annotation() == {"used": False, "kind": kind, "reason": plan.reason}


def test_reply_cut_by_a_stop_string_falls_back(tok):
    body, turn = first_turn(tok, "get c", byte_ids(tok, "get c.") + [tok.eos_token_id], stop_reason=".", stop=["."])
    plan = plan_request(turn, next_body(body, "get c", OBS), tok)
    assert (plan.used, plan.kind) == (False, "stop_string") and "'.'" in plan.reason


def test_a_reply_that_kept_its_stop_string_is_extended(tok):
    """calc's call: stopped on a stop string asked with `include_stop_str_in_output`, so the text
    holds it and equals the sampled ids; the next call extends them (the end of turn the model did
    not write arrives as observation tokens)."""
    sampled = byte_ids(tok, "get c.")
    body, turn = first_turn(tok, "get c.", sampled, stop_reason=".", stop=["."], include_stop_str_in_output=True)
    plan = plan_request(turn, next_body(body, "get c.", OBS), tok)
    assert (plan.used, plan.kind) == (True, "extended"), plan.reason
    assert plan.prompt_ids[: len(turn.prompt_ids) + len(sampled)] == turn.prompt_ids + sampled
    assert "include_stop_str_in_output" in FORWARDED_KEYS


def test_template_that_rewrites_earlier_turns_fails_the_prefix_check(tok):
    trimming = copy.deepcopy(tok)  # a template that trims replies, like templates that drop reasoning
    trimming.chat_template = CHAT_TEMPLATE.replace("{{- message['content'] }}", "{{- message['content'] | trim }}")
    assert trimming.chat_template != CHAT_TEMPLATE
    body, turn = first_turn(trimming, "get c ", byte_ids(trimming, "get c ") + [tok.eos_token_id])
    plan = plan_request(turn, next_body(body, "get c ", OBS), trimming)
    assert (plan.used, plan.kind) == (False, "template_mismatch")
    assert "renders the earlier turns differently" in plan.reason and "sampled ' <|im_end|>'" in plan.reason


def test_tool_call_reply_and_tool_message_render_through_the_template(tok):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    text = '<tool_call>{"name": "lookup", "arguments": {"key": "c"}}</tool_call>'
    body = {
        "model": "m",
        "messages": [SYSTEM, USER],
        "tools": tools,
        "max_tokens": 32,
        "logprobs": True,
        "return_token_ids": True,
    }
    prompt = encode(tok, render_text(tok, body))
    sampled = encode(tok, text) + [tok.eos_token_id]
    completion = {
        "id": "cmpl-1",
        "choices": [
            {
                "text": text,
                "token_ids": sampled,
                "prompt_token_ids": prompt,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
    }
    response = chat_response(completion, body)
    message = response["choices"][0]["message"]
    assert response["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"key": "c"}'}
    turn = turn_from_exchange(body, response)
    echoed = {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}
    body2 = next_body(body, echoed, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "7"})
    plan = plan_request(turn, body2, tok)
    assert plan.used and plan.prompt_ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tok.decode(plan.prompt_ids) == render_text(tok, body2)
    edited = {**echoed, "tool_calls": [{**message["tool_calls"][0], "function": {"name": "lookup", "arguments": "{}"}}]}
    assert plan_request(turn, next_body(body, edited, OBS), tok).kind == "reply_edited"


def test_completions_request_forwards_sampling_and_converts_chat_only_keys():
    body = {
        "model": "m",
        "messages": [USER],
        "tools": [],
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["x"],
        "logprobs": True,
        "top_logprobs": 2,
        "max_completion_tokens": 5,
        "return_token_ids": True,
    }
    assert completions_request(body, [1, 2]) == {
        "model": "m",
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "stop": ["x"],
        "prompt": [1, 2],
        "max_tokens": 5,
        "logprobs": 2,
        "return_token_ids": True,
    }
    # no max_tokens: an explicit null (the engine's chat default), not the completions default
    req = completions_request({"messages": [USER], "logprobs": True}, [1])
    assert req["max_tokens"] is None and "max_tokens" in req and req["logprobs"] == 0


def test_chat_response_carries_ids_usage_and_chat_schema_logprobs():
    completion = {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [9, 8],
                "logprobs": {
                    "tokens": ["h", "i"],
                    "token_logprobs": [-0.5, -1.25],
                    "text_offset": [0, 1],
                    "top_logprobs": [{"h": -0.5, "a": -2.0, "b": -3.0}, {"i": -1.25, "o": -0.75}],
                },
            }
        ],
    }
    response = chat_response(completion, {"messages": [USER], "logprobs": True, "top_logprobs": 1})
    choice = response["choices"][0]
    assert (response["id"], response["object"], response["prompt_token_ids"]) == (
        "chatcmpl-abc",
        "chat.completion",
        [1, 2, 3],
    )
    assert (choice["message"]["content"], choice["finish_reason"], choice["token_ids"]) == ("hi", "length", [9, 8])
    assert response["usage"] == completion["usage"]
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -1.25] and [c["token"] for c in content] == ["h", "i"]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [["h"], ["o"]]
    assert chat_response(completion, {"messages": [USER]})["choices"][0]["logprobs"] is None


def test_memory_is_lru_bounded_and_prunes_dead_rollouts():
    memory = ConversationMemory(max_rollouts=2)
    turn = Turn([], {}, {}, [1], [2], {"role": "assistant"})
    for rid in ("a", "b"):
        memory.put((rid, "0"), turn)
    memory.get(("a", "0"))  # a is now the most recently used
    memory.put(("c", "0"), turn)
    assert memory.get(("b", "0")) is None and memory.get(("a", "0")) is turn and len(memory) == 2
    assert memory.prune(lambda rid: rid != "a") == 1 and len(memory) == 1
    assert memory.forget("c") == 1 and len(memory) == 0
    with pytest.raises(ValueError, match="max_rollouts"):
        ConversationMemory(0)


# =============================================================================================
# Part 2 — end to end: lookup agent → gateway → tiny OpenAIServer → events → build_batch
# =============================================================================================

MODEL = "agl-lab-tiny"
N_ROLLOUTS = 16


class SampledLog:
    """Spy on the engine's scheduler: every prompt it received and the ids it sampled."""

    def __init__(self, scheduler: Any):
        self.calls: list[tuple[list[int], Any]] = []
        self._lock = threading.Lock()
        submit = scheduler.submit

        def spy(prompt_ids: list[int], params: Any) -> Any:
            future = submit(prompt_ids, params)
            with self._lock:
                self.calls.append((list(prompt_ids), future))
            return future

        scheduler.submit = spy

    def sampled(self) -> dict[tuple[int, ...], list[list[int]]]:
        """prompt → every id list sampled for it (first prompts repeat across rollouts)."""
        out: dict[tuple[int, ...], list[list[int]]] = {}
        with self._lock:
            for p, f in self.calls:
                out.setdefault(tuple(p), []).append(list(f.result().token_ids))
        return out


@pytest.fixture(scope="module")
def engine() -> Any:
    from agl_lab.engines.serving.openai_server import OpenAIServer
    from agl_lab.engines.tiny import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(device="cpu")
    server = OpenAIServer(model, tokenizer, model_name=MODEL)
    yield SimpleNamespace(server=server, model=model, tokenizer=tokenizer, log=SampledLog(server.scheduler))
    server.stop()


@pytest.fixture(scope="module")
def gateways(engine) -> Any:
    """{False: gateway with the mode off, True: with it on}, both serving the same engine."""
    from agl_lab.protocol import Model
    from agl_lab.server.embedded import EmbeddedServer

    servers = {}
    for on in (False, True):
        server = EmbeddedServer(default_proxy={"model_name": MODEL}, token_preserving=on)
        server.store.upsert_models([Model(model=MODEL, endpoint=engine.server.base_url)])
        if on:
            server.set_tokenizer(MODEL, engine.tokenizer)
        servers[on] = server
    yield servers
    for server in servers.values():
        server.stop()


def run_rollouts(server: Any, agent: Any, tasks: list[dict]) -> list[Any]:
    """Run `agent` on every task concurrently through `server`'s gateway; CompletedRollouts."""
    import uuid

    from agl_lab.protocol import RolloutCreate
    from agl_lab.records import events_to_completed_rollout, triplet_events
    from agl_lab.server.gateway import proxy_base_url

    rollouts = server.store.create_rollouts([RolloutCreate(rollout_id=uuid.uuid4().hex, input=t) for t in tasks])

    def play(rollout: Any) -> Any:
        return agent(
            rollout.input, SimpleNamespace(base_url=proxy_base_url(server.url, rollout.rollout_id), api_key="EMPTY")
        )

    with ThreadPoolExecutor(len(rollouts)) as pool:
        list(pool.map(play, rollouts))
    completed = []
    for i, rollout in enumerate(rollouts):
        events = server.store.events(rollout.rollout_id)
        completed.append(
            events_to_completed_rollout(
                rollout,
                [e.model_dump() for e in events],
                [e.model_dump() for e in triplet_events(events)],
                data_id=rollout.input["task_id"],
                step=0,
                sample_idx=i,
            )
        )
    return completed


def build(completed: list[Any], tokenizer: Any) -> Any:
    from agl_lab.batch import build_batch
    from agl_lab.results import BatchResult

    return BatchResult(
        build_batch(
            completed,
            "trajectory",
            max_prompt_length=256,
            max_response_length=512,
            pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
        )
    )


def model_calls(rollout: Any) -> list[dict]:
    return [e["data"] for e in rollout.events if e["event_type"] == "model_request"]


@pytest.fixture(scope="module")
def append_only_runs(gateways) -> dict[bool, list[Any]]:
    from agl_lab.tasks import get_task

    spec = get_task("lookup")
    tasks = spec.train_tasks(N_ROLLOUTS, 0)
    return {on: run_rollouts(gateways[on], spec.agents["append_only"], tasks) for on in (False, True)}


def test_mode_off_append_only_rollouts_break_on_retokenization(append_only_runs, engine):
    completed = append_only_runs[False]
    assert all(len(r.triplets) >= 2 for r in completed)  # multi-turn: something to merge
    assert all("token_preserving" not in call for r in completed for call in model_calls(r))
    result = build(completed, engine.tokenizer)
    rows_per_rollout = result.rows.groupby("rollout_id").size()
    break_rate = float((rows_per_rollout > 1).mean())
    assert break_rate >= 0.5, f"only {break_rate:.0%} of append-only rollouts broke the merge"
    assert (result.breaks["kind"] == "retokenization").sum() >= 0.5 * len(result.breaks)


def test_mode_on_every_append_only_rollout_is_one_row_of_the_sampled_ids(append_only_runs, engine):
    completed = append_only_runs[True]
    for rollout in completed:
        notes = [call["token_preserving"] for call in model_calls(rollout)]
        assert notes[0]["kind"] == "first_call" and not notes[0]["used"]
        assert all(n["used"] for n in notes[1:]), notes
        assert all(call["upstream_path"] == "completions" for call in model_calls(rollout)[1:])
    result = build(completed, engine.tokenizer)
    assert result.rows.groupby("rollout_id").size().eq(1).all() and len(result.breaks) == 0
    assert result.metrics["training/n_unmerged_rollouts"] == 0

    # the ids the batch trains on = the ids the engine sampled, turn by turn (engine-side spy)
    sampled, batch, by_id = engine.log.sampled(), result.data.batch, {r.rollout_id: r for r in completed}
    for i, rollout_id in enumerate(result.data.non_tensor_batch["rollout_id_list"]):
        attended = batch["attention_mask"][i].bool()
        full = batch["input_ids"][i][attended].tolist()
        model_mask = row_loss_mask(batch, i)
        trained = 0
        for triplet in by_id[rollout_id].triplets:
            p, s = triplet.prompt_ids, triplet.response_ids
            assert full[: len(p)] == p and full[len(p) : len(p) + len(s)] == s
            assert s in sampled[tuple(p)]  # KeyError: the engine never saw this prompt
            assert model_mask[len(p) : len(p) + len(s)] == [1] * len(s)
            trained += len(s)
        assert sum(model_mask) == trained  # nothing else carries loss


def row_loss_mask(batch: Any, i: int) -> list[int]:
    """Row i's loss mask over its attended tokens (0 on the prompt)."""
    prompt = [0] * int(batch["attention_mask"][i][: batch["prompts"].shape[1]].sum())
    n_response = int(batch["attention_mask"][i][batch["prompts"].shape[1] :].sum())
    return prompt + batch["response_mask"][i][:n_response].tolist()


def test_mode_on_answers_the_agent_with_a_chat_completion_of_the_sampled_text(append_only_runs, engine):
    for rollout in append_only_runs[True]:
        for call in model_calls(rollout)[1:]:
            response, choice = call["response"], call["response"]["choices"][0]
            assert response["object"] == "chat.completion" and "messages" in call["request"]
            assert choice["message"]["content"] == engine.tokenizer.decode(
                choice["token_ids"], skip_special_tokens=True
            )
            assert choice["finish_reason"] in ("stop", "length") and call["finish_reason"] == choice["finish_reason"]
            assert response["usage"]["prompt_tokens"] == len(response["prompt_token_ids"])
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_history_editing_agent_falls_back_with_the_reason_recorded(gateways, engine):
    from agl_lab.tasks import get_task

    spec = get_task("lookup")
    completed = run_rollouts(gateways[True], spec.agents["history_editing"], spec.train_tasks(4, 1))
    for rollout in completed:
        notes = [call["token_preserving"] for call in model_calls(rollout)]
        assert len(notes) >= 2 and notes[0]["kind"] == "first_call"
        # the edit (system message dropped) falls back, with the reason on the event ...
        assert not notes[1]["used"] and notes[1]["kind"] == "history_edited"
        assert "messages[0] differs" in notes[1]["reason"] and "'system'" in notes[1]["reason"]
        # ... and the next append-only call extends the edited conversation again
        assert all(n["used"] for n in notes[2:])


@pytest.mark.parametrize("on", [False, True], ids=["chat", "token_preserving"])
def test_recorded_logprobs_are_the_sampled_tokens_logprobs(append_only_runs, engine, on):
    """The logprobs the gateway requests (chat schema on both paths) equal log_softmax of a
    fresh forward pass of the engine's model at the sampled ids (temperature 1.0)."""
    import torch

    worst = 0.0
    for rollout in append_only_runs[on][:4]:
        for t in rollout.triplets:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            with engine.server.weights_lock, torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0].float()
            n = len(t.prompt_ids)
            recomputed = torch.log_softmax(logits[n - 1 : -1], dim=-1).gather(1, ids[0, n:, None])[:, 0]
            worst = max(worst, float((recomputed - torch.tensor(t.logprobs)).abs().max()))
    assert worst < 1e-4


def test_mode_on_without_a_tokenizer_takes_the_normal_path_and_says_why(engine):
    from agl_lab.protocol import Model
    from agl_lab.server.embedded import EmbeddedServer
    from agl_lab.tasks import get_task

    spec = get_task("lookup")
    with EmbeddedServer(default_proxy={"model_name": MODEL}, token_preserving=True) as server:
        server.store.upsert_models([Model(model=MODEL, endpoint=engine.server.base_url)])
        with pytest.raises(TypeError, match="chat template"):
            server.set_tokenizer(MODEL, object())
        completed = run_rollouts(server, spec.agent, spec.train_tasks(2, 2))
    notes = [call["token_preserving"] for r in completed for call in model_calls(r)]
    assert notes and all(n["kind"] == "no_tokenizer" and "set_tokenizer" in n["reason"] for n in notes)
    assert all(len(r.triplets) == len(model_calls(r)) for r in completed)  # the calls still worked


def test_memory_forgets_rollouts_once_they_are_finished(gateways, append_only_runs):
    from agl_lab.protocol import RolloutStatusPatch
    from agl_lab.tasks import get_task

    server = gateways[True]
    rewriter = server.gateway.rewriters[0]
    remembered = len(rewriter.memory)
    assert remembered >= N_ROLLOUTS  # one entry per rollout attempt that made a call
    for rollout in append_only_runs[True]:
        for state in ("running", "succeeded"):
            server.store.patch_status(rollout.rollout_id, RolloutStatusPatch(state=state))
    rewriter.prune_every = 1  # prune on the next call (default: every 512 calls)
    run_rollouts(server, get_task("lookup").agent, get_task("lookup").train_tasks(1, 3))
    assert len(rewriter.memory) == remembered - N_ROLLOUTS + 1  # finished ones gone, the new one kept
