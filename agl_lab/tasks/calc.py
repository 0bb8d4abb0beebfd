"""The `calc` task: answer an arithmetic question with a calculator tool, OpenAI tool-call style.

Made for a real small chat model (SmolLM2-135M-Instruct, `agl_lab.model.preset: smollm2-135m`)
rather than the tiny one: the agent passes `tools=[calculator]` through the OpenAI SDK, the
engine renders them with the model's ChatML template and parses Hermes
`<tool_call>{"name", "arguments"}</tool_call>` blocks back into `tool_calls`, and the agent
appends the assistant message *as the SDK returned it* plus a `tool` message — the path a real
agent takes, so merge breaks measured on it are the ones real agents meet:

    system     You answer arithmetic questions … (+ the tool list, rendered by the template)
    user       What is 3 + 4?                    ┐ one worked example (a 135M model does not
    assistant  <tool_call>{… "3 + 4"}</tool_call>│ call tools from the description alone)
    tool       7                                 │
    assistant  7                                 ┘
    user       What is 17 * 3?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 3"}}</tool_call>
    tool       51
    assistant  51

Reward in [0, 1]: 0 without an answer, else 0.2 × [a calculator call parsed before the answer]
+ 0.8 × [the answer's last number equals the value] ("6 * 7 is 42." counts: the conclusion
comes last). Operands are 2…20, so the model is sometimes right without the tool and GRPO
groups do not all tie at zero. At most `MAX_TURNS` calls.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

MAX_TURNS = 3
MAX_TOKENS = 48
MODEL_NAME = "auto"
SYSTEM_PROMPT = "You answer arithmetic questions. Call the calculator tool, then reply with the number only."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 12 * 7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
EXAMPLE = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "3 + 4"})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "7"},
    {"role": "assistant", "content": "7"},
]
TOOL_WEIGHT, ANSWER_WEIGHT = 0.2, 0.8
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_EXPR = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*$")
_NUMBER = re.compile(r"-?\d+")
_SALT = {"train": 0, "val": 1_000_003}


def make_tasks(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` deterministic questions `a op b` (2 ≤ a, b ≤ 20) of a split."""
    rng = random.Random(seed * 7919 + _SALT[split])
    out = []
    for i in range(n):
        a, b, op = rng.randint(2, 20), rng.randint(2, 20), rng.choice("+-*")
        out.append({"task_id": f"calc-{split}-{seed}-{i:05d}", "question": f"What is {a} {op} {b}?",
                    "expression": f"{a} {op} {b}", "value": _OPS[op](a, b)})
    return out


def train_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "train")


def val_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "val")


def calculator(arguments: str) -> str:
    """The tool: `{"expression": "a op b"}` → the value, or an error text (never raises)."""
    try:
        match = _EXPR.match(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError):
        match = None
    if match is None:
        return "error: expected {\"expression\": \"a op b\"} with integers and one of + - *"
    return str(_OPS[match.group(2)](int(match.group(1)), int(match.group(3))))


def reward(task: dict[str, Any], answer: Any) -> float:
    """Task success: 1.0 when the last integer of the answer is the value."""
    found = _NUMBER.findall(answer) if isinstance(answer, str) else []
    return 1.0 if found and int(found[-1]) == task["value"] else 0.0


def first_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": task["question"]}]


def calc_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """Append-only tool loop: call, run each tool call, send the results back, until a text answer."""
    from agl_lab.tasks.lookup import openai_client

    client = openai_client(ctx)
    messages = first_messages(task)
    called, answer = False, None
    cancelled = getattr(ctx, "cancelled", None)
    for _ in range(MAX_TURNS):
        if cancelled is not None and cancelled.is_set():
            return None
        resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                              max_tokens=MAX_TOKENS, temperature=1.0)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            answer = msg.content or ""
            break
        messages.append(msg.model_dump(include={"role", "content", "tool_calls"}))  # as the SDK returned it
        for call in msg.tool_calls:
            called = called or call.function.name == "calculator"
            result = calculator(call.function.arguments) if call.function.name == "calculator" else "error: no such tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    value = 0.0 if answer is None else TOOL_WEIGHT * called + ANSWER_WEIGHT * reward(task, answer)
    emit = getattr(ctx, "emit", None)
    if callable(emit):
        emit("task_result", {"success": reward(task, answer), "answer": answer, "tool_called": called,
                             "reward": value})
    return value


def demonstrations(n: int, seed: int) -> list[list[dict[str, Any]]]:
    """`n` correct transcripts (for a supervised warm start, if one is wanted)."""
    out = []
    for task in make_tasks(n, seed, "train"):
        call = {"id": "call_1", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": task["expression"]})}}
        out.append(first_messages(task) + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": str(task["value"])},
                                           {"role": "assistant", "content": str(task["value"])}])
    return out
