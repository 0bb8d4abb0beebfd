"""docs/architecture.md and the Trainer's step walk, held to the code.

- Every name of the Trainer's "One step, hop by hop" docstring, and of the page's "One
  training step, hop by hop" section, resolves to a real function or attribute:
  `module:Qualified.name` (a module under agl_lab), `engine.method(...)` (the `Engine`
  contract), `stage()` (a `Trainer` method), and a bare `Class.attr` (in the module named last
  before it, else agl_lab's public API).
- Every path the page's module map names exists, and every module of agl_lab/ has its line in
  the map.

`LANDING` lists the names the page already gives in the layout of issue 37 (the store package,
agent.py, the warm start beside the engines, recording.py, sweep.py, `batch_options`), missing
until that layout is merged, and `LEAVING` the modules that layout removes. Each entry must go
once the layout has landed: `test_landing_and_leaving_are_still_pending` says which.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
LANDING: set[str] = set()
LEAVING: set[str] = set()
PATH_PREFIXES = ("agl_lab/", "configs/", "notebooks/", "benchmarks/", "scripts/", "tests/", ".ci/")
BARE_FILE = re.compile(r"^[\w]+(\.py|\.yaml|\.sh)$")


# ------------------------------------------------------------------------------ names in a walk


def _resolve_qualname(module: str, qualname: str) -> object:
    if module:  # this checkout's module: an editable install elsewhere must not answer for it
        path = ROOT / "agl_lab" / module.replace(".", "/")
        if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
            raise ImportError(f"agl_lab.{module} is not in {ROOT}")
    obj: object = importlib.import_module(f"agl_lab.{module}" if module else "agl_lab")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def walk_names(text: str) -> list[tuple[str, str, str]]:
    """(as written, module, qualified name) of each name a step walk gives in backticks."""
    names: list[tuple[str, str, str]] = []
    context = ""
    for token in re.findall(r"`([^`]+)`", text):
        if m := re.fullmatch(r"([a-z_][\w.]*):([A-Za-z_][\w.]*)", token):
            context = m.group(1)
            names.append((token, m.group(1), m.group(2)))
        elif m := re.fullmatch(r"engine\.(\w+)\(.*\)", token):
            names.append((token, "engines.base", f"Engine.{m.group(1)}"))
        elif m := re.fullmatch(r"(\w+)\(\)", token):
            names.append((token, "trainer", f"Trainer.{m.group(1)}"))
        elif m := re.fullmatch(r"([A-Z]\w*\.\w+)(\(\))?", token):
            names.append((token, context, m.group(1)))
    return names


def _resolves(module: str, qualname: str) -> bool:
    if module:
        try:
            _resolve_qualname(module, qualname)
            return True
        except (ImportError, AttributeError):
            pass
    try:  # a bare Class.attr of agl_lab's public API (`Trainer.validate`)
        _resolve_qualname("", qualname)
        return True
    except AttributeError:
        return False


def trainer_walk() -> str:
    tree = ast.parse((ROOT / "agl_lab" / "trainer.py").read_text())
    doc = ast.get_docstring(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"))
    assert doc and "One step, hop by hop" in doc, "the Trainer's docstring lacks its 'One step, hop by hop' walk"
    return doc[doc.index("One step, hop by hop") :]


def page_walk() -> str:
    text = PAGE.read_text()
    start = text.index("## One training step, hop by hop")
    return re.sub(r"```.*?```", "", text[start : text.index("\n## ", start + 1)], flags=re.S)


@pytest.mark.parametrize("where", ["agl_lab/trainer.py", "docs/architecture.md"])
def test_every_name_in_the_step_walk_resolves(where: str) -> None:
    names = walk_names(trainer_walk() if where == "agl_lab/trainer.py" else page_walk())
    assert len(names) >= 15, f"{where}'s step walk names only {len(names)} functions: {names}"
    missing = [token for token, module, qualname in names if token not in LANDING and not _resolves(module, qualname)]
    assert not missing, f"{where}'s step walk names what does not exist: {missing}"


def test_walk_names_are_read_as_written() -> None:
    text = "`a.b:C.d` then `C.e` and `engine.pause()`, `update()`, `trainer.test_freq`, `Trainer.fit`"
    assert walk_names(text) == [
        ("a.b:C.d", "a.b", "C.d"),
        ("C.e", "a.b", "C.e"),
        ("engine.pause()", "engines.base", "Engine.pause"),
        ("update()", "trainer", "Trainer.update"),
        ("Trainer.fit", "a.b", "Trainer.fit"),
    ]
    assert not _resolves("records", "events_to_completed_rollout_that_is_not_there")
    assert _resolves("engines.verl.engine", "Trainer.validate")  # falls back to agl_lab's API


# ------------------------------------------------------------------------------- the module map


def map_paths() -> set[str]:
    """Every path the module map's tables name; a bare `name.py` is in the row's first folder."""
    text = PAGE.read_text()
    start = text.index("## The module map")
    paths: set[str] = set()
    for line in text[start : text.index("\n## ", start + 1)].splitlines():
        if not line.startswith("|"):
            continue
        base = None
        for token in re.findall(r"`([^`]+)`", line):
            token = token.split(" ")[0]
            if token.startswith(PATH_PREFIXES) or token in ("lab",):
                paths.add(token)
                base = base or (token if token.endswith("/") else token.rpartition("/")[0] + "/")
            elif base and BARE_FILE.match(token):
                paths.add(base + token)
    return paths


def test_every_path_in_the_map_exists() -> None:
    paths = map_paths()
    assert len(paths) >= 60, f"the module map names only {len(paths)} paths"
    missing = sorted(p for p in paths if p not in LANDING and not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md's module map names paths that do not exist: {missing}"


def test_every_module_has_its_line_in_the_map() -> None:
    paths = map_paths()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "agl_lab").rglob("*.py")}
    modules = {m for m in modules if not m.endswith("/__init__.py") or m == "agl_lab/__init__.py"}
    unmapped = sorted(modules - paths - LEAVING)
    assert not unmapped, f"docs/architecture.md's module map has no line for {unmapped}: add one"


def test_landing_and_leaving_are_still_pending() -> None:
    landed = sorted(p for p in LANDING if "/" in p and (ROOT / p).exists())
    landed += sorted(n for n in LANDING if ":" in n and _resolves(*n.split(":")))
    left = sorted(p for p in LEAVING if not (ROOT / p).exists())
    assert not landed and not left, (
        f"the layout has landed: remove {landed + left} from LANDING / LEAVING in tests/test_architecture_doc.py"
    )
