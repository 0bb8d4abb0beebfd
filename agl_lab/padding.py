"""Training rows → padded arrays, fast: `pad_rows(rows, P, R, pad)` and its numpy kernels.

The cost of batch building is converting Python ints to arrays, so every distinct id converts
once, with `np.array(list)` (~20 ns/id; `np.fromiter` over a chain is ~2x slower), and masks
are built from spans instead of per-token Python lists. Pure (numpy only).

    context_arrays(contexts, ...)              prompts [N, P] left padded, responses [N, R] right padded
    span_arrays(spans, span_values, n, width)  response mask [N, R] and logprobs [N, R] from spans
    spans_to_list(spans, fill, values, total)  the same for one row, as a Python list
    positions(prompt_lens, response_lens, P, R) [N, P+R] clamp(cumsum(attention) − 1, 0)

`context_arrays` shares prefixes: a prompt that starts with the previous row's (the calls of
one rollout at the transition level) converts only its new tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def to_array(seq: Sequence, dtype: type = np.int64) -> np.ndarray:
    """One 1-D array from a list (empty lists give an empty array of `dtype`)."""
    return np.array(seq, dtype=dtype) if len(seq) else np.zeros(0, dtype=dtype)


def flat(seqs: Sequence[Sequence], dtype: type = np.int64) -> np.ndarray:
    """All sequences concatenated, converted once."""
    joined: list = []
    for s in seqs:
        joined += s
    return to_array(joined, dtype)


def context_arrays(
    contexts: Sequence[tuple[list[int], list[int]]],
    first_prompt_lens: Sequence[int],
    prompt_lens: np.ndarray,
    response_lens: np.ndarray,
    p: int,
    r: int,
    pad: int,
    groups: Sequence | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Padded prompts [N, P] (left) and responses [N, R] (right) from each row's context.

    Row i's context is (last prompt L, last response S) and its first prompt is L[:f]:
    prompt = L[:prompt_lens[i]], response = (L[f:] + S)[:response_lens[i]] (lengths after
    limits, <= P and R). Only L and S convert; a row whose group equals the previous row's and
    whose L starts with the previous L (the calls of one rollout at the transition level)
    converts only L's new tail.
    """
    n = len(contexts)
    prompts = np.full((n, p), pad, dtype=np.int64)
    responses = np.full((n, r), pad, dtype=np.int64)
    buf = np.empty(max((len(c[0]) for c in contexts), default=0), dtype=np.int64)
    prev: list[int] | None = None
    for i, (last_prompt, last_response) in enumerate(contexts):
        k, m = len(prev) if prev is not None else 0, len(last_prompt)
        if groups is not None and i and groups[i] == groups[i - 1] and 0 < k <= m and last_prompt[:k] == prev:
            if m > k:
                buf[k:m] = last_prompt[k:]
        elif m:
            buf[:m] = to_array(last_prompt)
        pl, rl, f = int(prompt_lens[i]), int(response_lens[i]), first_prompt_lens[i]
        prompts[i, p - pl :] = buf[:pl]
        obs = min(m - f, rl)  # observations (and earlier responses) between the first prompt and S
        responses[i, :obs] = buf[f : f + obs]
        if rl > obs:
            responses[i, obs:rl] = last_response[: rl - obs]
        prev = last_prompt
    return prompts, responses


def span_scatter(rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row index, column index) of every slot covered by the spans, in span order.

    Span j covers columns starts[j] .. starts[j] + lengths[j] − 1 of row rows[j].
    """
    total = int(lengths.sum())
    before = np.cumsum(lengths) - lengths  # first flat position of each span
    row_index = np.repeat(rows, lengths)
    col_index = np.arange(total, dtype=np.int64) - np.repeat(before - starts, lengths)
    return row_index, col_index


def positions(prompt_lens: np.ndarray, response_lens: np.ndarray, p: int, r: int) -> np.ndarray:
    """[N, P+R] int64 = clamp(cumsum(attention_mask) − 1, 0) for left-padded prompts followed by
    right-padded responses, without the cumsum: column − first attended column, clamped to
    [0, last attended position]."""
    first = (p - prompt_lens)[:, None]
    last = (prompt_lens + response_lens - 1)[:, None]
    out = np.arange(p + r, dtype=np.int64)[None, :] - first
    np.maximum(out, 0, out=out)
    np.minimum(out, np.maximum(last, 0), out=out)
    return out


def span_arrays(
    spans: Sequence[Sequence[tuple[int, int]]],
    span_values: Sequence[Sequence[Sequence[float]] | None],
    n: int,
    width: int,
) -> tuple[np.ndarray, np.ndarray]:
    """mask [N, width] int64 (1 on every span) and values [N, width] float32 (span j of row i
    holds span_values[i][j], truncated to its length; 0.0 elsewhere and in rows whose
    span_values is None). Spans are (start, length) within [0, width)."""
    span_rows = np.repeat(np.arange(n), [len(s) for s in spans])
    starts = np.fromiter((a for s in spans for a, _ in s), np.int64, len(span_rows))
    counts = np.fromiter((b for s in spans for _, b in s), np.int64, len(span_rows))
    row_index, col_index = span_scatter(span_rows, starts, counts)
    mask = np.zeros((n, width), dtype=np.int64)
    mask[row_index, col_index] = 1
    values = np.zeros((n, width), dtype=np.float32)
    has = np.fromiter((v is not None for v in span_values), bool, n)
    if has.any():
        pieces = [
            lp[:b] if len(lp) > b else lp
            for s, v in zip(spans, span_values)
            if v is not None
            for lp, (_, b) in zip(v, s)
        ]
        keep = has[row_index]
        values[row_index[keep], col_index[keep]] = flat(pieces, np.float32)
    return mask, values


def span_values(
    spans: Sequence[Sequence[tuple[int, int]]], values: Sequence[Sequence[int]], n: int, width: int
) -> np.ndarray:
    """[N, width] int64: every token of span j of row i holds values[i][j]; -1 elsewhere (and
    where a row has fewer values than spans)."""
    span_rows = np.repeat(np.arange(n), [len(s) for s in spans])
    starts = np.fromiter((a for s in spans for a, _ in s), np.int64, len(span_rows))
    counts = np.fromiter((b for s in spans for _, b in s), np.int64, len(span_rows))
    row_index, col_index = span_scatter(span_rows, starts, counts)
    flat_values = np.fromiter(
        (vs[j] if j < len(vs) else -1 for s, vs in zip(spans, values) for j in range(len(s))), np.int64, len(span_rows)
    )
    out = np.full((n, width), -1, dtype=np.int64)
    out[row_index, col_index] = np.repeat(flat_values, counts)
    return out


def spans_to_list(spans: Sequence[tuple[int, int]], fill: int, values: Sequence[Sequence] | None, total: int) -> list:
    """One row as a list of `total` items: `fill` (values=None; gaps 0) or values[j][:length]
    (gaps 0.0) on span j."""
    out: list = []
    gap = 0 if values is None else 0.0
    for j, (start, length) in enumerate(spans):
        if start > len(out):
            out += [gap] * (start - len(out))
        out += [fill] * length if values is None else values[j][:length]
    if total > len(out):
        out += [gap] * (total - len(out))
    return out


def pad_rows(
    rows: Sequence[Any], max_prompt_length: int, max_response_length: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """Vectorised padding of N rows (P = max_prompt_length, R = max_response_length).

    | key                 | shape    | content                                               |
    |---------------------|----------|-------------------------------------------------------|
    | prompts             | [N, P]   | left padded with `pad_token_id`                       |
    | prompt_mask         | [N, P]   | 1 on prompt tokens                                    |
    | responses           | [N, R]   | right padded                                          |
    | response_attention  | [N, R]   | 1 on model and observation tokens                     |
    | response_mask       | [N, R]   | 1 on model tokens only                                |
    | rollout_log_probs   | [N, R]   | 0.0 on observations/padding (meaningful iff all rows) |
    | response_lengths    | [N]      | unpadded response lengths                             |
    | prompt_lengths      | [N]      | unpadded prompt lengths                               |

    `rows` are `agl_lab.batch.Row`s (read: context, first_prompt_tokens, prompt_tokens,
    response_tokens, spans, span_logprobs, rollout_id). Each distinct id converts to numpy once
    (`context_arrays`); masks and logprobs are scattered from the rows' model-token spans.
    """
    n, p, r = len(rows), max_prompt_length, max_response_length
    prompt_lengths = np.fromiter((row.prompt_tokens for row in rows), np.int64, n)
    response_lengths = np.fromiter((row.response_tokens for row in rows), np.int64, n)
    prompts, responses = context_arrays(
        [row.context for row in rows],
        [row.first_prompt_tokens for row in rows],
        prompt_lengths,
        response_lengths,
        p,
        r,
        pad_token_id,
        groups=[row.rollout_id for row in rows],
    )
    response_mask, logprobs = span_arrays([row.spans for row in rows], [row.span_logprobs for row in rows], n, r)
    return {
        "prompts": prompts,
        "prompt_mask": (np.arange(p) >= p - prompt_lengths[:, None]).astype(np.int64),
        "responses": responses,
        "response_attention": (np.arange(r) < response_lengths[:, None]).astype(np.int64),
        "response_mask": response_mask,
        "rollout_log_probs": logprobs,
        "response_lengths": response_lengths,
        "prompt_lengths": prompt_lengths,
    }
