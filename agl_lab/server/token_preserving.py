"""Token-preserving gateway mode: earlier turns keep the token ids the model sampled.

**The problem.** An agent that talks the OpenAI chat API sends its whole conversation on
every call, and the engine re-renders it with the chat template and re-tokenises it. The
model's earlier replies then come back as *other* token ids than the ones it sampled
(byte-level BPE: "get c" sampled as `get`,` `,`c` re-encodes as `get`,` c`), so the next
prompt is no longer a token prefix-extension of the previous prompt + reply: a **merge
break**. Training sees more rows, duplicated prefixes, and prompt tokens the model never
sampled.

**The fix.** Per rollout attempt the gateway remembers the last call: the messages sent, the
prompt ids, the sampled response ids and the reply it returned (`ConversationMemory`). When
the next chat request is that conversation + the same reply + new messages, the gateway
builds the prompt itself (`plan_request`)

    prompt_ids = previous prompt ids + previous sampled ids + ids(continuation)

where `continuation` is what the chat template renders *after* the text of those ids:

    full = template(messages, add_generation_prompt=True)
    seen = decode(previous prompt ids + previous sampled ids)     # text the model saw
    check full.startswith(seen)  → continuation = full[len(seen):]

The check is the textual prefix property: the new ids decode to exactly what the template
renders, so the model sees the same text as on the normal path, only with its own sampled
tokens kept. The continuation starts right after the last *sampled* token, so the tail of
the previous assistant turn that the model did not sample (`\\n` after `<|im_end|>`; the
whole `<|im_end|>\\n` when the reply was cut by `max_tokens`) becomes observation tokens,
loss-masked like a tool result. One exception to "decode = template text", by design: a
special token sampled *inside* a reply is hidden from the agent by the chat API
(skip_special_tokens), so the template cannot render it; it stays in the ids (the model did
sample it) and the check compares the reply's visible text. The prompt goes to the engine's
`/completions` as token ids; the answer is shaped back into a chat completion.

**When it does not apply** the request takes the normal chat path and the reason is
recorded (`Plan.kind`, `Plan.reason`): first call of the attempt, history edited (an
earlier message differs), the reply edited, the previous reply cut by a stop *string*
(its text no longer equals its ids; a reply asked with vLLM's `include_stop_str_in_output` keeps
the stop string in its text and is extended: `calc`'s stop at `</tool_call>`), a different render setup (tools, chat template and
its kwargs) or sampling setup (`SAMPLING_KEYS`: a row is one sample of one policy, so the
turns it merges must share the sampling distribution), a parameter only the chat API
honours (`tool_choice` forcing a call, `response_format`, `n > 1`, …), a key this module
does not know (never silently dropped), or the template failing the prefix check.

Request keys, in three sets: `RENDER_KEYS` and the chat-only keys are consumed here;
`FORWARDED_KEYS` go to `/completions` unchanged; `max_completion_tokens` becomes
`max_tokens`, and a request without either sends `max_tokens: null`, so the engine applies
its chat default (the rest of the context) instead of the completions default (16 in vLLM).

Pure core: no HTTP. `TokenPreservingRewriter` (bottom) adapts it to the gateway's
request-rewriter plug-in point.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl_lab.chat_format import parse_tool_calls

logger = logging.getLogger("agl_lab.server.token_preserving")

# ---------------------------------------------------------------------------------------------
# Request keys
# ---------------------------------------------------------------------------------------------

RENDER_KEYS = ("tools", "chat_template", "chat_template_kwargs", "documents")
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)
FORWARDED_KEYS = SAMPLING_KEYS + (
    "model",
    "max_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "n",
    "user",
)
# consumed here (rendering, logprob format) or meaningless for one non-streamed answer
CHAT_KEYS = RENDER_KEYS + (
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "return_token_ids",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "metadata",
    "store",
    "service_tier",
    "add_generation_prompt",
    "continue_final_message",
    "response_format",
)

KINDS = (
    "extended",
    "first_call",
    "history_edited",
    "reply_edited",
    "stop_string",
    "setup_changed",
    "unsupported",
    "template_mismatch",
    "no_tokenizer",
    "not_chat",
)


@dataclass
class Turn:
    """What the memory keeps of the last successful chat call of one rollout attempt.

    | field         | type          | meaning                                                  |
    |---------------|---------------|----------------------------------------------------------|
    | messages      | list[dict]    | the messages sent (normalised: None-valued keys dropped) |
    | render        | dict          | RENDER_KEYS of the request                                |
    | sampling      | dict          | SAMPLING_KEYS of the request                              |
    | prompt_ids    | list[int] (P) | prompt the engine saw                                     |
    | response_ids  | list[int] (R) | ids the engine sampled                                    |
    | reply         | dict          | the assistant message returned (content, tool_calls)     |
    | finish_reason | str | None    | "stop", "length", "tool_calls"                            |
    | stop_reason   | Any           | None (eos), int (stop token id) or str (stop string)      |
    | prompt_text   | str | None    | the template's text of the prompt when the mode built it  |
    |               |               | (None: decode(prompt_ids) is that text)                   |
    | stop_kept     | bool          | asked with `include_stop_str_in_output`: a matched stop   |
    |               |               | string stays in the text (the text still equals the ids)  |
    """

    messages: list[dict[str, Any]]
    render: dict[str, Any]
    sampling: dict[str, Any]
    prompt_ids: list[int]
    response_ids: list[int]
    reply: dict[str, Any]
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_text: str | None = None
    stop_kept: bool = False


@dataclass
class Plan:
    """The decision for one request: `used` → send `prompt_ids` to `/completions`."""

    used: bool
    kind: str
    reason: str
    prompt_ids: list[int] | None = None
    reused_tokens: int = 0  # previous prompt + sampled ids carried over verbatim
    new_tokens: int = 0  # ids of the continuation (new messages + template scaffolding)
    text: str | None = None  # the template's rendering of the request (= visible text of prompt_ids)

    def annotation(self) -> dict[str, Any]:
        """The `token_preserving` value recorded on the model_request event."""
        out: dict[str, Any] = {"used": self.used, "kind": self.kind, "reason": self.reason}
        if self.used:
            out.update(reused_tokens=self.reused_tokens, new_tokens=self.new_tokens)
        return out


def _fallback(kind: str, reason: str) -> Plan:
    return Plan(False, kind, reason)


# ---------------------------------------------------------------------------------------------
# Memory: the last call per rollout attempt, LRU-bounded
# ---------------------------------------------------------------------------------------------


class ConversationMemory:
    """`(rollout_id, attempt_id) → Turn`, at most `max_rollouts` entries (least recently used
    evicted). Thread-safe. `prune(alive)` drops the entries of finished or deleted rollouts."""

    def __init__(self, max_rollouts: int = 4096):
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts={max_rollouts} must be >= 1")
        self.max_rollouts = max_rollouts
        self._turns: OrderedDict[tuple[str, str], Turn] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Turn | None:
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None:
                self._turns.move_to_end(key)
            return turn

    def put(self, key: tuple[str, str], turn: Turn) -> None:
        with self._lock:
            self._turns[key] = turn
            self._turns.move_to_end(key)
            while len(self._turns) > self.max_rollouts:
                self._turns.popitem(last=False)

    def forget(self, rollout_id: str, attempt_id: str | None = None) -> int:
        """Drop one attempt, or every attempt of the rollout when `attempt_id` is None."""
        with self._lock:
            keys = [k for k in self._turns if k[0] == rollout_id and attempt_id in (None, k[1])]
            for k in keys:
                del self._turns[k]
            return len(keys)

    def prune(self, alive: Callable[[str], bool]) -> int:
        """Drop the entries whose rollout `alive(rollout_id)` says is gone; returns how many."""
        with self._lock:
            rollout_ids = {k[0] for k in self._turns}
        dead = [rid for rid in rollout_ids if not alive(rid)]
        return sum(self.forget(rid) for rid in dead)

    def __len__(self) -> int:
        return len(self._turns)


# ---------------------------------------------------------------------------------------------
# Message comparison
# ---------------------------------------------------------------------------------------------


def normalize(value: Any) -> Any:
    """Drop None-valued keys (recursively) so `{"content": "x", "tool_calls": None}` equals
    `{"content": "x"}`: SDK objects dumped back into messages carry such keys."""
    if isinstance(value, Mapping):
        return {str(k): normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    return value


def _reply_signature(message: Mapping[str, Any]) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """(role, content, ((tool name, arguments), ...)): what the template renders of a reply."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts render
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, Mapping) else {}
        args = fn.get("arguments")
        calls.append((str(fn.get("name")), args if isinstance(args, str) else json.dumps(args)))
    return str(message.get("role")), content or "", tuple(calls)


def _first_difference(old: Sequence[Any], new: Sequence[Any]) -> int:
    return next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))


# ---------------------------------------------------------------------------------------------
# Planning a request
# ---------------------------------------------------------------------------------------------


def _unsupported(body: Mapping[str, Any]) -> str | None:
    """Why `/completions` cannot serve this chat request as the chat API would, or None."""
    unknown = sorted(k for k in body if k not in CHAT_KEYS and k not in FORWARDED_KEYS)
    if unknown:
        return (
            f"request key(s) {unknown} are not known to the token-preserving mode, which never "
            "drops a parameter silently; send them on a rollout without the mode"
        )
    if body.get("n") not in (None, 1):
        return f"n={body.get('n')}: only one choice per call can be preserved"
    if body.get("tool_choice") not in (None, "auto", "none"):
        return f"tool_choice={body.get('tool_choice')!r} forces a call, which only the chat API enforces"
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return "response_format constrains decoding, which only the chat API applies"
    if body.get("add_generation_prompt") is False or body.get("continue_final_message"):
        return "add_generation_prompt=false / continue_final_message: the reply continues a message"
    if body.get("stream"):
        return "stream=true is not supported by the gateway"
    return None


def _check_extension(previous: Turn, messages: list[dict[str, Any]]) -> Plan | None:
    """A fallback Plan when `messages` is not previous messages + same reply + new ones."""
    n = len(previous.messages)
    if len(messages) <= n:
        return _fallback(
            "history_edited",
            f"the request has {len(messages)} messages, not more than the "
            f"previous call's {n}: the conversation was cut or restarted",
        )
    head = messages[:n]
    if head != previous.messages:
        i = _first_difference(previous.messages, head)
        return _fallback(
            "history_edited",
            f"history edited: messages[{i}] differs from the previous call "
            f"(role {previous.messages[i].get('role')!r} → {head[i].get('role')!r})",
        )
    want, got = _reply_signature(previous.reply), _reply_signature(messages[n])
    if got != want:
        what = "role" if got[0] != want[0] else "content" if got[1] != want[1] else "tool_calls"
        return _fallback("reply_edited", f"messages[{n}] is not the previous reply as returned ({what} differs)")
    return None


def _check_setup(previous: Turn, body: Mapping[str, Any]) -> Plan | None:
    for kind, keys, stored in (
        ("render", RENDER_KEYS, previous.render),
        ("sampling", SAMPLING_KEYS, previous.sampling),
    ):
        for key in keys:
            if normalize(body.get(key)) != stored.get(key):
                return _fallback(
                    "setup_changed",
                    f"{kind} setup changed since the previous call: {key} "
                    f"{_short(stored.get(key))} → {_short(body.get(key))}",
                )
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_text(tokenizer: Any, body: Mapping[str, Any]) -> str:
    """The prompt text the chat API would build for `body` (generation prompt included)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    for key in ("chat_template", "documents"):
        if body.get(key) is not None:
            kwargs[key] = body[key]
    return tokenizer.apply_chat_template(
        list(body["messages"]), tools=body.get("tools"), tokenize=False, add_generation_prompt=True, **kwargs
    )


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids `decode(skip_special_tokens=True)` drops: named specials and added special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _seen_texts(tokenizer: Any, previous: Turn) -> list[str]:
    """The texts the template may reproduce: the prompt, then the reply as the agent saw it.

    The chat API hides special tokens sampled *inside* a reply (skip_special_tokens), so the
    template cannot render them; they stay in the ids (the model did sample them) and are left
    out of the comparison. A special token *ending* the reply is tried verbatim first (the
    eos, which the template renders as the end of the turn), then hidden (a reply cut by
    `max_tokens` on some other special token). A prompt the mode built carries hidden tokens
    of earlier replies too, so its text is the template's (`previous.prompt_text`).
    """
    special = _special_ids(tokenizer)
    body, tail = list(previous.response_ids), []
    if body and body[-1] in special:
        body, tail = body[:-1], body[-1:]
    visible = [t for t in body if t not in special]
    replies = [visible + tail, visible] if tail else [visible]
    if previous.prompt_text is None:
        return [_decode(tokenizer, previous.prompt_ids + r) for r in replies]
    return [previous.prompt_text + _decode(tokenizer, r) for r in replies]


def plan_request(previous: Turn | None, body: Mapping[str, Any], tokenizer: Any) -> Plan:
    """Decide whether `body` (a chat request) extends `previous`; if so, build its prompt ids.

    `prompt_ids` = previous.prompt_ids + previous.response_ids + encode(continuation), with
    decode(prompt_ids) == the template's rendering of `body` (checked, never assumed; special
    tokens the model sampled inside its reply, which the agent never saw, excepted).
    """
    reason = _unsupported(body)
    if reason is not None:
        return _fallback("unsupported", reason)
    if previous is None:
        return _fallback("first_call", "first call of this rollout attempt (nothing to extend)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        return _fallback("unsupported", "'messages' is not a list of objects")
    plan = _check_extension(previous, normalize(messages)) or _check_setup(previous, body)
    if plan is not None:
        return plan
    if isinstance(previous.stop_reason, str) and not previous.stop_kept:
        return _fallback(
            "stop_string",
            f"the previous reply stopped on the stop string {previous.stop_reason!r}: "
            "its text was cut, so it no longer equals the sampled ids",
        )
    try:
        full = render_text(tokenizer, body)
    except Exception as exc:  # a template error is the request's business: the chat path reports it
        return _fallback("template_mismatch", f"the chat template failed to render the request: {exc}")
    context = previous.prompt_ids + previous.response_ids
    candidates = _seen_texts(tokenizer, previous)
    seen = next((text for text in candidates if full.startswith(text)), candidates[0])
    if not full.startswith(seen):
        i = _first_difference(seen, full)
        return _fallback(
            "template_mismatch",
            "the chat template renders the earlier turns differently from the "
            f"tokens the model saw and sampled (first difference at character {i}: "
            f"sampled {seen[i : i + 24]!r}, template {full[i : i + 24]!r})",
        )
    continuation = full[len(seen) :]
    new_ids = list(tokenizer(continuation, add_special_tokens=False)["input_ids"])
    if _decode(tokenizer, new_ids) != continuation:
        return _fallback("template_mismatch", "the continuation text does not round-trip through the tokenizer")
    return Plan(
        True,
        "extended",
        f"extends the previous call: {len(context)} ids kept, {len(new_ids)} new",
        context + new_ids,
        len(context),
        len(new_ids),
        full,
    )


# ---------------------------------------------------------------------------------------------
# Chat request → /completions request → chat response
# ---------------------------------------------------------------------------------------------


def completions_request(body: Mapping[str, Any], prompt_ids: Sequence[int]) -> dict[str, Any]:
    """The `/completions` body that samples like the chat `body` from `prompt_ids`."""
    out = {k: body[k] for k in FORWARDED_KEYS if k in body}
    out["prompt"] = list(prompt_ids)
    # Critical: an explicit null, not a missing key: vLLM's completions default is 16 tokens,
    # its chat default the rest of the context; null makes both engines use the chat default.
    out["max_tokens"] = body.get("max_tokens", body.get("max_completion_tokens"))
    if body.get("logprobs"):
        out["logprobs"] = int(body.get("top_logprobs") or 0)  # the sampled token's logprob is always included
    out["return_token_ids"] = True
    return out


def chat_logprobs(logprobs: Mapping[str, Any] | None, top_k: int) -> dict[str, Any] | None:
    """Completions logprobs `{tokens, token_logprobs, top_logprobs}` → chat `{content: [...]}`."""
    if not isinstance(logprobs, Mapping) or not isinstance(logprobs.get("token_logprobs"), list):
        return None
    tokens, values = logprobs.get("tokens") or [], logprobs["token_logprobs"]
    tops = logprobs.get("top_logprobs") or [None] * len(values)

    def entry(token: str, value: float) -> dict[str, Any]:
        return {"token": token, "logprob": value, "bytes": list(str(token).encode("utf-8"))}

    content = []
    for token, value, top in zip(tokens, values, tops):
        alts = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_k]
        content.append({**entry(token, value), "top_logprobs": [entry(t, v) for t, v in alts]})
    return {"content": content}


def chat_response(completion: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """A `/completions` answer → the chat completion the chat API would have returned for `body`
    (vLLM `return_token_ids` dialect: top-level `prompt_token_ids`, `choices[0].token_ids`)."""
    choice = dict(completion["choices"][0])
    text = choice.get("text") or ""
    content, tool_calls = parse_tool_calls(text) if body.get("tools") else (text, [])
    finish = choice.get("finish_reason")
    if tool_calls and finish == "stop":
        finish = "tool_calls"
    logprobs = (
        chat_logprobs(choice.get("logprobs"), int(body.get("top_logprobs") or 0)) if body.get("logprobs") else None
    )
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls, "reasoning_content": None}
    cid = str(completion.get("id") or uuid.uuid4().hex)
    return {
        "id": "chatcmpl-" + cid.removeprefix("cmpl-"),
        "object": "chat.completion",
        "created": completion.get("created", int(time.time())),
        "model": completion.get("model"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": choice.get("stop_reason"),
                "token_ids": choice.get("token_ids"),
            }
        ],
        "usage": completion.get("usage"),
        "prompt_logprobs": None,
        "prompt_token_ids": choice.get("prompt_token_ids"),
    }


def turn_from_exchange(body: Mapping[str, Any], response: Any, prompt_text: str | None = None) -> Turn | None:
    """The Turn to remember after a chat `response` to `body`; None if it carries no ids.
    `prompt_text`: `Plan.text` when the mode built the prompt."""
    if not isinstance(response, Mapping) or not isinstance(body.get("messages"), list):
        return None
    choices = response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else None
    prompt_ids = response.get("prompt_token_ids") or (first or {}).get("prompt_token_ids")
    if first is None or not prompt_ids or not first.get("token_ids") or not isinstance(first.get("message"), Mapping):
        return None
    return Turn(
        messages=normalize(body["messages"]),
        render={k: normalize(body.get(k)) for k in RENDER_KEYS},
        sampling={k: normalize(body.get(k)) for k in SAMPLING_KEYS},
        prompt_ids=[int(t) for t in prompt_ids],
        response_ids=[int(t) for t in first["token_ids"]],
        reply=normalize(first["message"]),
        finish_reason=first.get("finish_reason"),
        stop_reason=first.get("stop_reason"),
        prompt_text=prompt_text,
        stop_kept=body.get("include_stop_str_in_output") is True,
    )


# ---------------------------------------------------------------------------------------------
# The gateway adapter (a request rewriter, see agl_lab.server.gateway.ProxyCall)
# ---------------------------------------------------------------------------------------------

ANNOTATION_KEY = "token_preserving"


@dataclass
class TokenPreservingRewriter:
    """Gateway request rewriter of the token-preserving mode.

    Per chat call: plan against the attempt's memory; if the plan is used, send the prompt
    ids to `/completions` and reshape the answer into a chat completion; on every
    successful answer remember the turn. Every call is annotated with
    `token_preserving: {"used", "kind", "reason", ...}`. Tokenizers are registered per
    model name (`set_tokenizer`); a deep copy is kept so no other thread shares its state.
    Planning runs on the gateway's event loop (a render + an encode: about a millisecond).
    """

    memory: ConversationMemory = field(default_factory=ConversationMemory)
    prune_every: int = 512
    tokenizers: dict[str, Any] = field(default_factory=dict)
    _calls: int = field(default=0, init=False, repr=False)

    def set_tokenizer(self, model_name: str, tokenizer: Any) -> None:
        if not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise TypeError(
                f"set_tokenizer({model_name!r}, ...): expected a Hugging Face tokenizer with a chat "
                f"template, got {type(tokenizer).__name__}"
            )
        self.tokenizers[model_name] = copy.deepcopy(tokenizer)

    def __call__(self, call: Any) -> None:
        """Rewrite one `ProxyCall` in place (upstream path, upstream request, response hook)."""
        self._calls += 1
        if self._calls % self.prune_every == 0:
            self._prune(call.store)
        if call.upstream_path != "chat/completions":
            call.annotations[ANNOTATION_KEY] = _fallback(
                "not_chat", "completions call: its prompt is already explicit"
            ).annotation()
            return
        tokenizer = self.tokenizers.get(call.server.model)
        key = (call.rollout.rollout_id, call.attempt_id)
        if tokenizer is None:
            plan = _fallback(
                "no_tokenizer",
                f"no tokenizer registered for model {call.server.model!r}: call "
                "set_tokenizer(model_name, tokenizer) or start the server with "
                "--tokenizer-path",
            )
        else:
            plan = plan_request(self.memory.get(key), call.request, tokenizer)
        call.annotations[ANNOTATION_KEY] = plan.annotation()
        chat_body = dict(call.request)
        if plan.used:
            call.upstream_path = "completions"
            call.upstream_request = completions_request(chat_body, plan.prompt_ids or [])
        call.response_hooks.append(lambda payload, status: self._on_response(key, chat_body, plan, payload, status))

    def _prune(self, store: Any) -> None:
        """Forget the turns of rollouts that are gone: one store read per remembered rollout, so
        for a store that may block (Store.BLOCKING) in a worker thread, off the gateway's loop."""
        prune = functools.partial(self.memory.prune, lambda rid: _alive(store, rid))
        if not getattr(store, "BLOCKING", False):
            prune()
            return
        try:
            future = asyncio.get_running_loop().run_in_executor(None, prune)
        except RuntimeError:  # no loop: called outside the gateway
            prune()
            return
        future.add_done_callback(_log_prune_failure)

    def _on_response(self, key: tuple[str, str], body: dict[str, Any], plan: Plan, payload: Any, status: int) -> Any:
        if status >= 400 or not isinstance(payload, Mapping) or not payload.get("choices"):
            return payload  # errors pass through untouched; the memory keeps the last good turn
        response = chat_response(payload, body) if plan.used else payload
        turn = turn_from_exchange(body, response, plan.text if plan.used else None)
        if turn is None:
            self.memory.forget(*key)
        else:
            self.memory.put(key, turn)
        return response


def _log_prune_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("token-preserving memory: prune skipped (%s); the next one retries", future.exception())


def _alive(store: Any, rollout_id: str) -> bool:
    rollout = store.get_rollout(rollout_id)
    return rollout is not None and not rollout.is_terminal
