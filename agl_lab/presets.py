"""Config presets by name, from any working directory: `Trainer.from_config("cpu_tiny")`.

The shipped configs live in the repository's `configs/`; `agl_lab/configs` points at them
(a symlink in the source tree) and the wheel ships them as package data
(`[tool.setuptools.package-data]`), so an installed agl_lab and a checkout both find them.
`find_config` takes what a user writes — a preset name (`cpu_tiny`), a file name
(`cpu_tiny.yaml`) or a path (`configs/cpu_tiny.yaml`, from a notebook copied out of the
checkout the relative path no longer resolves) — and returns the file to load: the path itself
when it exists, else the shipped preset of that name. Pure pathlib: no import cost.
"""

from __future__ import annotations

import os
from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parent / "configs"


def preset_names() -> list[str]:
    """The shipped presets (`cpu_tiny`, `cpu_verl`, ...), sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []


def find_config(path: str | os.PathLike) -> Path:
    """The YAML file `path` names: the path when it exists, else the shipped preset of its name.

    Raises FileNotFoundError naming the path, where it was looked for and the presets."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    name = given.name[:-5] if given.name.endswith(".yaml") else given.stem if given.suffix == ".yml" else given.name
    if given.suffix in ("", ".yaml", ".yml") and (PRESET_DIR / f"{name}.yaml").is_file():
        return PRESET_DIR / f"{name}.yaml"
    raise FileNotFoundError(
        f"config file not found: {path} (looked in {Path.cwd()} and among the shipped presets in {PRESET_DIR}); "
        f"give a path to a YAML file or a preset name: {', '.join(preset_names()) or 'none found'}"
    )
