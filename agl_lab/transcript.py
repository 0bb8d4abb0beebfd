"""One rollout as text: what the model saw and said, call by call, with token counts (pure).

`Trainer.dry_run(task)` prints this for one run of the agent — Agent Lightning's `dev()`
equivalent: check the agent's conversation, the token budget and the reward before
training on it.

    call 0 · prompt 21 tokens · response 3 tokens
      ▸ <|im_start|>system\nReply get KEY or answer VALUE.<|im_end|> …
      ◂ get c<|im_end|>
    call 1 · prompt 31 tokens (+7 new) · response 3 tokens
      ▸ \n<|im_start|>user\nc is red<|im_end|> …        (only the tokens after the last context)
      ◂ answer red<|im_end|>
    reward 1.000 · succeeded
"""

from __future__ import annotations

from typing import Any

from agl_lab.records import CompletedRollout


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=False)


def _escape(text: str) -> str:
    """Newlines and tabs visible, other control characters as \\xNN: one line per turn."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def format_transcript(rollout: CompletedRollout, tokenizer: Any = None, *, width: int = 400) -> str:
    """The calls of `rollout` as text (see the module docstring). A prompt that extends the
    previous call's context shows only its new tokens (`+k new`); one that does not (a merge
    break) is shown whole and marked. Texts longer than `width` characters are cut in the middle."""

    def cut(text: str) -> str:
        text = _escape(text)
        return text if len(text) <= width else text[: width // 2] + " … " + text[-width // 2 :]

    lines = [f"rollout {rollout.rollout_id} · task {rollout.data_id} · {len(rollout.triplets)} calls"]
    context: list[int] = []
    for i, t in enumerate(rollout.triplets):
        prompt, response = list(t.prompt_ids), list(t.response_ids)
        extends = bool(context) and prompt[: len(context)] == context
        shown = prompt[len(context) :] if extends else prompt
        note = f" (+{len(shown)} new)" if extends else (" (does not extend the previous context)" if context else "")
        lines.append(f"call {i} · prompt {len(prompt)} tokens{note} · response {len(response)} tokens")
        lines.append(f"  ▸ {cut(_decode(tokenizer, shown))}")
        lines.append(f"  ◂ {cut(_decode(tokenizer, response))}")
        context = prompt + response
    repeats = int((rollout.metadata or {}).get("n_repeated_prompt_calls_dropped", 0))
    if repeats:
        lines.append(
            f"{repeats} call(s) repeated an identical prompt and were dropped (AGL's triplet reduction keeps "
            "the last call per prompt; agl_lab.rollout.keep_repeated_prompts=true keeps every call)"
        )
    reward = "None" if rollout.final_reward is None else f"{rollout.final_reward:.3f}"
    lines.append(f"reward {reward} · {rollout.state}")
    if rollout.error_message:
        lines.append(f"error: {rollout.error_message.strip()}")
    return "\n".join(lines)
