"""Each notebook is built from its percent-format source (scripts/build_notebooks.py): the cells
of `notebooks/NAME.ipynb` are the cells of `notebooks/src/NAME.py`, so an edit made to one only
(a notebook fixed by hand, a source changed without a rebuild) cannot drift silently — the next
rebuild would have undone it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import SOURCES, parse_percent  # noqa: E402

NAMES = sorted(p.stem for p in SOURCES.glob("*.py"))


def test_every_notebook_has_a_source_and_every_source_a_notebook():
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_the_notebook_cells_are_its_source_cells(name):
    built = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    cells = [(c["cell_type"], "".join(c["source"])) for c in built["cells"]]
    source = parse_percent((SOURCES / f"{name}.py").read_text())
    for i, (want, got) in enumerate(zip(source, cells)):
        assert want == got, f"cell {i} of notebooks/{name}.ipynb differs from notebooks/src/{name}.py"
    assert len(source) == len(cells), f"{name}: {len(source)} source cells, {len(cells)} in the notebook"
