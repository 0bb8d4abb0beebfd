"""API contract between agl_lab's verl engine and the installed verl (and vLLM, when present).

`agl_lab.engines.verl.api.VERL_API` is the one table of verl symbols the engine uses; here every
row is checked against the installed packages (import, parameter names in order, no new
required parameter, instance attributes and source words), the config keys the engine reads
against verl's generated `ppo_trainer.yaml`, and the engine's own source against the table
(no verl import or verl method outside it). A verl upgrade that moves any of them fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl_lab.engines.verl.api import VERL_API, VERL_CONFIG_KEYS, VerlSymbol, check_symbol, check_verl_api

ENGINE_FILES = sorted((Path(__file__).resolve().parents[1] / "agl_lab" / "engines" / "verl").glob("*.py"))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
VERL_ROWS = sorted(k for k, s in VERL_API.items() if not s.needs_vllm)
VLLM_ROWS = sorted(k for k, s in VERL_API.items() if s.needs_vllm)


# ------------------------------------------------------------------------------------------
# Every row of the table against the installed packages
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", VERL_ROWS)
def test_verl_symbol_matches_installed_verl(key):
    assert check_symbol(VERL_API[key]) == []


@pytest.mark.skipif(
    not HAS_VLLM,
    reason="vLLM is not installed here: its rows are checked in .venv-vllm (./lab test) and on a GPU machine",
)
@pytest.mark.parametrize("key", VLLM_ROWS)
def test_vllm_symbol_matches_installed_vllm(key):
    assert check_symbol(VERL_API[key]) == []


def test_table_rows_have_unique_qualified_names():
    from agl_lab.engines.verl.api import _ROWS

    assert len(VERL_API) == len(_ROWS)


def test_installed_verl_is_the_pinned_one():
    from importlib.metadata import version

    assert version("verl") == "0.9.1", "VERL_API was written against verl 0.9.1: re-check every row before moving"


def test_check_verl_api_is_clean_for_the_installed_packages():
    assert check_verl_api() == []


def test_the_checker_reports_each_kind_of_drift():
    # The contract test must be able to fail: feed it rows that do not match verl 0.9.1.
    def first_problem(path: str, *params: str, **kw) -> str:
        problems = check_symbol(VerlSymbol(f"verl.trainer.ppo.ray_trainer:{path}", params, **kw))
        return problems[0] if problems else ""

    assert "cannot import" in first_problem("RayPPOTrainer._no_such_phase")
    assert "cannot import" in check_symbol(VerlSymbol("verl.no_such_module:X"))[0]
    assert "gone" in first_problem("RayPPOTrainer._balance_batch", "batch", "metricz")
    assert "order" in first_problem("RayPPOTrainer._balance_batch", "metrics", "batch")
    # a required parameter the engine does not pass (here: `batch`)
    assert "new required" in first_problem("RayPPOTrainer._balance_batch", "metrics")
    assert "self.nope =" in first_problem("RayPPOTrainer", *VERL_API["RayPPOTrainer"].params, attrs=("nope",))
    assert "no longer mentions" in first_problem("RayPPOTrainer._update_actor", "batch", returns="zzz")


# ------------------------------------------------------------------------------------------
# Config keys in verl's generated ppo_trainer.yaml
# ------------------------------------------------------------------------------------------

_MISSING = object()


@pytest.fixture(scope="module")
def verl_defaults():
    import verl

    return OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")


@pytest.mark.parametrize("key", VERL_CONFIG_KEYS)
def test_config_key_exists_in_verl_generated_ppo_trainer(verl_defaults, key):
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(verl_defaults, parent_key, default=_MISSING) if parent_key else verl_defaults
    # a mandatory `???` value (e.g. rollout.name) counts as present: the key exists, the user sets it
    assert parent is not _MISSING and leaf in parent.keys(), f"{key} left verl's ppo_trainer.yaml"


def test_config_defaults_the_engine_relies_on(verl_defaults):
    # hybrid engine + naive weight sync: replicas must sleep before weights are pushed
    assert verl_defaults.actor_rollout_ref.hybrid_engine is True
    assert verl_defaults.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    # the legacy trainer we subclass ignores use_v1; V1 is the default only for verl's main()
    assert verl_defaults.trainer.use_v1 is True


# ------------------------------------------------------------------------------------------
# The engine's source against the table (so the table cannot drift from the code)
# ------------------------------------------------------------------------------------------


def _trees():
    return {path.name: ast.parse(path.read_text()) for path in ENGINE_FILES}


def _string_args(tree: ast.AST, func_name: str, position: int) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == func_name:
            if len(node.args) > position and isinstance(node.args[position], ast.Constant):
                found.append(node.args[position].value)
    return found


def test_engine_imports_verl_only_through_the_table():
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
                assert not roots & {"verl", "vllm"}, f"{name}: import verl/vllm"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in ("verl", "vllm"), f"{name}: from {node.module} import …"


def test_every_table_key_used_by_the_engine_exists():
    used = []
    for tree in _trees().values():
        used += _string_args(tree, "verl_import", 0) + _string_args(tree, "call_replicas", 1)
        used += _string_args(tree, "method_name", 0)
    assert used, "the engine resolves no verl symbol through the table?"
    assert sorted(set(used) - set(VERL_API)) == []


def _self_attribute_uses(cls_name: str) -> tuple[set[str], set[tuple[str, str]]]:
    """`self.X` names and `self.X.Y` pairs used inside class `cls_name` of engines/verl/trainer.py."""
    tree = _trees()["trainer.py"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    names, pairs = set(), set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            pairs.add((node.value.attr, node.attr))
    return names, pairs


def test_every_inherited_trainer_member_the_engine_touches_is_in_the_table():
    from agl_lab.engines.verl.trainer import AglRayPPOTrainer, RayPPOTrainer

    names, pairs = _self_attribute_uses("AglRayPPOTrainer")
    own = set(vars(AglRayPPOTrainer))
    table_methods = {k.split(".", 1)[1] for k in VERL_API if k.startswith("RayPPOTrainer.")}
    table_attrs = set(VERL_API["RayPPOTrainer"].attrs)
    inherited = {n for n in names - own if hasattr(RayPPOTrainer, n) or n in table_attrs or not n.startswith("_")}
    untracked = sorted(n for n in inherited if n not in table_methods and n not in table_attrs)
    assert untracked == [], f"add these RayPPOTrainer members to VERL_API: {untracked}"
    # methods called on the trainer's verl helpers
    owners = {"llm_server_manager": "LLMServerManager", "checkpoint_manager": "CheckpointEngineManager"}
    for attr, method in pairs:
        if attr in owners:
            assert f"{owners[attr]}.{method}" in VERL_API, f"add {owners[attr]}.{method} to VERL_API"


# ------------------------------------------------------------------------------------------
# Import hygiene: CPU, no vLLM, no GPU
# ------------------------------------------------------------------------------------------


def test_engine_module_imports_without_verl_torch_ray_or_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import agl_lab.engines.verl.engine\n"
        "heavy = [m for m in ('verl', 'torch', 'ray', 'vllm') if sys.modules.get(m) is not None]\n"
        "assert heavy == [], heavy\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_verl_trainer_module_imports_on_cpu_without_vllm():
    if HAS_VLLM:
        pytest.skip("vLLM is installed here; this checks the CPU machine")
    import agl_lab.engines.verl.trainer as vt

    assert issubclass(vt.AglRayPPOTrainer, vt.RayPPOTrainer)
    assert "vllm" not in sys.modules
