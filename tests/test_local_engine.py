"""LocalEngine: the in-process engine serves and trains the same module, consistently.

The key property: the logprobs the server returned while sampling equal the logprobs
`compute_log_probs` recomputes on the built batch (the trainer's old logprobs), and after
`update` the server samples from the updated weights.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from omegaconf import OmegaConf

from agl_lab.engines.local import LocalEngine
from agl_lab.engines.local_ppo import ActorUpdateConfig
from tests.replica_probe import calls_to_batch, sample_calls


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine(device="cpu", actor={"ppo_mini_batch_size": 64, "loss_mode": "vanilla", "lr": 1e-2})
    yield eng
    eng.close()


def test_a_flat_actor_dict_with_unknown_keys_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"not ActorUpdateConfig fields: \['temperature'\].*meta_info"):
        LocalEngine(device="cpu", actor={"lr": 1e-2, "temperature": 1.0})


def test_engine_contract_basics(engine):
    assert engine.model_name == "agl-lab-tiny" and engine.device.type == "cpu"
    [url] = engine.endpoints()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert httpx.get(url + "/models").json()["data"][0]["id"] == "agl-lab-tiny"
    v = engine.policy_version
    engine.sync_weights()
    assert engine.policy_version == v + 1
    assert isinstance(engine.actor_cfg, ActorUpdateConfig) and engine.actor_cfg.lr == 1e-2
    assert engine.ref_model is None  # no KL loss → no reference copy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_log_probs_equals_served_logprobs(engine, temperature):
    calls = sample_calls(engine, temperature)
    data = calls_to_batch(calls, engine.tokenizer.pad_token_id, temperature)
    logp = engine.compute_log_probs(data, temperature=temperature)
    mask = data.batch["response_mask"].bool()
    assert logp.shape == data.batch["responses"].shape and logp.dtype == torch.float32
    diff = (logp - data.batch["rollout_log_probs"]).abs()[mask]
    assert diff.max().item() < 1e-4
    # the temperature matters: at another temperature the numbers differ
    other = engine.compute_log_probs(data, temperature=temperature + 0.5)
    assert (other - data.batch["rollout_log_probs"]).abs()[mask].max().item() > 1e-2


def test_update_trains_the_served_module(engine):
    calls = sample_calls(engine, 1.0)
    data = calls_to_batch(calls, engine.tokenizer.pad_token_id)
    data.batch["old_log_probs"] = engine.compute_log_probs(data, 1.0)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    data.batch["advantages"] = sign * data.batch["response_mask"].float()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    metrics = engine.update(data)
    assert {"actor/pg_loss", "actor/grad_norm", "actor/lr"} <= set(metrics) and metrics["actor/n_updates"] == 1
    assert any(not torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    assert not engine.model.training  # left in eval mode for serving
    after = engine.compute_log_probs(data, 1.0)
    mask = data.batch["response_mask"].bool()
    gain = ((after - data.batch["old_log_probs"]) * mask).sum(-1) / mask.sum(-1)
    assert (gain * sign[:, 0]).sum() > 0  # the surrogate improved: advantage-weighted logprobs rose
    # the server now samples from the updated weights: its logprobs match the recomputation
    fresh = sample_calls(engine, 1.0, n=2)
    fresh_batch = calls_to_batch(fresh, engine.tokenizer.pad_token_id)
    recomputed = engine.compute_log_probs(fresh_batch, 1.0)
    fmask = fresh_batch.batch["response_mask"].bool()
    assert (recomputed - fresh_batch.batch["rollout_log_probs"]).abs()[fmask].max().item() < 1e-4


def test_abort_and_pause(engine):
    assert engine.abort() == 0
    engine.pause()
    assert engine.server.scheduler.paused
    engine.resume()
    assert not engine.server.scheduler.paused


def test_save_load_round_trip(tmp_path):
    with LocalEngine(device="cpu", actor={"ppo_mini_batch_size": 64, "lr": 1e-2, "loss_mode": "vanilla"}) as eng:
        calls = sample_calls(eng, 1.0, n=2)
        data = calls_to_batch(calls, eng.tokenizer.pad_token_id)
        data.batch["old_log_probs"] = eng.compute_log_probs(data)
        data.batch["advantages"] = data.batch["response_mask"].float()
        eng.update(data)
        eng.sync_weights()
        eng.save(str(tmp_path / "ckpt"))
        saved = {k: v.clone() for k, v in eng.model.state_dict().items()}
        saved_opt = eng.optimizer.state_dict()["state"][0]["exp_avg"].clone()
        eng.update(data)  # move away from the checkpoint
        eng.sync_weights()
        assert eng.policy_version == 2
        eng.load(str(tmp_path / "ckpt"))
        assert eng.policy_version == 1
        assert all(torch.equal(saved[k], v) for k, v in eng.model.state_dict().items())
        assert torch.equal(eng.optimizer.state_dict()["state"][0]["exp_avg"], saved_opt)
        reloaded = eng.compute_log_probs(data)
    # the checkpoint is a plain HF model directory: a new engine serves it under the dir name
    with LocalEngine(str(tmp_path / "ckpt"), device="cpu") as again:
        assert again.model_name == "ckpt"
        assert torch.allclose(again.compute_log_probs(data), reloaded, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="LocalEngine.save"):
        LocalEngine.load(again, str(tmp_path))


def test_from_config():
    cfg = OmegaConf.create(
        {
            "agl_lab": {
                "seed": 0,
                "model": {"path": None, "device": "cpu", "max_model_len": 512},
                "engine_options": {"batch_window_ms": 1, "max_batch_size": 8},
            },
            "actor_rollout_ref": {
                "actor": {
                    "ppo_mini_batch_size": 4,
                    "ppo_micro_batch_size_per_gpu": 2,
                    "optim": {"lr": 3e-3},
                    "use_kl_loss": True,
                    "policy_loss": {"loss_mode": "vanilla"},
                },
                "rollout": {"n": 4, "temperature": 0.9},
            },
        }
    )
    with LocalEngine.from_config(cfg) as eng:
        assert eng.actor_cfg.ppo_mini_batch_size == 16 and not hasattr(eng.actor_cfg, "temperature")  # meta_info's
        assert eng.actor_cfg.lr == 3e-3 and eng.optimizer.param_groups[0]["lr"] == 3e-3
        assert eng.ref_model is not None and not any(p.requires_grad for p in eng.ref_model.parameters())
        # the zero-advantage skip is on by default but not exact with the KL loss: not applied
        assert eng.actor_cfg.skip_zero_advantage and not eng.actor_cfg.zero_skip_active
        assert eng.server.max_model_len == 512 and eng.server.scheduler.max_batch_size == 8


def test_from_config_reads_the_less_work_keys():
    from agl_lab.config import load_config

    cfg = load_config(
        "configs/cpu_tiny.yaml",
        ["agl_lab.algorithm.skip_zero_advantage=false", "actor_rollout_ref.actor.use_prefix_grouper=true"],
    )
    cfg.agl_lab.model.warm_start_steps = 0
    with LocalEngine.from_config(cfg) as eng:
        assert not eng.actor_cfg.skip_zero_advantage and eng.actor_cfg.use_prefix_grouper


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_kl_in_reward_and_rollout_correction_with_verls_functions_and_names(rollout_is):
    """algorithm.use_kl_in_reward and algorithm.rollout_correction on the local engine (#12)."""
    algorithm = {
        "use_kl_in_reward": True,
        "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.1},
        "rollout_correction": {
            "rollout_is": rollout_is,
            "rollout_is_threshold": 2.0,
            "rollout_rs": None,
            "rollout_rs_threshold": None,
            "bypass_mode": False,
            "loss_type": "ppo_clip",
            "rollout_is_batch_normalize": False,
        },
    }
    with LocalEngine(
        device="cpu", actor={"ppo_mini_batch_size": 64, "loss_mode": "vanilla", "lr": 5e-2}, algorithm=algorithm
    ) as eng:
        assert eng.ref_model is not None  # the KL reference: the initial weights
        data = calls_to_batch(sample_calls(eng, 1.0), eng.tokenizer.pad_token_id)
        # move the policy once, so old ≠ rollout (IS weights ≠ 1) and old ≠ ref (KL ≠ 0)
        data.batch["old_log_probs"] = eng.compute_log_probs(data, 1.0)
        data.batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.batch["response_mask"].float()
        eng.update(data)
        batch = calls_to_batch(sample_calls(eng, 1.0), eng.tokenizer.pad_token_id)
        # a sampler slightly off the trainer (as after an async step): IS weights ≠ 1
        batch.batch["rollout_log_probs"] = batch.batch["rollout_log_probs"] - 0.05 * batch.batch["response_mask"]
        scores = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
        scores[:, 0] = 1.0
        batch.batch["token_level_scores"] = scores
        batch.meta_info["temperature"] = 1.0
        out, metrics = eng.prepare(batch)

    mask = out.batch["response_mask"].float()
    kld = (out.batch["old_log_probs"] - out.batch["ref_log_prob"]) * mask  # verl's "kl" penalty: logp − ref
    assert kld.abs().sum() > 0
    assert torch.allclose(out.batch["token_level_rewards"], scores - 0.1 * kld, atol=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1) and "actor/reward_kl_penalty" in metrics
    weights = out.batch["rollout_is_weights"]
    log_ratio = (out.batch["old_log_probs"] - out.batch["rollout_log_probs"]) * mask
    if rollout_is == "token":
        expected = torch.exp(log_ratio).clamp(max=2.0) * mask
    else:
        expected = torch.exp(log_ratio.sum(-1, keepdim=True)).clamp(max=2.0) * mask
    assert torch.allclose(weights * mask, expected, atol=1e-5)
    assert any(k.startswith("rollout_corr/") for k in metrics)
