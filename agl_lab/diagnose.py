"""Merge-break diagnosis: why a call's prompt is not a token-prefix extension of its context.

At trajectory level (`agl_lab.batch`) the calls of a rollout are merged into one row as long
as each prompt starts with the previous context (prompt + response) token for token. When it
does not, the row ends there: a **merge break**. Breaks cost compute (the shared history is
encoded again in a new row) and hint at train/inference mismatch, so each one is explained:
the first divergent token, the ids and decoded pieces on both sides around it, and a class.

The rule (applied in this order; A = the previous context, B = the new prompt)
---------------------------------------------------------------------------------
Inputs: the ids of A and B, optionally a tokenizer, and optionally `model_mask`, one 0/1 per
token of A marking the tokens the model sampled (the responses of the row so far). Texts are
`decode(ids, skip_special_tokens=False)`; A's text is split at the mask boundaries by decoding
prefixes, so every character of A is known to be *model* text or *context* text (system,
user, tool observations and template scaffolding).

With a tokenizer:

1. ``retokenization`` — text(A) is a prefix of text(B) but the ids differ: the same text was
   encoded again (typically the gateway re-renders the chat, and BPE picks other merges than
   the model sampled, e.g. ``"Hel"+"lo"`` → ``"Hello"``).
2. A word-level diff (units: markup tags such as ``<|im_end|>`` or ``<think>``, ``\\w+``
   words, whitespace runs, single punctuation marks; difflib with its junk heuristic off)
   matches A against B. *Content* = non-whitespace characters outside markup tags (template
   scaffolding never counts); *removed* = content characters of A with no counterpart in B.
3. ``template`` — every removed character is model text, and every model response that lost
   characters keeps some content in B: the earlier response is still there in changed form
   (reasoning ``<think>…</think>`` stripped, tool calls re-serialised, markup changed),
   which is what a chat template does when it re-renders earlier assistant turns. Insertions
   alone (B = A with text added in the middle, e.g. an empty think block) also count as
   template. Ambiguity, stated: an agent that rewrites only its own past responses, or inserts
   a message without removing anything, is indistinguishable from a template at text level.
4. ``other`` — less than half of the content of A's *opening* (the text before the first
   model token: system prompt and task in a fresh row; all of A without a model mask) is found
   in B: not an edit of this conversation but another one (a sub-agent, a new episode, a
   summary that replaces the task).
5. ``history_edit`` — otherwise: context content was removed or rewritten (a message dropped,
   a tool result truncated, a user turn rewritten) or a whole model response vanished (the
   prompt rewinds, e.g. a retry): the agent edited its message history.

Without a tokenizer the same diff runs on ids (one unit per token; every token is content).
Ids show one case clearly: context tokens removed away from the edge of a model response
(re-encoding changes ids only around text that is re-rendered; observation ids came from the
same encoder) → ``history_edit``; an opening that keeps less than half its tokens →
``other``; everything else → ``other`` with a reason asking for a tokenizer.

Everything here is pure and cheap for the usual sizes (a few thousand tokens per context).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("retokenization", "template", "history_edit", "other")
WINDOW = 8
_TAG = re.compile(r"<[^<>\s]{1,32}>")  # markup such as <|im_end|>, <think>, </tool_call>
_WORD = re.compile(_TAG.pattern + r"|\w+|\s+|[^\w\s]")  # a tag is one diff unit
_SURVIVAL = 0.5  # fraction of context text that must survive for an "edit" of the conversation


# --------------------------------------------------------------------------- decoding


def decode_ids(ids: Sequence[int], tokenizer: Any = None) -> str:
    """Decode ids for diagnostics (keeps special tokens); space-joined ids without a tokenizer.

    Mirrors AGL's diagnostic decode: `decode(ids, skip_special_tokens=False)`, a tokenizer
    whose `decode` rejects the keyword is called plainly, any other failure falls back to the
    space-joined ids, so a diagnostic never raises.
    """
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return " ".join(map(str, ids))
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:
        try:
            return tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 - diagnostics must not fail
            return " ".join(map(str, ids))
    except Exception:  # noqa: BLE001
        return " ".join(map(str, ids))


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (ids or strings)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- token diff


@dataclass(frozen=True)
class TokenDiff:
    """The first divergent token of two id sequences and a window of context around it.

    | field    | meaning                                                         |
    |----------|-----------------------------------------------------------------|
    | index    | first position where the ids differ (= common prefix length)    |
    | start    | position of the first id shown in both windows                  |
    | a_ids    | `a[start : index + window]`                                     |
    | b_ids    | `b[start : index + window]`                                     |
    | a_pieces | each id of `a_ids` decoded alone                                |
    | b_pieces | each id of `b_ids` decoded alone                                |
    """

    index: int
    start: int
    a_ids: list[int]
    b_ids: list[int]
    a_pieces: list[str]
    b_pieces: list[str]


def token_diff(a: Sequence[int], b: Sequence[int], tokenizer: Any = None, window: int = WINDOW) -> TokenDiff:
    """Locate the first divergent token of `a` and `b` and show `window` tokens on each side."""
    a, b = [int(i) for i in a], [int(i) for i in b]
    index = common_prefix_len(a, b)
    start = max(0, index - window)
    a_ids, b_ids = a[start : index + window], b[start : index + window]
    return TokenDiff(
        index=index,
        start=start,
        a_ids=a_ids,
        b_ids=b_ids,
        a_pieces=[decode_ids([i], tokenizer) for i in a_ids],
        b_pieces=[decode_ids([i], tokenizer) for i in b_ids],
    )


# --------------------------------------------------------------------------- merge break


@dataclass(frozen=True)
class MergeBreak:
    """Diagnosis of one merge break (A = previous context, B = new prompt).

    `first_divergent_char` is the common text-prefix length (None without a tokenizer);
    `removed_text` / `inserted_text` are excerpts of what A lost and B gained in place — B's
    newly appended turn at the end is not counted as inserted (≤ 200 chars,
    ``" … "`` between chunks); `removed_model_chars` / `removed_context_chars` count removed
    content characters by origin (tokens without a tokenizer).
    """

    kind: str
    reason: str
    first_divergent_token: int
    prev_context_tokens: int
    prompt_tokens: int
    window_start: int
    prev_ids: list[int]
    prompt_ids: list[int]
    prev_pieces: list[str]
    prompt_pieces: list[str]
    first_divergent_char: int | None
    removed_text: str
    inserted_text: str
    removed_model_chars: int
    removed_context_chars: int


def diagnose_break(
    prev_context_ids: Sequence[int],
    prompt_ids: Sequence[int],
    tokenizer: Any = None,
    *,
    model_mask: Sequence[int] | None = None,
    window: int = WINDOW,
) -> MergeBreak:
    """Classify why `prompt_ids` does not extend `prev_context_ids` (rule: module docstring).

    `model_mask` (len = len(prev_context_ids), 1 = sampled by the model) enables the
    ``template`` class; without it all of A counts as context text.
    """
    a, b = [int(i) for i in prev_context_ids], [int(i) for i in prompt_ids]
    if b[: len(a)] == a:
        raise ValueError(
            "diagnose_break: prompt_ids extends prev_context_ids, so there is no merge break; "
            "call it only when the prompt does not start with the previous context."
        )
    mask = np.zeros(len(a), dtype=bool) if model_mask is None else np.asarray(model_mask, dtype=bool)
    if mask.shape != (len(a),):
        raise ValueError(
            f"diagnose_break: model_mask has {mask.size} entries but prev_context_ids has {len(a)}; "
            "pass one 0/1 per context token (1 = sampled by the model) or None."
        )
    diff = token_diff(a, b, tokenizer, window)
    if tokenizer is None:
        verdict = _classify_ids(a, b, mask)
    else:
        verdict = _classify_text(a, b, mask, tokenizer)
    return MergeBreak(
        kind=verdict.kind,
        reason=verdict.reason,
        first_divergent_token=diff.index,
        prev_context_tokens=len(a),
        prompt_tokens=len(b),
        window_start=diff.start,
        prev_ids=diff.a_ids,
        prompt_ids=diff.b_ids,
        prev_pieces=diff.a_pieces,
        prompt_pieces=diff.b_pieces,
        first_divergent_char=verdict.first_char,
        removed_text=verdict.removed_text,
        inserted_text=verdict.inserted_text,
        removed_model_chars=verdict.removed_model,
        removed_context_chars=verdict.removed_context,
    )


@dataclass
class _Verdict:
    kind: str
    reason: str
    first_char: int | None = None
    removed_text: str = ""
    inserted_text: str = ""
    removed_model: int = 0
    removed_context: int = 0


# --------------------------------------------------------------------------- alignment


def _align(a_units: list, b_units: list) -> tuple[np.ndarray, np.ndarray]:
    """Matched flags per unit of `a` and of `b` under a longest-matching-blocks diff.

    The common prefix is matched directly; difflib (autojunk off, so frequent units such as
    spaces still align) runs on the remainder only.
    """
    a_hit, b_hit = np.zeros(len(a_units), bool), np.zeros(len(b_units), bool)
    k = common_prefix_len(a_units, b_units)
    a_hit[:k], b_hit[:k] = True, True
    matcher = difflib.SequenceMatcher(None, a_units[k:], b_units[k:], autojunk=False)
    for i, j, n in matcher.get_matching_blocks():
        a_hit[k + i : k + i + n] = True
        b_hit[k + j : k + j + n] = True
    return a_hit, b_hit


def _excerpt(units: list[str], hit: np.ndarray, limit: int = 200) -> str:
    """Join the unmatched runs of `units` with ' … ', cut at `limit` characters."""
    chunks, current = [], []
    for unit, h in zip(units, hit):
        if not h:
            current.append(unit)
        elif current:
            chunks.append("".join(current))
            current = []
    if current:
        chunks.append("".join(current))
    text = " … ".join(c for c in chunks if c.strip())
    return text if len(text) <= limit else text[:limit] + "…"


def _model_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of True in a boolean vector."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


# --------------------------------------------------------------------------- classifiers


def _char_mask(a: list[int], mask: np.ndarray, tokenizer: Any, text: str) -> np.ndarray:
    """Per-character model flag of `text` = decode(a), cutting at decoded prefix lengths."""
    chars = np.zeros(len(text), dtype=bool)
    for start, end in _model_runs(mask):
        lo = len(decode_ids(a[:start], tokenizer)) if start else 0
        hi = len(decode_ids(a[:end], tokenizer)) if end < len(a) else len(text)
        chars[min(lo, len(text)) : min(hi, len(text))] = True
    return chars


def _opening_survival(content: np.ndarray, removed: np.ndarray, model: np.ndarray) -> float:
    """Fraction of the opening's content kept in B; the opening = everything before the first
    model token (system prompt and task in a fresh row; all of A without a model mask)."""
    first_model = np.flatnonzero(model)
    end = int(first_model[0]) if first_model.size else len(content)
    total = int(content[:end].sum())
    return 1.0 if total == 0 else 1 - int((content[:end] & removed[:end]).sum()) / total


def _classify_text(a: list[int], b: list[int], mask: np.ndarray, tokenizer: Any) -> _Verdict:
    text_a, text_b = decode_ids(a, tokenizer), decode_ids(b, tokenizer)
    first_char = common_prefix_len(text_a, text_b)
    if first_char == len(text_a):
        return _Verdict(
            "retokenization",
            "the context's text is a prefix of the new prompt's text but the ids differ: "
            "the same text was encoded again with other token merges",
            first_char,
        )
    units_a, units_b = _WORD.findall(text_a), _WORD.findall(text_b)
    a_hit, b_hit = _align(units_a, units_b)
    # Critical: per-character accounting, so a unit's origin is exact even at region edges.
    lens = np.fromiter(map(len, units_a), int, count=len(units_a))
    char_hit = np.repeat(a_hit, lens)
    char_model = _char_mask(a, mask, tokenizer, text_a)
    # Content = non-whitespace characters outside markup tags: scaffolding never counts.
    is_tag = np.repeat([bool(_TAG.fullmatch(u)) for u in units_a], lens).astype(bool)
    solid = np.array([not c.isspace() for c in text_a], dtype=bool) & ~is_tag
    removed = solid & ~char_hit
    # B's unmatched tail (after its last unit that A also has) is the turn the new call
    # appended — every next call adds one — so it is not part of what was inserted in place.
    b_edit = b_hit.copy()
    matched_b = np.flatnonzero(b_hit)
    b_edit[(matched_b[-1] + 1 if matched_b.size else 0) :] = True
    verdict = _Verdict(
        "other",
        "",
        first_char,
        _excerpt(units_a, a_hit),
        _excerpt(units_b, b_edit),
        int((removed & char_model).sum()),
        int((removed & ~char_model).sum()),
    )
    survival = _opening_survival(solid, removed, char_model)
    kept = solid & char_hit
    # a model response that lost content and kept none has vanished (not a re-rendering)
    vanished = [(s, e) for s, e in _model_runs(char_model) if removed[s:e].any() and not kept[s:e].any()]
    if verdict.removed_context == 0 and not vanished:
        verdict.kind = "template"
        verdict.reason = (
            f"only model text of earlier turns changed ({verdict.removed_model} chars removed): "
            "the chat template re-rendered earlier responses"
        )
    elif survival < _SURVIVAL:
        verdict.reason = (
            f"only {survival:.0%} of the row's opening prompt text survives: "
            "a different conversation (sub-agent, new episode or summary)"
        )
    else:
        what = f"{verdict.removed_context} chars of prompt/observation text"
        if verdict.removed_context == 0:
            what = f"{len(vanished)} whole model response(s)"
        verdict.kind = "history_edit"
        verdict.reason = f"{what} removed or rewritten: the agent edited its message history"
    return verdict


def _classify_ids(a: list[int], b: list[int], mask: np.ndarray) -> _Verdict:
    a_hit, _ = _align(a, b)
    removed = ~a_hit
    near_model = mask.copy()  # context tokens next to a model run may be re-merged by BPE
    near_model[1:] |= mask[:-1]
    near_model[:-1] |= mask[1:]
    verdict = _Verdict(
        "other", "", None, removed_model=int((removed & mask).sum()), removed_context=int((removed & ~mask).sum())
    )
    survival = _opening_survival(np.ones(len(a), bool), removed, mask)
    clear_edit = int((removed & ~near_model).sum())
    if survival < _SURVIVAL:
        verdict.reason = (
            f"only {survival:.0%} of the row's opening prompt tokens survive: "
            "a different conversation (sub-agent, new episode or summary)"
        )
    elif clear_edit:
        verdict.kind = "history_edit"
        verdict.reason = (
            f"{clear_edit} prompt/observation tokens away from any model response were removed "
            "or rewritten: the agent edited its message history"
        )
    else:
        verdict.reason = (
            "ids differ only in or next to model responses; pass a tokenizer to tell "
            "retokenization from a template change"
        )
    return verdict
