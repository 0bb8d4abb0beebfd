"""Merge-break diagnosis: golden ids-only cases, a word-vocabulary tokenizer, and the real
byte-level BPE tokenizer of the tiny model (ChatML renders) for each class."""

from __future__ import annotations

import pytest

from agl_lab.batch import build_batch
from agl_lab.diagnose import decode_ids, diagnose_break, token_diff
from agl_lab.records import CompletedRollout, Triplet
from agl_lab.results import BatchResult


class VocabTokenizer:
    """decode = concatenation of fixed pieces; two ways to spell "Hello" (3 vs 1+2)."""

    PIECES = {
        1: "Hel",
        2: "lo",
        3: "Hello",
        4: " world",
        5: "<u>",
        6: "</u>",
        7: "<a>",
        8: "</a>",
        9: " bye",
        10: "<think>",
        11: "hmm",
        12: "</think>",
        13: " again",
        14: "<s>",
        15: "rules",
    }

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)


# =========================================================================== decoding and diffs


def test_decode_ids_falls_back_like_agl():
    class NoKeyword:
        def decode(self, ids):
            return "|".join(map(str, ids))

    class Broken:
        def decode(self, ids, skip_special_tokens=False):
            raise KeyError("boom")

    assert decode_ids([1, 2], None) == "1 2"
    assert decode_ids([1, 2], NoKeyword()) == "1|2"
    assert decode_ids([1, 2], Broken()) == "1 2"


def test_token_diff_window_and_pieces():
    a = list(range(20))
    b = a[:12] + [99, 98] + a[14:]
    d = token_diff(a, b, None, window=3)
    assert (d.index, d.start) == (12, 9)
    assert d.a_ids == [9, 10, 11, 12, 13, 14] and d.b_ids == [9, 10, 11, 99, 98, 14]
    assert d.a_pieces == ["9", "10", "11", "12", "13", "14"]
    assert token_diff([1, 2], [1, 2, 3]).index == 2


def test_diagnose_break_rejects_non_breaks_and_bad_masks():
    with pytest.raises(ValueError, match="no merge break"):
        diagnose_break([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="model_mask has 1 entries but prev_context_ids has 2"):
        diagnose_break([1, 2], [3], model_mask=[1])


# =========================================================================== ids only


def test_ids_only_history_edit_when_context_tokens_vanish():
    # context: [sys+task 10 11 12 20 21 | model 30 31 | tool 40 41 42 43 | model 32 33]; drop the tool turn
    context = [10, 11, 12, 20, 21, 30, 31, 40, 41, 42, 43, 32, 33]
    mask = [0] * 5 + [1, 1] + [0] * 4 + [1, 1]
    b = diagnose_break(context, [10, 11, 12, 20, 21, 30, 31, 32, 33, 50], model_mask=mask)
    assert b.kind == "history_edit" and b.first_divergent_token == 7
    assert "2 prompt/observation tokens" in b.reason  # 40 and 43 touch model runs: not counted
    assert b.removed_context_chars == 4 and b.removed_model_chars == 0
    assert b.first_divergent_char is None  # no tokenizer, no text
    assert b.prev_ids == context[:13] and b.prompt_ids == [10, 11, 12, 20, 21, 30, 31, 32, 33, 50]


def test_ids_only_model_token_changes_need_a_tokenizer():
    context, mask = [10, 11, 12, 30, 31, 40, 41], [0, 0, 0, 1, 1, 0, 0]
    b = diagnose_break(context, [10, 11, 12, 33, 40, 41, 50], model_mask=mask)
    assert b.kind == "other" and "pass a tokenizer" in b.reason
    assert b.removed_model_chars == 2


def test_ids_only_other_for_a_different_conversation():
    b = diagnose_break([10, 11, 12, 13, 30], [60, 61, 62, 10], model_mask=[0, 0, 0, 0, 1])
    assert b.kind == "other" and "different conversation" in b.reason


# =========================================================================== text (vocab tokenizer)


def test_text_retokenization_same_text_other_ids():
    tok = VocabTokenizer()
    b = diagnose_break([5, 7, 1, 2], [5, 7, 3, 8, 5, 9], tok, model_mask=[0, 0, 1, 1])
    assert b.kind == "retokenization" and b.first_divergent_token == 2
    assert b.prev_pieces == ["<u>", "<a>", "Hel", "lo"] and b.prompt_pieces == [
        "<u>",
        "<a>",
        "Hello",
        "</a>",
        "<u>",
        " bye",
    ]
    assert b.first_divergent_char == len("<u><a>Hello")


def test_text_template_when_only_model_text_changed():
    tok = VocabTokenizer()
    # <s>rules<u> Hello <a> <think>hmm</think> world </a> → earlier reasoning stripped
    context, mask = [14, 15, 5, 3, 7, 10, 11, 12, 4, 8], [0] * 5 + [1] * 5
    b = diagnose_break(context, [14, 15, 5, 3, 7, 4, 8, 5, 13], tok, model_mask=mask)
    assert b.kind == "template"
    assert b.removed_text == "<think>hmm</think>" and b.removed_context_chars == 0


def test_text_history_edit_and_vanished_response():
    tok = VocabTokenizer()
    context, mask = [14, 15, 5, 3, 6, 7, 4, 8, 5, 9, 6], [0] * 6 + [1, 1] + [0] * 3
    dropped_user = diagnose_break(context, [14, 15, 7, 4, 8, 5, 9, 6, 5, 13], tok, model_mask=mask)
    assert dropped_user.kind == "history_edit" and dropped_user.removed_text == "<u>Hello</u>"
    assert dropped_user.inserted_text == ""  # the appended "<u> again" turn is not an insertion
    rewritten = diagnose_break(context, [14, 15, 5, 1, 2, 4, 6, 7, 4, 8, 5, 9, 6, 5, 13], tok, model_mask=mask)
    assert rewritten.inserted_text == " world"  # the in-place rewrite ("Hello" is kept), not the new turn
    # the prompt rewinds to before the last response: a whole model response vanished
    rewind = diagnose_break(context + [7, 9, 8], context, tok, model_mask=mask + [1, 1, 1])
    assert rewind.kind == "history_edit" and "whole model response" in rewind.reason


# =========================================================================== real BPE (tiny model)


@pytest.fixture(scope="module")
def tok():
    from agl_lab.engines.tiny import load_tokenizer

    return load_tokenizer()


def render(tok, messages):
    return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def sampled(tok, text, char_by_char=False):
    """Ids a model could have sampled for `text`, ending with <|im_end|>."""
    pieces = list(text) if char_by_char else [text]
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


SYS = {"role": "system", "content": "You are a helpful agent that uses tools."}
USER = {"role": "user", "content": "What is the value of alpha plus two?"}


def test_bpe_retokenization_of_sampled_ids(tok):
    text = "Let me look up the value of alpha."
    p1, r1 = render(tok, [SYS, USER]), sampled(tok, text, char_by_char=True)
    p2 = render(tok, [SYS, USER, {"role": "assistant", "content": text}, {"role": "tool", "content": "alpha = 40"}])
    assert p2[: len(p1 + r1)] != p1 + r1  # the chat was re-encoded: a real break
    b = diagnose_break(p1 + r1, p2, tok, model_mask=[0] * len(p1) + [1] * len(r1))
    assert b.kind == "retokenization" and b.first_divergent_token >= len(p1)


def test_bpe_template_strips_earlier_reasoning(tok):
    p1 = render(tok, [SYS, USER])
    r1 = sampled(tok, "<think>I should call the lookup tool first.</think>The answer is 42.")
    stripped = {"role": "assistant", "content": "The answer is 42."}  # what a reasoning template renders
    p2 = render(tok, [SYS, USER, stripped, {"role": "user", "content": "Are you sure? Check again."}])
    b = diagnose_break(p1 + r1, p2, tok, model_mask=[0] * len(p1) + [1] * len(r1))
    assert b.kind == "template"
    assert b.removed_text == "<think>I should call the lookup tool first.</think>"


def test_bpe_history_edit_drops_a_middle_message(tok):
    a1 = {"role": "assistant", "content": "I will look up alpha."}
    obs = {"role": "tool", "content": "alpha = 40, beta = 7, gamma is unknown"}
    p = render(tok, [SYS, USER, a1, obs])
    r = sampled(tok, "Now I add two.")
    p2 = render(
        tok,
        [
            SYS,
            USER,
            a1,
            {"role": "assistant", "content": "Now I add two."},
            {"role": "user", "content": "Good, continue."},
        ],
    )
    b = diagnose_break(p + r, p2, tok, model_mask=[0] * len(p) + [1] * len(r))
    assert b.kind == "history_edit" and "alpha = 40, beta = 7, gamma is unknown" in b.removed_text


def test_bpe_subagent_prompt_is_other(tok):
    p, r = render(tok, [SYS, USER]), sampled(tok, "I will ask the search helper.")
    p2 = render(
        tok,
        [
            {"role": "system", "content": "You summarise search results."},
            {"role": "user", "content": "Summarise: beta gamma delta"},
        ],
    )
    b = diagnose_break(p + r, p2, tok, model_mask=[0] * len(p) + [1] * len(r))
    assert b.kind == "other" and "different conversation" in b.reason


def test_bpe_breaks_classified_inside_build_batch(tok):
    """A 4-call rollout: append-only, then a template break, then a history edit."""
    m0 = [SYS, USER]
    r0_text = "<think>Look it up.</think>I will look up alpha."
    p0, r0 = render(tok, m0), sampled(tok, r0_text)
    m1 = m0 + [{"role": "assistant", "content": r0_text}, {"role": "tool", "content": "alpha = 40"}]
    p1, r1 = render(tok, m1), sampled(tok, "Now add two.")  # append-only: merges
    m2 = [
        SYS,
        USER,
        {"role": "assistant", "content": "I will look up alpha."},
        m1[3],
        {"role": "assistant", "content": "Now add two."},
        {"role": "user", "content": "Go on."},
    ]
    p2, r2 = render(tok, m2), sampled(tok, "It is 42.")  # reasoning stripped: template
    m3 = [SYS, USER, {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "Thanks."}]
    p3, r3 = render(tok, m3), sampled(tok, "Bye.")  # middle turns dropped: history edit
    triplets = [Triplet(p, r, [-0.5] * len(r)) for p, r in ((p0, r0), (p1, r1), (p2, r2), (p3, r3))]
    rollout = CompletedRollout("r1", "g1", 0, 0, triplets, final_reward=1.0)
    res = BatchResult(
        build_batch(
            [rollout],
            "trajectory",
            max_prompt_length=256,
            max_response_length=256,
            pad_token_id=tok.pad_token_id,
            tokenizer=tok,
        )
    )
    assert res.rows.n_calls.tolist() == [2, 1, 1]
    assert res.breaks.kind.tolist() == ["template", "history_edit"]
    assert res.breaks.call.tolist() == [2, 3]
    assert res.metrics["training/merge_breaks/template"] == 1
    assert res.metrics["training/merge_breaks/history_edit"] == 1
    assert "<think>Look it up.</think>" in res.breaks.removed_text.iloc[0]
