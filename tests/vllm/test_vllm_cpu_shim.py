"""agl_lab/engines/verl/vllm_cpu.py without an engine: what it loads where, its env, its errors.

Fast. The import-hygiene, env and error tests run in the main environment too; the hook test
needs vLLM's CPU build (.venv-vllm) and imports verl's real weight-receiver module in a fresh
interpreter, loaded the way verl loads it in vLLM's worker process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(code: str, **env: str) -> dict:
    full_env = {**os.environ, "PYTHONPATH": ROOT, **env}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=180, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_shim_imports_neither_verl_vllm_nor_torch():
    heavy = _run(
        "import sys, json\nimport agl_lab.engines.verl.vllm_cpu\n"
        "print(json.dumps([m for m in ('verl', 'vllm', 'torch', 'ray') if m in sys.modules]))"
    )
    assert heavy == []


def test_server_env_defaults_and_the_users_values_win():
    from agl_lab.engines.verl.vllm_cpu import server_env

    assert server_env({}) == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    assert server_env({"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_worker_env_loads_the_cpu_platform_then_the_shim_and_keeps_the_users_modules(monkeypatch):
    from agl_lab.engines.verl.cpu import MODULE as CPU_MODULE
    from agl_lab.engines.verl.cpu import worker_env
    from agl_lab.engines.verl.vllm_cpu import MODULE

    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", f"my.plugin,{MODULE}")
    assert worker_env((MODULE,))["VERL_USE_EXTERNAL_MODULES"] == f"{CPU_MODULE},{MODULE},my.plugin"
    assert worker_env()["VERL_USE_EXTERNAL_MODULES"] == f"{CPU_MODULE},my.plugin,{MODULE}"  # the user's list kept
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES")
    assert worker_env()["VERL_USE_EXTERNAL_MODULES"] == CPU_MODULE  # agl_lab_cpu rollout: no vLLM shim


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: this checks the error of an environment without it")
def test_vllm_rollout_on_cpu_without_vllm_names_the_environment_to_use():
    from agl_lab.config import load_config
    from agl_lab.engines.verl.engine import _select_device

    cfg = load_config(os.path.join(ROOT, "configs", "cpu_vllm.yaml"))
    with pytest.raises(RuntimeError, match=r"rollout\.name=vllm on CPU needs vLLM's CPU build.*\.venv-vllm"):
        _select_device(cfg)


def test_another_rollout_name_on_cpu_names_both_choices():
    from agl_lab.config import load_config
    from agl_lab.engines.verl.engine import _select_device

    cfg = load_config(os.path.join(ROOT, "configs", "cpu_vllm.yaml"), ["actor_rollout_ref.rollout.name=sglang"])
    with pytest.raises(RuntimeError, match=r"not 'sglang'.*rollout\.name=agl_lab_cpu.*or vllm"):
        _select_device(cfg)


HOOK_CHECK = """
import json, sys
import verl  # loads VERL_USE_EXTERNAL_MODULES, as in every process of a run
import verl.workers.rollout.vllm_rollout.utils as u
fn = u.vLLMColocateWorkerExtension.update_weights_from_ipc
print(json.dumps({"patched": bool(getattr(fn, "_agl_lab_layerwise", False)), "name": fn.__name__,
                  "shim_loaded": "agl_lab.engines.verl.vllm_cpu" in sys.modules}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM's CPU build (.venv-vllm)")
def test_verl_loads_the_shim_into_its_weight_receiver_only_where_asked():
    loaded = _run(HOOK_CHECK, VERL_USE_EXTERNAL_MODULES="agl_lab.engines.verl.vllm_cpu")
    assert loaded == {"patched": True, "name": "update_weights_from_ipc", "shim_loaded": True}
    plain = _run(HOOK_CHECK, VERL_USE_EXTERNAL_MODULES="")
    assert plain == {"patched": False, "name": "update_weights_from_ipc", "shim_loaded": False}
