"""Which Pythons agl_lab accepts (issue #48 item 5): 3.11 (what ./lab uses) and 3.12 (most GPU images).

`requires-python` is checked as pip reads it (packaging's SpecifierSet); it must stay inside verl
0.9.1's own range, read from the installed wheel's metadata. Where a 3.12 interpreter is on this
machine, every module of agl_lab and scripts/ compiles under it and `import agl_lab` works (the
package's own import is light; its dependencies have no cp312 CPU torch wheel here, so the test
suite itself does not run on 3.12).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import subprocess
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requires_python() -> SpecifierSet:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return SpecifierSet(tomllib.load(f)["project"]["requires-python"])


def test_the_package_metadata_accepts_python_3_11_and_3_12():
    spec = requires_python()
    assert spec.contains("3.11.7") and spec.contains("3.12.1") and spec.contains("3.12.11")
    assert not spec.contains("3.10.14")  # 3.11 is the oldest the project runs and tests
    assert not spec.contains("3.13.0")  # verl 0.9.1 refuses it (below)


def test_requires_python_stays_inside_verls_range():
    verl = SpecifierSet(importlib.metadata.metadata("verl")["Requires-Python"])  # ">=3.10,<3.13"
    for version in ("3.11.0", "3.12.0", "3.12.99"):
        assert requires_python().contains(version) <= verl.contains(version), version
    assert not verl.contains("3.13.0")


def _python312() -> str | None:
    candidates = [
        shutil.which("python3.12"),
        *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
    ]
    for path in filter(None, candidates):
        probe = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 12)":
            return path
    return None


def test_agl_lab_compiles_and_imports_on_python_3_12():
    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 interpreter on this machine (Debian's archive here has none)")
    code = (
        "import pathlib, sys; sys.path.insert(0, sys.argv[1]); root = pathlib.Path(sys.argv[1]); "
        "files = [*root.glob('agl_lab/**/*.py'), *root.glob('scripts/*.py')]; "
        "[compile(p.read_text(encoding='utf-8'), str(p), 'exec') for p in files]; "
        "import agl_lab; print(len(files), 'files compiled; agl_lab', agl_lab.__name__)"
    )
    out = subprocess.run([python, "-I", "-c", code, ROOT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "files compiled; agl_lab agl_lab" in out.stdout
