"""The `calc` task: answer an arithmetic question with a calculator tool, OpenAI tool-call style.

Made for a real small chat model (SmolLM2-135M-Instruct, `agl_lab.model.preset: smollm2-135m`)
rather than the tiny one: the agent passes `tools=[calculator]` through the OpenAI SDK, the
engine renders them with the model's ChatML template and parses Hermes
`<tool_call>{"name", "arguments"}</tool_call>` blocks back into `tool_calls`, and the agent
appends the assistant message *as the SDK returned it* plus a `tool` message — the path a real
agent takes, so merge breaks measured on it are the ones real agents meet:

    system     You answer arithmetic questions … (+ the tool list, rendered by the template)
    user       What is 3 + 4?                    ┐ two worked examples (a 135M model does not
    assistant  <tool_call>{… "3 + 4"}</tool_call>│ call tools from the description alone, and
    tool       7                                 │ hardly from one example)
    assistant  7                                 │
    user       What is 6 * 9?  … 54              ┘
    user       What is 17 * 3?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 3"}}</tool_call>
    tool       51
    assistant  51

Reward in [0, 1]: 0 without an answer, else 0.2 × [a calculator call parsed before the answer]
+ 0.8 × [the answer's last number equals the value] ("6 * 7 is 42." counts: the conclusion
comes last). Operands are 2…20, so the model is sometimes right without the tool and GRPO
groups do not all tie at zero. At most `MAX_TURNS` calls.

The serial tail (#51): a rollout's calls run in series, so the phase lasts as long as the slowest
rollout's decode steps. Every call stops at `</tool_call>` (`TOOL_CALL_STOP`, kept in the text so
the tool-call parser sees the block, and in the token ids so the next prompt extends the recorded
response: the merge by token prefix holds; the `<|im_end|>` the model would add lands in the next
prompt, an observation), and the answer call — every tool call the task needs made — is capped at
`ANSWER_MAX_TOKENS` (a number), not `MAX_TOKENS`. `call_options` is the one place both are set.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

MAX_TURNS = 4  # calc_chain: two calls and the answer, one spare
MAX_TOKENS = 48  # a call that may be a tool call (~25 tokens in SmolLM2's rendering)
ANSWER_MAX_TOKENS = 16  # the answer call: a number (SmolLM2: 1-4 tokens and <|im_end|>)
TOOL_CALL_STOP = ["</tool_call>"]
MODEL_NAME = "auto"
SYSTEM_PROMPT = "You answer arithmetic questions. Call the calculator tool, then reply with the number only."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression such as 12 * 7",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _worked_example(question: str, steps: list[str], call_id: str) -> list[dict[str, Any]]:
    """A solved question: one calculator call per step (each on the previous value), then the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for k, expression in enumerate(steps):
        call = {
            "id": f"{call_id}_{k}",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
        }
        result = calculator(call["function"]["arguments"])
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
        ]
    return [*messages, {"role": "assistant", "content": messages[-1]["content"]}]


TOOL_WEIGHT, ANSWER_WEIGHT = 0.2, 0.8
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_EXPR = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*$")
_NUMBER = re.compile(r"-?\d+")
_SALT = {"train": 0, "val": 1_000_003}


def make_tasks(n: int, seed: int, split: str, ops: int = 1) -> list[dict[str, Any]]:
    """`n` deterministic questions of a split: `a op b` (ops=1), or `(a op b) op c` (ops=2: the
    calculator takes one operator, so the answer needs two calls, the second on the first's result);
    2 ≤ a, b, c ≤ 20."""
    if ops not in (1, 2):
        raise ValueError(f"ops must be 1 or 2, got {ops!r}")
    rng = random.Random(seed * 7919 + _SALT[split] + (ops - 1) * 104_729)
    name = "calc" if ops == 1 else "calc_chain"
    out = []
    for i in range(n):
        a, b, op = rng.randint(2, 20), rng.randint(2, 20), rng.choice("+-*")
        steps, value = [f"{a} {op} {b}"], _OPS[op](a, b)
        if ops == 2:
            c, op2 = rng.randint(2, 20), rng.choice("+-*")
            steps.append(f"{value} {op2} {c}")
            value = _OPS[op2](value, c)
            question, expression = f"What is ({a} {op} {b}) {op2} {c}?", f"({a} {op} {b}) {op2} {c}"
        else:
            question, expression = f"What is {a} {op} {b}?", steps[0]
        out.append(
            {
                "task_id": f"{name}-{split}-{seed}-{i:05d}",
                "question": question,
                "expression": expression,
                "value": value,
                "ops": ops,
                "steps": steps,
            }
        )
    return out


def train_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "train")


def val_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "val")


def chain_train_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "train", ops=2)


def chain_val_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return make_tasks(n, seed, "val", ops=2)


def calculator(arguments: str) -> str:
    """The tool: `{"expression": "a op b"}` → the value, or an error text (never raises)."""
    try:
        match = _EXPR.match(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError):
        match = None
    if match is None:
        return 'error: expected {"expression": "a op b"} with integers and one of + - *'
    return str(_OPS[match.group(2)](int(match.group(1)), int(match.group(3))))


# Two worked examples: with one, zero-shot SmolLM2 starts a <tool_call> ~8 % of the time but writes a
# parsable calculator call in none of 64 rollouts (P(exact call) ≈ 0.01 at temperature 1); with two
# it writes one ~32 % of the time (a third: P ≈ 0.66, leaving little to learn, for 64 more prompt tokens).
EXAMPLES = [
    *_worked_example("What is 3 + 4?", ["3 + 4"], "call_0"),
    *_worked_example("What is 6 * 9?", ["6 * 9"], "call_1"),
]
# calc_chain: two two-step examples (the second call on the first call's result). Zero-shot SmolLM2 calls
# the tool in ~41 % of rollouts but chains in almost none (right answers 3 % of 64, with these examples as
# with one one-step + one two-step); with the latter, GRPO at LoRA lr 2e-4 learned the first call in ~5
# steps and then sat at reward 0.2 (every group tied): a task for more steps.
CHAIN_EXAMPLES = [
    *_worked_example("What is (3 + 4) * 2?", ["3 + 4", "7 * 2"], "call_0"),
    *_worked_example("What is (6 * 9) - 5?", ["6 * 9", "54 - 5"], "call_1"),
]


def reward(task: dict[str, Any], answer: Any) -> float:
    """Task success: 1.0 when the last integer of the answer is the value."""
    found = _NUMBER.findall(answer) if isinstance(answer, str) else []
    return 1.0 if found and int(found[-1]) == task["value"] else 0.0


def first_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    examples = CHAIN_EXAMPLES if task.get("ops", 1) == 2 else EXAMPLES
    return [{"role": "system", "content": SYSTEM_PROMPT}, *examples, {"role": "user", "content": task["question"]}]


def call_options(task: dict[str, Any], n_tool_results: int) -> dict[str, Any]:
    """The sampling options of the next call, after `n_tool_results` tool results: the stop at
    `</tool_call>` (through it: vLLM's `include_stop_str_in_output`, honoured by the local engine)
    and the cap — `ANSWER_MAX_TOKENS` once the task's `ops` calls are made, else `MAX_TOKENS`."""
    answer_due = n_tool_results >= task.get("ops", 1)
    return {
        "max_tokens": ANSWER_MAX_TOKENS if answer_due else MAX_TOKENS,
        "stop": TOOL_CALL_STOP,
        "extra_body": {"include_stop_str_in_output": True},
    }


def tool_loop(
    client: Any, messages: list[dict[str, Any]], task: dict[str, Any], cancelled: Any = None
) -> tuple[str | None, list[str], bool] | None:
    """The append-only tool loop on `messages` (extended in place): call, run each tool call, send the
    results back, until a text reply or `MAX_TURNS` calls (`call_options(task, ...)` each call).

    Returns (the text reply, None when the calls ran out; the calculator's results in call order;
    whether the calculator was called), or None once `cancelled` (a threading.Event) is set."""
    results: list[str] = []
    called, n_results = False, 0
    for _ in range(MAX_TURNS):
        if cancelled is not None and cancelled.is_set():
            return None
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=1.0, **call_options(task, n_results)
        )
        msg = resp.choices[0].message
        if not msg.tool_calls:
            return msg.content or "", results, called
        messages.append(msg.model_dump(include={"role", "content", "tool_calls"}))  # as the SDK returned it
        for call in msg.tool_calls:
            if call.function.name == "calculator":
                called, result = True, calculator(call.function.arguments)
                results.append(result)
            else:
                result = "error: no such tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            n_results += 1
    return None, results, called


def calc_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """`tool_loop` on the task's question, then the reward: TOOL_WEIGHT for calling the calculator,
    ANSWER_WEIGHT for the right number."""
    from agl_lab.tasks.lookup import openai_client

    loop = tool_loop(openai_client(ctx), first_messages(task), task, getattr(ctx, "cancelled", None))
    if loop is None:
        return None
    answer, _, called = loop
    value = 0.0 if answer is None else TOOL_WEIGHT * called + ANSWER_WEIGHT * reward(task, answer)
    emit = getattr(ctx, "emit", None)
    if callable(emit):
        emit("task_result", {"success": reward(task, answer), "answer": answer, "tool_called": called, "reward": value})
    return value


def demonstrations(n: int, seed: int, ops: int = 1) -> list[list[dict[str, Any]]]:
    """`n` correct transcripts (for a supervised warm start, if one is wanted)."""
    return [
        first_messages(task)[:-1] + _worked_example(task["question"], task["steps"], "call_9")
        for task in make_tasks(n, seed, "train", ops)
    ]


def chain_demonstrations(n: int, seed: int) -> list[list[dict[str, Any]]]:
    return demonstrations(n, seed, ops=2)
