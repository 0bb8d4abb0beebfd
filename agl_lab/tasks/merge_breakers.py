"""Agents that break the trajectory merge on purpose, the way real agents do.

The batch builder merges the calls of a rollout into one row while each call's prompt
is an exact token-prefix extension of the previous call's prompt + reply. Real agents
break that in three ways, and the merge-debug notebook needs one agent per way, all on
the `lookup` task so their rows can be compared side by side:

| agent                      | what it does between calls                        | merge break it causes |
|----------------------------|---------------------------------------------------|-----------------------|
| `append_only_agent`        | appends reply + observation (the default agent)   | retokenization only: the reply's text re-encodes to other ids than were sampled (BPE drift) |
| `reasoning_dropping_agent` | strips `<think>…</think>` from earlier replies, as Qwen3's chat template drops old reasoning | template: earlier-turn content vanishes from the prompt |
| `history_editing_agent`    | rewrites the system message after the first call to offer only `answer`, as agents that change their tool list between calls do | history edit: context text was rewritten |

Each is a normal `agent(task, ctx)`: they differ from the default agent only in the
function that builds the next call's messages (`lookup.play(next_messages=…)`).
"""

from __future__ import annotations

from typing import Any

from agl_lab.tasks import lookup
from agl_lab.tasks.lookup import Messages

# ---------------------------------------------------------------------------------------------
# History functions: (sent, reply, observation) -> next conversation
# ---------------------------------------------------------------------------------------------


def drop_reasoning_history(sent: Messages, reply: str, observation: str) -> Messages:
    """Append the turn, then strip `<think>…</think>` from *every* assistant message.

    This is what a Qwen3-style template does on the server side (reasoning of earlier
    turns is not rendered); doing it in the agent produces the same prompt tokens.
    """
    history = lookup.append_turn(sent, reply, observation)
    return [
        {**m, "content": lookup.strip_reasoning(m["content"]).strip()} if m["role"] == "assistant" else m
        for m in history
    ]


ANSWER_ONLY_SYSTEM_PROMPT = "Reply answer VALUE."


def narrow_tools_history(sent: Messages, reply: str, observation: str) -> Messages:
    """Append the turn, then rewrite the system message to offer only `answer`.

    (Dropping the whole system message would be diagnosed `other`, not `history_edit`:
    with most of the conversation's opening gone it no longer reads as the same chat.)
    """
    history = lookup.append_turn(sent, reply, observation)
    return [{**m, "content": ANSWER_ONLY_SYSTEM_PROMPT} if m["role"] == "system" else m for m in history]


# ---------------------------------------------------------------------------------------------
# Agents
# ---------------------------------------------------------------------------------------------


def append_only_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """The plain agent: history grows append-only (merges break only on BPE drift)."""
    return lookup.lookup_agent(task, ctx)


def reasoning_dropping_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """Asks the model to think in `<think>…</think>` first, and drops old reasoning from history."""
    episode = lookup.play(
        task,
        ctx,
        next_messages=drop_reasoning_history,
        system_prompt=lookup.THINK_SYSTEM_PROMPT,
        max_tokens=lookup.THINK_MAX_TOKENS,
    )
    return lookup.finish(task, ctx, episode)


def history_editing_agent(task: dict[str, Any], ctx: Any) -> float | None:
    """Edits its history between calls: after the first call the system message offers only `answer`."""
    return lookup.finish(task, ctx, lookup.play(task, ctx, next_messages=narrow_tools_history))
