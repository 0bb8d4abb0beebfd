"""verl's own async trainers' keys (#50 item 5): refused at load, one line each, with the fix.

verl 0.9.1's fully-async trainer (`verl/experimental/fully_async_policy`) and one-step-off trainer
run the rollouter and the trainer as separate Ray actors on their own GPU pools; neither agl_lab
engine runs them, so `async_training.*` and the keys only those trainers read fail naming the key,
why, and agl_lab's counterpart. The keys come from the installed verl's own yaml, not a copy.
Overlap itself (`agl_lab.rollout.max_staleness` > 0) is the local engine's, refused on verl's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl_lab.config import ConfigError, load_config
from agl_lab.config_keys import user_keys

OVERLAP = ["agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=16"]


def _verl_yaml(*parts: str):
    root = Path(importlib.util.find_spec("verl").origin).parent / "experimental"
    return OmegaConf.load(root.joinpath(*parts))


def _refusal(config: str, overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(config, overrides)
    return str(e.value)


@pytest.mark.parametrize("config", ["configs/cpu_verl.yaml", "configs/cpu_tiny.yaml"])
def test_every_async_training_key_of_verls_fully_async_trainer_is_refused_with_the_fix(config):
    section = _verl_yaml("fully_async_policy", "config", "fully_async_ppo_trainer.yaml").async_training
    keys = [f"async_training.{k}" for k in user_keys(section)]
    assert "async_training.staleness_threshold" in keys and len(keys) >= 5
    for key in keys:
        value = OmegaConf.select(OmegaConf.create({"async_training": section}), key)
        message = _refusal(config, [f"{key}={value}"])
        (line,) = message.splitlines()  # one line for one key
        assert line.startswith(f"{key} (from command-line overrides)") and "separate Ray actors" in line
        assert "set " in line  # the fix
    threshold = _refusal(config, ["+async_training.staleness_threshold=0.5"])  # Hydra's append form too
    assert "agl_lab.rollout.max_staleness=N" in threshold and "not versions" in threshold


def test_the_one_step_off_trainers_own_keys_are_refused_one_line_each():
    """Its yaml's keys beyond verl's ppo_trainer (the rollouter's pool), as a config mapping."""
    own = _verl_yaml("one_step_off_policy", "config", "one_step_off_ppo_trainer.yaml")
    layer = {"rollout": OmegaConf.to_container(own.rollout)}
    message = _refusal(layer, None)
    lines = message.splitlines()
    assert sorted(line.split()[0] for line in lines) == ["rollout.n_gpus_per_node", "rollout.nnodes"]
    assert all("the rollouter's own GPU pool" in line for line in lines)
    # the keys it shares with ppo_trainer load as ever (verl's names, passed through)
    cfg = load_config("configs/cpu_verl.yaml", ["actor_rollout_ref.rollout.calculate_log_probs=true"])
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True


def test_actor_keys_of_the_fully_async_trainer_point_at_bypass_mode():
    message = _refusal("configs/cpu_tiny.yaml", ["actor_rollout_ref.actor.use_rollout_log_probs=true"])
    assert "algorithm.rollout_correction.bypass_mode=true" in message
    assert "unknown key" not in message


def test_a_misspelt_key_still_gets_the_closest_known_key():
    message = _refusal("configs/cpu_tiny.yaml", ["data.train_bach_size=3"])
    assert "unknown key 'data.train_bach_size'" in message and "data.train_batch_size" in message


def test_overlap_is_refused_on_the_verl_engine_and_loads_on_the_local_one():
    message = _refusal("configs/cpu_verl.yaml", [*OVERLAP, "agl_lab.rollout.max_staleness=1"])
    assert "agl_lab.rollout.max_staleness=1" in message and "agl_lab.engine=local" in message
    assert "agl_lab.engine=verl" in message
    assert load_config("configs/cpu_verl.yaml", [*OVERLAP, "agl_lab.rollout.max_staleness=0"]).agl_lab.engine == "verl"
    local = load_config(
        "configs/cpu_verl.yaml",
        [
            *OVERLAP,
            "agl_lab.rollout.max_staleness=1",
            "agl_lab.engine=local",
            "algorithm.rollout_correction.bypass_mode=true",
        ],
    )
    assert local.agl_lab.rollout.max_staleness == 1
