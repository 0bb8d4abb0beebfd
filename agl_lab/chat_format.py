"""Chat-format helpers shared by the engine's OpenAI server and the gateway.

Hermes-style tool calls, as ChatML models emit them and vLLM's `hermes` parser reads them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

# The assistant's `tool_calls` rendered as Hermes `<tool_call>` blocks, one per call, for the
# chat templates of the built-in models (tiny and SmolLM2): the inverse of the parser below.
TOOL_CALLS_JINJA = (
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set call = tc['function'] if tc.get('function') else tc %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` blocks → (content, tool_calls).

    Any malformed block leaves the text alone (no calls), as a chat server's parser would.
    """
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": str(name), "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls
