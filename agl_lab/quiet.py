"""Noise the library makes on a CPU that a user cannot act on, silenced at the source.

| noise                                         | from                               | how it is silenced         |
|-----------------------------------------------|------------------------------------|----------------------------|
| "<x> engine is not available: ModuleNotFound" | verl probing optional GPU back-ends | a warnings filter scoped to verl's modules |
| "No supported accelerator detected …"         | verl's platform manager (logging)   | a logging filter on that one logger        |
| "Platform 'nvidia' … is registered but not available" | verl's platform manager     | the same filter                            |
| "Loading weights: 100% …" bars                | Hugging Face `from_pretrained`     | `quiet_hf()` around agl_lab's own loads    |
| every library's INFO records (httpx: one a request) | gem's `__init__`: `logging.basicConfig(level=INFO)` | `root_logging_kept()` around agl_lab's import of gem |

`install()` runs when `agl_lab` is imported; it imports nothing heavy (neither verl nor
transformers) and touches only these messages: any other warning of verl, of Hugging Face
or of the user's code is shown as before. A user who wants them back can call
`agl_lab.quiet.uninstall()`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

VERL_BACKEND_MESSAGE = r".* engine is not available"
VERL_PLATFORM_LOGGER = "verl.plugin.platform.platform_manager"
_PLATFORM_NOISE = ("No supported accelerator detected", "is registered but not available")


class _PlatformNoise(logging.Filter):
    """Drops verl's accelerator-fallback warnings (a CPU machine has no accelerator: expected)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(noise in message for noise in _PLATFORM_NOISE)


_FILTER = _PlatformNoise()
_installed = False


def install() -> None:
    """Install the verl warning and logging filters (idempotent)."""
    global _installed
    if _installed:
        return
    # `module` is matched against the module that issues the warning: only verl's probes.
    warnings.filterwarnings("ignore", message=VERL_BACKEND_MESSAGE, category=UserWarning, module=r"verl(\.|$)")
    logging.getLogger(VERL_PLATFORM_LOGGER).addFilter(_FILTER)  # survives verl's own setLevel
    _installed = True


def uninstall() -> None:
    """Show verl's back-end and accelerator messages again."""
    global _installed
    warnings.filters[:] = [
        f
        for f in warnings.filters
        if not (f[0] == "ignore" and f[1] is not None and f[1].pattern == VERL_BACKEND_MESSAGE)
    ]
    logging.getLogger(VERL_PLATFORM_LOGGER).removeFilter(_FILTER)
    _installed = False


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No Hugging Face progress bars (weight loading) inside the block; restored after."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """The root logger as it was before the block: for imports that configure logging as a side
    effect (gem's `__init__` calls `logging.basicConfig(level=INFO)`, after which httpx prints a
    line per request: hundreds a step in a notebook). A handler or level the user set is kept;
    only what the block added is undone."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
