"""configs/cpu_vllm.yaml runs the GPU config's code path: the two differ only in documented device keys.

Both files are composed the way `agl-lab train` composes them (verl's defaults + Agent Lightning's
+ agl_lab's, then the file) and every leaf where they differ must fall under a key of
`agl_lab.engines.verl.vllm_cpu.DEVICE_KEYS` (each listed with its reason). Fast; runs in the main
environment (no vLLM needed) and in .venv-vllm.
"""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from agl_lab.config import load_config
from agl_lab.engines.verl.vllm_cpu import DEVICE_KEYS

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():  # an empty mapping has no leaf: the same as absent
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


def _flat(cfg) -> dict:
    return dict(_leaves(OmegaConf.to_container(cfg, resolve=False)))


def undocumented_differences(gpu, cpu) -> list[str]:
    """Leaves where the two configs differ that no DEVICE_KEYS entry covers."""
    a, b = _flat(gpu), _flat(cpu)
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, missing) == b.get(key, missing):
            continue
        if not any(key == k or key.startswith(k + ".") for k in DEVICE_KEYS):
            out.append(f"{key}: gpu {a.get(key, '<absent>')!r} vs cpu_vllm {b.get(key, '<absent>')!r}")
    return out


@pytest.fixture(scope="module")
def configs():
    return (load_config(os.path.join(CONFIGS, "gpu_verl.yaml")), load_config(os.path.join(CONFIGS, "cpu_vllm.yaml")))


def test_cpu_vllm_differs_from_gpu_verl_only_in_documented_device_keys(configs):
    gpu, cpu = configs
    assert undocumented_differences(gpu, cpu) == []


def test_the_code_path_keys_are_equal(configs):
    gpu, cpu = configs
    for key in (
        "agl_lab.engine",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.mode",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        "actor_rollout_ref.rollout.load_format",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "algorithm.adv_estimator",
        "agl_lab.server.include_log_probs",
        "agentlightning.async_rollout.enabled",
    ):
        assert OmegaConf.select(gpu, key) == OmegaConf.select(cpu, key), key
    assert cpu.actor_rollout_ref.rollout.name == "vllm"


def test_the_comparison_catches_a_code_path_difference(configs):
    gpu, cpu = configs
    drifted = OmegaConf.merge(
        cpu, {"actor_rollout_ref": {"rollout": {"mode": "sync", "checkpoint_engine": {"backend": "nccl"}}}}
    )
    found = undocumented_differences(gpu, drifted)
    assert [line.split(":")[0] for line in found] == [
        "actor_rollout_ref.rollout.checkpoint_engine.backend",
        "actor_rollout_ref.rollout.mode",
    ]


def test_every_device_key_is_used_and_explained(configs):
    gpu, cpu = configs
    a, b = _flat(gpu), _flat(cpu)
    differing = {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    unused = [k for k in DEVICE_KEYS if not any(d == k or d.startswith(k + ".") for d in differing)]
    assert unused == [], f"DEVICE_KEYS entries that no longer differ (drop them): {unused}"
    assert all(reason.strip() for reason in DEVICE_KEYS.values())
