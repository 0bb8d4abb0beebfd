"""Choosing verl's device: the CPU platform, CUDA, and the clear errors when neither can work.

Fast (no Ray, no workers): the engine refuses a config before it starts anything. The real CPU
run is tests/test_verl_cpu.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agl_lab.config import ConfigError, load_config
from agl_lab.engines.verl import cpu as verl_cpu
from agl_lab.engines.verl.cpu_rollout import ROLLOUT_NAME

CPU_VERL = Path(__file__).resolve().parents[1] / "configs" / "cpu_verl.yaml"
ROWS = [{"question": "q", "answer": "a"}]


def test_cpu_verl_config_selects_the_cpu_platform_and_its_rollout():
    cfg = load_config(CPU_VERL)
    assert cfg.agl_lab.engine == "verl" and cfg.actor_rollout_ref.rollout.name == ROLLOUT_NAME
    assert verl_cpu.cpu_platform_wanted(cfg)
    assert not verl_cpu.cpu_platform_wanted(load_config(CPU_VERL, ["agl_lab.verl.device=cuda"]))
    import torch

    auto = load_config(CPU_VERL, ["agl_lab.verl.device=auto"])
    assert verl_cpu.cpu_platform_wanted(auto) is (not torch.cuda.is_available())


def test_an_unknown_device_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"agl_lab\.verl\.device='gpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        load_config(CPU_VERL, ["agl_lab.verl.device=gpu"])


def test_worker_env_loads_this_agl_lab_and_the_platform_in_every_worker(monkeypatch):
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my.plugin")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = verl_cpu.worker_env()
    assert env["VERL_PLATFORM"] == verl_cpu.PLATFORM_NAME
    assert env["VERL_USE_EXTERNAL_MODULES"] == f"{verl_cpu.MODULE},my.plugin"  # the user's module kept
    assert env["VERL_ENGINE_DEVICE"] == "cuda"
    root = env["PYTHONPATH"].split(os.pathsep)[0]
    assert Path(root, "agl_lab", "engines", "verl", "cpu.py").exists()  # workers import this checkout
    assert env["PYTHONPATH"].endswith("/elsewhere")


def test_verl_on_cpu_with_a_vllm_rollout_and_no_vllm_names_the_environment_to_use():
    import importlib.util

    from agl_lab.engines.verl.engine import VerlEngine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: rollout.name=vllm runs on CPU (tests/vllm)")
    cfg = load_config(CPU_VERL, ["actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(RuntimeError, match=rf"needs vLLM's CPU build.*\.venv-vllm.*rollout\.name={ROLLOUT_NAME}"):
        VerlEngine(cfg, train_dataset=ROWS)


def test_verl_on_cuda_without_a_cuda_device_says_what_to_set():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: agl_lab.verl.device=cuda is valid here")
    from agl_lab.engines.verl.engine import VerlEngine

    cfg = load_config(CPU_VERL, ["agl_lab.verl.device=cuda"])
    with pytest.raises(
        RuntimeError,
        match=r"needs a CUDA device and none is visible here: .*join a Ray cluster "
        r"whose nodes have GPUs \(RAY_ADDRESS=.*set agl_lab\.verl\.device=cpu",
    ):
        VerlEngine(cfg, train_dataset=ROWS)


def test_every_way_a_worker_process_goes_away_counts_as_a_dead_worker():
    from ray.exceptions import ActorDiedError, NodeDiedError, OutOfMemoryError, RayTaskError, WorkerCrashedError

    from agl_lab.engines.verl.engine import _dead_actor_error

    oom = OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")
    for error in (ActorDiedError(), oom, WorkerCrashedError(), NodeDiedError("node gone")):
        assert _dead_actor_error(error) is error
    try:  # found through the exception chain too (an engine wrapping it)
        try:
            raise oom
        except OutOfMemoryError as inner:
            raise RuntimeError("update failed") from inner
    except RuntimeError as outer:
        assert _dead_actor_error(outer) is oom
    assert _dead_actor_error(ValueError("a bug, not a dead worker")) is None
    assert _dead_actor_error(RayTaskError("f", "tb", ValueError("raised in the worker"))) is None
