"""docs/architecture.md and the Trainer's step walk, held to the code.

- Every name of the Trainer's "One step, hop by hop" docstring, and of the page's "One
  training step, hop by hop" section, resolves to a real function or attribute:
  `module:Qualified.name` (a module under agl_lab), `engine.method(...)` (the `Engine`
  contract), `stage()` (a `Trainer` method), and a bare `Class.attr` (in the module named last
  before it, else agl_lab's public API).
- Every path the page's module map names exists, and every module of agl_lab/ has its line in
  the map.
- The page's module → tests table: every module of agl_lab/ has its row; every test file a row
  names under "imported by" exists and imports the module (directly, or a name its package
  re-exports); a test file that drives the module another way is named, with how, in the last
  column; a module's own `tests/test_<name>.py` is in its row.
- No test module imports another: what several share lives in a helper module (tests/fakes.py,
  tests/servers.py, …), never in a test_*.py.

`python -m tests.test_architecture_doc` prints the table's rows as the imports give them.

`LANDING` lists the names the page already gives in the layout of issue 37 (the store package,
agent.py, the warm start beside the engines, recording.py, sweep.py, `batch_options`), missing
until that layout is merged, and `LEAVING` the modules that layout removes. Each entry must go
once the layout has landed: `test_landing_and_leaving_are_still_pending` says which.
"""

from __future__ import annotations

import ast
import functools
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


# ----------------------------------------------------------------------------- tests of modules

TESTS = ROOT / "tests"
TABLE_HEADING = "## Where each module is tested"


@functools.cache
def _module_files() -> dict[str, Path]:
    """Dotted name → file of every module of agl_lab (a package by its __init__.py)."""
    out = {}
    for path in (ROOT / "agl_lab").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def table_modules() -> list[str]:
    """The modules the table lists: every .py of agl_lab/ but a sub-package's __init__.py (a
    package's names are counted for the module that defines them), as the module map does."""
    paths = [p.relative_to(ROOT).as_posix() for p in _module_files().values()]
    return sorted(p for p in paths if not p.endswith("/__init__.py") or p == "agl_lab/__init__.py")


@functools.cache
def _reexports(package: str) -> dict[str, str]:
    """Name → defining module of what a package's __init__.py imports at its top level."""
    modules = _module_files()
    tree = ast.parse(modules[package].read_text())
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules
        for alias in node.names
    }


@functools.cache
def imported_modules(path: Path) -> frozenset[str]:
    """The agl_lab modules `path` imports (anywhere in it), as repo paths: `from pkg import mod`
    imports pkg/mod.py; a name a package re-exports (`from agl_lab.algorithms import
    compute_advantages`, or `alg.compute_advantages` after `import agl_lab.algorithms as alg`)
    counts for the module that defines it."""
    modules = _module_files()
    found: set[str] = set()
    aliases: dict[str, str] = {}  # local name → package, for `import agl_lab.x as y`

    def add(package: str, name: str) -> None:
        if f"{package}.{name}" in modules:
            found.add(f"{package}.{name}")
        elif modules[package].name == "__init__.py" and name in _reexports(package):
            found.add(_reexports(package)[name])
        else:
            found.add(package)

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for alias in node.names:
                add(node.module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            add(aliases[node.value.id], node.attr)
    return frozenset(modules[m].relative_to(ROOT).as_posix() for m in found)


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def drivers() -> dict[str, list[str]]:
    """Module path → the test files (relative to tests/) that import it."""
    out: dict[str, list[str]] = {m: [] for m in table_modules()}
    for path in _test_files():
        for module in imported_modules(path):
            if module in out:
                out[module].append(path.relative_to(TESTS).as_posix())
    return out


def table_rows() -> dict[str, tuple[list[str], str]]:
    """Module path → (the test files its row names under "imported by", the "driven otherwise" cell)."""
    text = PAGE.read_text()
    assert TABLE_HEADING in text, f"docs/architecture.md lacks its section {TABLE_HEADING!r}"
    start = text.index(TABLE_HEADING)
    end = text.find("\n## ", start + 1)
    rows: dict[str, tuple[list[str], str]] = {}
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `agl_lab/") or len(cells) != 3:
            continue
        module = cells[0].strip("`")
        assert module not in rows, f"docs/architecture.md's test table has two rows for {module}"
        rows[module] = (re.findall(r"`([^`]+\.py)`", cells[1]), cells[2])
    return rows


def _own_test(module: str) -> str | None:
    """tests/test_<name>.py of a top-level module agl_lab/<name>.py, where there is one."""
    parts = module.split("/")
    own = f"test_{parts[-1]}"
    return own if len(parts) == 2 and (TESTS / own).exists() else None


def lines_importing_test_modules(path: Path) -> list[int]:
    """Lines of `path` that import a test module (`tests.test_x`, `tests.vllm.test_x`, `from tests
    import test_x`, `from .test_x import`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
        else:
            continue
        ours = [name for name in names if name.startswith(("tests.", "."))]  # not a library's `test_*`
        if any(part.startswith("test_") for name in ours for part in name.split(".")):
            lines.append(node.lineno)
    return lines


def test_no_test_module_imports_another() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(TESTS.rglob("*.py")) for n in lines_importing_test_modules(p)]
    assert not bad, (
        f"test modules import other test modules at {bad}: move what they share to a helper module "
        "(tests/fakes.py, tests/servers.py, tests/trainer_runs.py, …; docs/architecture.md lists them)"
    )


def test_the_test_import_finder_finds_each_form(tmp_path: Path) -> None:
    path = tmp_path / "test_y.py"
    path.write_text(
        "from tests.test_trainer import SMALL\nimport tests.vllm.test_vllm_engine\nfrom tests import test_batch\n"
        "from .test_rollout import KEY\nfrom tests.trainer_runs import SMALL\nfrom somelib import test_util\n"
    )
    assert lines_importing_test_modules(path) == [1, 2, 3, 4]


def test_every_helper_module_of_tests_has_its_line() -> None:
    text = PAGE.read_text()
    section = text[text.index(TABLE_HEADING) :]
    named = set(re.findall(r"`(tests/\w+\.py)`", section))
    helpers = {
        p.relative_to(ROOT).as_posix()
        for p in TESTS.glob("*.py")
        if not p.name.startswith("test_") and p.name != "__init__.py"
    }
    missing = sorted(helpers - named)
    assert not missing, f"docs/architecture.md's helper table ({TABLE_HEADING!r}) has no line for {missing}: add one"


def test_every_module_has_its_row_in_the_test_table() -> None:
    rows = table_rows()
    missing = [m for m in table_modules() if m not in rows]
    assert not missing, "\n".join(
        f"module {m} is missing from the table in docs/architecture.md ({TABLE_HEADING!r}): add a row "
        f"(`python -m tests.test_architecture_doc` prints it)"
        for m in missing
    )
    gone = sorted(set(rows) - set(table_modules()))
    assert not gone, f"docs/architecture.md's test table has rows for modules that do not exist: {gone}"


def test_every_test_file_in_the_table_drives_its_module() -> None:
    problems = []
    for module, (tests, otherwise) in table_rows().items():
        if not (ROOT / module).exists():
            continue  # the test above names it
        for name in tests:
            if not (TESTS / name).exists():
                problems.append(f"{module}: tests/{name} does not exist")
            elif module not in imported_modules(TESTS / name):
                problems.append(
                    f"{module}: tests/{name} does not import it (name it under 'driven otherwise', with how)"
                )
        for name in re.findall(r"`([^`]+\.py)`", otherwise):
            if name.startswith("test_") or name.startswith("vllm/"):
                if not (TESTS / name).exists():
                    problems.append(f"{module}: tests/{name} does not exist")
        if not tests and not otherwise.strip("— -"):
            problems.append(f"{module}: no test imports it; say in its last cell which tests drive it and how")
        own = _own_test(module)
        if own and own not in tests and own not in otherwise:
            problems.append(f"{module}: its own tests/{own} is not in its row")
    assert not problems, "docs/architecture.md's test table:\n" + "\n".join(problems)


def test_import_reading_resolves_packages_and_aliases(tmp_path: Path) -> None:
    path = tmp_path / "test_x.py"
    path.write_text(
        "import agl_lab.algorithms as alg\nfrom agl_lab import batch\nfrom agl_lab.server import gateway\n"
        "from agl_lab.server.store import MemoryStore\nalg.compute_advantages\n"
    )
    assert imported_modules(path) == {
        "agl_lab/algorithms/__init__.py",
        "agl_lab/algorithms/advantage.py",
        "agl_lab/batch.py",
        "agl_lab/server/gateway.py",
        "agl_lab/server/store/memory.py",
    }


def print_table() -> None:
    """The table's rows as the imports give them; the last cell is kept from the page where it has one."""
    known = table_rows() if TABLE_HEADING in PAGE.read_text() else {}
    print("| module | imported by | driven otherwise |\n|---|---|---|")
    for module, tests in drivers().items():
        otherwise = known.get(module, ([], ""))[1]
        print(f"| `{module}` | {', '.join(f'`{t}`' for t in tests)} | {otherwise} |")


if __name__ == "__main__":
    print_table()
