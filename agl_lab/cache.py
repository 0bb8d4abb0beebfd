"""The on-disk cache: where it lives, and a directory built there once, atomically.

Models made on first use (the tiny model, a preset converted from GGUF, a warm start) are
cached per user under `$AGL_LAB_CACHE` (default `~/.cache/agl_lab/`). A leaf module: the
engines and the model presets both build their directories here, so neither imports the other
for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """`$AGL_LAB_CACHE` if set, else `~/.cache/agl_lab`."""
    env = os.environ.get("AGL_LAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agl_lab"


def build_cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` (a model directory in the cache), made by `build(tmp_dir)` on first use.

    The build writes into a private temporary directory beside `target` that is renamed into
    place, so readers never see a half-written directory and concurrent builders race safely
    (the loser's copy is dropped). A directory counts as built when it holds `config.json`.
    """
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
        try:
            tmp.rename(target)  # atomic: readers see no half-written directory
        except OSError:
            if not (target / "config.json").exists():  # lost a race to a complete build: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
