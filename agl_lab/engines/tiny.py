"""The tiny real LLM: a byte-level BPE tokenizer and a 2-layer Qwen2, built in seconds, no downloads.

Tests, tutorials and the CPU demo need a model that is *real* in every way that matters to
agentic RL plumbing, yet costs nothing to obtain:

* a real byte-level BPE tokenizer (trained here with `tokenizers` on a built-in corpus), so
  decode → encode of sampled ids drifts exactly like a production tokenizer does — the
  retokenization merge breaks the batch builder must diagnose are genuine;
* a real ChatML chat template (system / user / assistant / tool roles, `tool_calls`,
  `add_generation_prompt`) that is append-only for plain multi-turn conversations;
* a real causal LM (Qwen2 architecture, 0.46 M parameters, tied embeddings) whose forward
  pass, KV cache and `save_pretrained` are the same code paths a 7B model uses.

Determinism is a contract: the artefacts are a pure function of the recipe below
(`_RECIPE`) and the seed, so they are cached once per user under
`$AGL_LAB_CACHE/tiny-<hash>` (default `~/.cache/agl_lab/`) and every process — test,
notebook, `agl-lab engine` — sees byte-identical files. A build writes into a temporary
directory and renames it into place, so concurrent builders never see half a model.

    model, tokenizer = load_model_and_tokenizer()            # tiny, cached
    model, tokenizer = load_model_and_tokenizer("/ckpt/dir")  # any HF model dir on disk
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

from agl_lab.cache import build_cached_dir, cache_root
from agl_lab.chat_format import TOOL_CALLS_JINJA
from agl_lab.quiet import quiet_hf

DEFAULT_MODEL_NAME = "agl-lab-tiny"

# ---------------------------------------------------------------------------------------
# Recipe: everything that determines the artefacts (its hash names the cache directory)
# ---------------------------------------------------------------------------------------

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", PAD_TOKEN]

_RECIPE: dict[str, Any] = {
    "version": 1,
    "vocab_size": 1024,
    "corpus_lines": 1200,
    "model": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    },
}

# ChatML. Append-only by construction: a turn renders the same text whatever follows it,
# and nothing is stripped from history (no "drop old reasoning" rule), so the prompt of
# turn k + its reply is a prefix of the prompt of turn k+1.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>\''
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}" + TOOL_CALLS_JINJA + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ---------------------------------------------------------------------------------------
# Corpus: deterministic English-ish text covering what built-in tasks and agents print
# ---------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to and in is it that for on with as at by from this be are was or not but "
    "what which when where who how why can will would should could may must do does did "
    "you your we our they their he she his her its my me us them i one two three four five "
    "six seven eight nine ten first last next number numbers value values key keys answer "
    "answers lookup calc calculate compute result results observation observations tool tools "
    "call calls function arguments name question task tasks user assistant system reply please "
    "thanks hello yes no true false none null error ok done final step steps think check find "
    "add sum plus minus times divide product total count list table word words letter letters "
    "city country capital color animal fruit red blue green apple banana paris london tokyo "
    "river mountain sea book time day year small large big good new old same different more "
    "less than equal each every all some any many much only also then so if else because "
    "model reward train training data text token tokens game move score win lose play turn "
    "left right up down start end stop search query document memory store get set put "
    "agent environment message content role response correct wrong output input json string "
    "integer python code run have has there here about into over after before again"
).split()

_TOOLS = ("lookup", "calc", "search", "answer", "get_value", "add", "multiply")


def _corpus_lines(n_lines: int, seed: int = 0) -> list[str]:
    """`n_lines` deterministic lines: prose, arithmetic, key/value facts, ChatML and tool calls."""
    rng = random.Random(seed)
    punct = [".", ",", "?", "!", ":", ";", "'", '"', "(", ")", "-", "=", "+", "*", "/", "%"]

    def sentence() -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        return " ".join(words) + rng.choice([".", ".", "?", "!"])

    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 8
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        if kind in (0, 1):
            lines.append(" ".join(sentence() for _ in range(rng.randint(1, 3))))
        elif kind == 2:
            op = rng.choice(["+", "-", "*", "/"])
            lines.append(f"calc {a} {op} {b} = ? Observation: {a}{op}{b} -> value {a + b}.")
        elif kind == 3:
            key = rng.choice(_WORDS) + "_" + str(b)
            lines.append(f"lookup key {key}: the value is {a}. Answer: {a}")
        elif kind == 4:
            tool = rng.choice(_TOOLS)
            args = json.dumps({"key": rng.choice(_WORDS), "x": a, "y": b})
            lines.append(f'<tool_call>{{"name": "{tool}", "arguments": {args}}}</tool_call>')
        elif kind == 5:
            role = rng.choice(["system", "user", "assistant", "tool"])
            lines.append(f"<|im_start|>{role}\n{sentence()}<|im_end|>\n")
        elif kind == 6:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
        else:
            sym = "".join(rng.choice(punct) for _ in range(rng.randint(1, 4)))
            lines.append(f"Q{i}: {sentence()} {sym} A: {rng.choice(_WORDS)} {a}; tool result={b}")
    return lines


# ---------------------------------------------------------------------------------------
# Building the tokenizer and the model
# ---------------------------------------------------------------------------------------


def _recipe_hash(seed: int) -> str:
    blob = json.dumps({**_RECIPE, "seed": seed, "template": CHAT_TEMPLATE}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer() -> Any:
    """Train the byte-level BPE on the built-in corpus and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_RECIPE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus_lines(_RECIPE["corpus_lines"]), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=_RECIPE["model"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer: Any, seed: int = 0) -> Any:
    """A freshly initialised Qwen2 causal LM (float32, CPU) sized by `_RECIPE["model"]`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **_RECIPE["model"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def tiny_model_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the cached tiny model for `seed`, building it on first use (seconds)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()

    def build(tmp: Path) -> None:
        tokenizer = build_tokenizer()
        build_model(tokenizer, seed).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return build_cached_dir(root / f"tiny-{_recipe_hash(seed)}", build)


# ---------------------------------------------------------------------------------------
# Public loading API
# ---------------------------------------------------------------------------------------


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(cache_dir: str | None = None, *, model_path: str | os.PathLike | None = None) -> Any:
    """The tiny tokenizer (cached under `cache_dir`), or that of `model_path`; left-padded."""
    from transformers import AutoTokenizer

    path = Path(model_path) if model_path is not None else tiny_model_dir(cache_dir=cache_dir)
    # padding_side is not saved by save_pretrained; right padding corrupts batched logprobs.
    return AutoTokenizer.from_pretrained(path, padding_side="left", local_files_only=True)


class Decoder:
    """A decode-only tokenizer read from a model directory's `tokenizer.json` with the `tokenizers`
    library: no transformers import (seconds saved where only text is needed: replay, diagnostics).

    `decode(ids, skip_special_tokens=False)` gives what transformers' fast tokenizer gives for a
    directory whose `clean_up_tokenization_spaces` is off (`load_decoder` checks it);
    `vocab_size`, `path`."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = path
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        """Text of `ids` (a list of ints, or one int)."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Decoder({str(self.path)!r})"


def load_decoder(cache_dir: str | None = None, *, model_path: str | os.PathLike | None = None) -> Any:
    """A `Decoder` for the model at `model_path` (default: the tiny model), or — when its directory
    has no `tokenizer.json` or asks transformers to clean up spaces — `load_tokenizer`'s tokenizer."""
    path = Path(model_path).expanduser() if model_path is not None else tiny_model_dir(cache_dir=cache_dir)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if (path / "tokenizer.json").exists() and not config.get("clean_up_tokenization_spaces", False):
        return Decoder(path)
    return load_tokenizer(cache_dir, model_path=path)


def load_model_and_tokenizer(
    model_path: str | os.PathLike | None = None,
    *,
    device: str | None = None,
    dtype: Any = None,
    seed: int = 0,
    cache_dir: str | None = None,
) -> tuple[Any, Any]:
    """`(model, tokenizer)` in eval mode on `device` (default cuda if available, else cpu).

    model_path=None → the tiny model (built once per seed, cached); otherwise any HF model
    directory on disk (never downloads). dtype defaults to bfloat16 on CUDA, float32 on CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agl_lab.engines.grouped_attention import use_grouped_attention

    if model_path is None:
        path = tiny_model_dir(seed=seed, cache_dir=cache_dir)
    else:
        path = Path(model_path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model_path={str(model_path)!r} is not a Hugging Face model directory "
                "(no config.json); pass a directory written by save_pretrained, or None for the tiny model"
            )
    device = device or _default_device()
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with quiet_hf():  # no "Loading weights" bar in `agl-lab engine`, the benchmarks or a notebook
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    use_grouped_attention(model)  # GQA on the CPU: no K/V copies per layer (engines/grouped_attention.py)
    return model, load_tokenizer(model_path=path)
