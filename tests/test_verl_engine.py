"""VerlEngine phases on CPU: a real AglRayPPOTrainer over fake worker groups and fake replicas.

The trainer is built from verl 0.9.1's generated ppo_trainer config with an InMemoryDataset,
and its phases run verl's own code (DataProto → TensorDict, left/right padding → no padding,
DP dispatch constraints, `_balance_batch`, `_update_actor`'s mini-batch settings,
`_save_checkpoint` / `_load_checkpoint`, `reduce_metrics`). Only what needs GPUs is faked:
the actor worker group computes log-probs as a fixed function of the next token
(`-token/1000`), the replicas and the checkpoint-engine manager record their calls.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import verl  # noqa: E402  (tests may import verl directly; the engine may not)
from omegaconf import OmegaConf
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.utils import Role  # noqa: E402

from agl_lab.engines.verl.api import verl_import
from agl_lab.engines.verl.engine import VerlEngine
from agl_lab.engines.verl.trainer import InMemoryDataset
from tests.verl_fakes import fake_verl_trainer

P, R = 4, 3  # prompt / response widths of the hand-built batch

# ------------------------------------------------------------------------------------------
# Fixtures: verl's config, a trainer over the fakes, hand-built batches
# ------------------------------------------------------------------------------------------


def verl_config(**algorithm):
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 2
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    cfg.actor_rollout_ref.actor.policy_loss.loss_mode = "per_rollout_mean"
    cfg.data.train_batch_size = 2
    cfg.data.dataloader_num_workers = 0
    cfg.trainer.logger = ["console"]
    for key, value in algorithm.items():
        OmegaConf.update(cfg, f"algorithm.{key}", value)
    return cfg


TASKS = [{"question": f"q{i}", "extra_info": {"index": 100 + i}} for i in range(4)]


def make_engine(cfg=None, *, awake=False):
    cfg = cfg if cfg is not None else verl_config()
    trainer = fake_verl_trainer(cfg, TASKS)
    return VerlEngine.wrap(trainer, "fake-model", replicas_awake=awake), trainer, trainer.llm_server_manager.replicas


def make_batch(n: int, *, rollout_log_probs: torch.Tensor | None = None) -> DataProto:
    """n rows: left-padded prompts of 2-4 tokens, right-padded responses of 1-3 tokens (ids ≥ 100)."""
    prompts, responses = torch.zeros(n, P, dtype=torch.long), torch.zeros(n, R, dtype=torch.long)
    attn, scores = torch.zeros(n, P + R, dtype=torch.long), torch.zeros(n, R)
    for i in range(n):
        plen, rlen = 2 + i % 3, 1 + i % 3
        prompts[i, P - plen :] = 10 * i + torch.arange(1, plen + 1)
        responses[i, :rlen] = 100 + 10 * i + torch.arange(rlen)
        attn[i, P - plen : P + rlen] = 1
        scores[i, rlen - 1] = float(i % 2)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": torch.clamp(attn.cumsum(-1) - 1, min=0),
        "response_mask": attn[:, P:].clone(),
        "token_level_scores": scores,
    }
    if rollout_log_probs is not None:
        tensors["rollout_log_probs"] = rollout_log_probs
    uids = np.array([f"g{i // 2}" for i in range(n)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids, "rollout_id_list": uids.copy()})


# ------------------------------------------------------------------------------------------
# Serving phases
# ------------------------------------------------------------------------------------------


def test_endpoints_are_openai_base_urls_of_the_replicas():
    engine, _, _ = make_engine()
    assert engine.endpoints() == ["http://127.0.0.1:8001/v1", "http://[::1]:8002/v1"]
    assert engine.model_name == "fake-model"


def test_resume_pushes_weights_into_sleeping_replicas_then_opens_generation():
    engine, trainer, replicas = make_engine(awake=False)
    engine.resume()
    assert trainer.checkpoint_manager.calls == [("update_weights", 0)]
    assert [r.calls for r in replicas] == [["resume_generation"]] * 2
    engine.resume()  # awake now: no second weight push
    assert trainer.checkpoint_manager.calls == [("update_weights", 0)]
    assert engine.policy_version == 0


def test_abort_counts_aborted_requests_over_all_replicas_and_pause_sleeps_once():
    engine, trainer, replicas = make_engine(awake=True)
    assert engine.abort() == 3 + 4
    engine.pause()
    engine.pause()
    assert trainer.checkpoint_manager.calls == [("sleep_replicas",)]
    assert engine.abort() == 0  # sleeping replicas run nothing to abort
    assert [r.calls for r in replicas] == [["abort_all_requests"]] * 2


# ------------------------------------------------------------------------------------------
# Learning phases
# ------------------------------------------------------------------------------------------


def _expected_old_log_probs(batch: DataProto) -> torch.Tensor:
    return -batch.batch["responses"].float() / 1000 * batch.batch["response_mask"]


def test_prepare_recomputes_old_log_probs_on_a_dp_padded_batch():
    engine, trainer, _ = make_engine()
    batch = make_batch(3)  # 3 rows, DP 2 → the workers must see 4
    prepared, metrics = engine.prepare(batch)
    assert trainer.actor_rollout_wg.calls[0][:2] == ("compute_log_prob", 4)
    old = prepared.batch["old_log_probs"]
    assert old.shape == (3, R)
    torch.testing.assert_close(old * prepared.batch["response_mask"], _expected_old_log_probs(batch))
    assert torch.equal(prepared.batch["token_level_rewards"], prepared.batch["token_level_scores"])
    assert metrics["actor/entropy"] == pytest.approx(0.5) and metrics["perf/mfu/actor_infer"] == 0.25
    assert "entropys" not in prepared.batch.keys()
    again, again_metrics = engine.prepare(prepared)  # idempotent: no second worker call
    assert again is prepared and again_metrics == {} and len(trainer.actor_rollout_wg.calls) == 1


def test_compute_log_probs_passes_the_temperature_to_the_workers():
    engine, trainer, _ = make_engine()
    batch = make_batch(4)
    old = engine.compute_log_probs(batch, temperature=0.7)
    assert trainer.actor_rollout_wg.calls == [("compute_log_prob", 4, 0.7)]
    torch.testing.assert_close(old * batch.batch["response_mask"], _expected_old_log_probs(batch))


def test_bypass_mode_takes_finite_rollout_log_probs_as_old_log_probs():
    cfg = verl_config(**{"rollout_correction.bypass_mode": True})
    engine, trainer, _ = make_engine(cfg)
    sampled = -torch.rand(2, R)
    prepared, _ = engine.prepare(make_batch(2, rollout_log_probs=sampled))
    assert torch.equal(prepared.batch["old_log_probs"], sampled)
    assert trainer.actor_rollout_wg.calls == []  # no recompute
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"  # loss untouched
    with pytest.raises(RuntimeError, match="rollout_log_probs"):
        engine.prepare(make_batch(2))
    with pytest.raises(RuntimeError, match="finite"):
        engine.prepare(make_batch(2, rollout_log_probs=torch.full((2, R), float("nan"))))


def test_update_runs_verl_actor_update_and_sync_publishes_the_new_version():
    engine, trainer, _ = make_engine(awake=True)
    batch, _ = engine.prepare(make_batch(4))
    batch.batch["advantages"] = torch.ones(4, R)
    responses = batch.batch["responses"].clone()
    metrics = engine.update(batch)
    assert torch.equal(batch.batch["responses"], responses)  # balancing reordered a copy, not the caller's rows
    assert "global_seqlen/min" in metrics  # verl's _balance_batch ran (trainer.balance_batch=true)
    name, rows, settings, keys = trainer.actor_rollout_wg.calls[-1]
    assert (name, rows) == ("update_actor", 4)
    assert settings == {"global_batch_size": 2 * 2, "epochs": 1}  # ppo_mini_batch_size × rollout.n
    assert {"advantages", "old_log_probs", "loss_mask"} <= set(keys)
    assert metrics["actor/pg_loss"] == pytest.approx(0.6) and metrics["perf/mfu/actor"] == pytest.approx(0.3)
    assert metrics["training/global_step"] == 1.0 and "timing_s/update_actor" in metrics
    assert engine.policy_version == 0  # weights not pushed yet
    engine.sync_weights()  # naive backend: sleep first, then push tagged with the step
    assert trainer.checkpoint_manager.calls == [("sleep_replicas",), ("update_weights", 1)]
    assert engine.policy_version == 1


def test_update_computes_missing_old_log_probs_like_the_local_engine():
    engine, trainer, _ = make_engine()
    batch = make_batch(4)
    batch.batch["advantages"] = torch.ones(4, R)
    engine.update(batch)
    assert [c[0] for c in trainer.actor_rollout_wg.calls] == ["compute_log_prob", "update_actor"]


def test_update_pads_a_partial_mini_batch_with_zero_weight_rows():
    engine, trainer, _ = make_engine()
    batch, _ = engine.prepare(make_batch(3))
    batch.batch["advantages"] = torch.ones(3, R)
    assert trainer.mini_batch_rows() == 2 * 2
    loss_tokens = batch.batch["response_mask"].sum(-1).tolist()
    metrics = engine.update(batch)
    assert metrics["training/n_sample_padded"] == 1.0 and len(batch) == 3  # the caller's batch is untouched
    name, rows, _, _ = trainer.actor_rollout_wg.calls[-1]
    assert (name, rows) == ("update_actor", 4)  # verl's worker gets whole mini-batches
    # the padding row carries no loss token; the real rows keep theirs (balancing may reorder)
    assert sorted(trainer.actor_rollout_wg.loss_tokens) == sorted(loss_tokens + [0])


def test_update_rejects_an_empty_or_unprepared_batch():
    engine, _, _ = make_engine()
    with pytest.raises(ValueError, match="advantages"):
        engine.update(engine.prepare(make_batch(4))[0])
    empty, _ = engine.prepare(make_batch(4))
    empty = empty.select_idxs([])
    empty.batch["advantages"] = torch.ones(0, R)
    with pytest.raises(ValueError, match="0 rows"):
        engine.update(empty)


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def test_save_and_load_round_trip_verl_state(tmp_path):
    engine, trainer, _ = make_engine(awake=True)
    batch, _ = engine.prepare(make_batch(4))
    batch.batch["advantages"] = torch.ones(4, R)
    engine.update(batch)
    engine.save(str(tmp_path))
    step_dir = tmp_path / "global_step_1"
    assert (step_dir / "actor" / "weights.txt").read_text() == "1"
    assert (step_dir / "data.pt").exists()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"

    fresh, fresh_trainer, _ = make_engine(awake=True)
    fresh.load(str(tmp_path))
    assert fresh_trainer.global_steps == 1 and fresh.policy_version == 1
    assert fresh_trainer.actor_rollout_wg.calls[-1] == ("load_checkpoint", str(step_dir / "actor"), "1")
    assert fresh_trainer.checkpoint_manager.calls == [("sleep_replicas",), ("update_weights", 1)]
    with pytest.raises(FileNotFoundError, match="global_step_N"):
        fresh.load(str(tmp_path / "nothing-here"))


def test_verl_fit_is_refused():
    _, trainer, _ = make_engine()
    with pytest.raises(NotImplementedError, match="agl_lab.Trainer"):
        trainer.fit()


# ------------------------------------------------------------------------------------------
# InMemoryDataset
# ------------------------------------------------------------------------------------------


def test_in_memory_dataset_rows_become_a_verl_batch():
    rows = [{"q": "a", "extra_info": {"index": 7}}, {"q": "b", "extra_info": None}, {"q": "c"}]
    ds = InMemoryDataset(rows, name="train_dataset")
    assert len(ds) == 3 and [ds[i]["index"] for i in range(3)] == [7, 1, 2]
    assert ds[1]["extra_info"] is None  # the task row reaches agents as given
    batch = DataProto.from_single_dict(verl_import("collate_fn")([ds[i] for i in range(3)]))
    assert batch.batch["dummy_tensor"].shape == (3, 1)
    assert list(batch.non_tensor_batch["q"]) == ["a", "b", "c"]
    assert list(batch.non_tensor_batch["extra_info"]) == [{"index": 7}, None, None]  # keys unified
    clone = pickle.loads(pickle.dumps(ds))  # Ray / dataloader checkpoints carry the rows
    assert clone[0]["q"] == "a" and len(clone) == 3


def test_in_memory_dataset_rejects_bad_rows_by_name():
    with pytest.raises(ValueError, match="train_dataset must be non-empty"):
        InMemoryDataset([], name="train_dataset")
    with pytest.raises(TypeError, match=r"val_dataset\[1\] must be a mapping"):
        InMemoryDataset([{"q": 1}, "not a row"], name="val_dataset")
    with pytest.raises(TypeError, match="extra_info"):
        InMemoryDataset([{"extra_info": 3}])[0]


# ------------------------------------------------------------------------------------------
# configs/gpu_verl.yaml → the verl stack (everything short of spawning GPU workers)
# ------------------------------------------------------------------------------------------

GPU_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpu_verl.yaml"


def test_gpu_config_builds_the_trainer_on_cpu_up_to_init_workers():
    from agl_lab.config import load_config
    from agl_lab.engines.tiny import tiny_model_dir
    from agl_lab.engines.verl.trainer import build_trainer

    model_dir = str(tiny_model_dir())  # a real local HF model dir instead of Qwen (no downloads)
    cfg = load_config(GPU_CONFIG, [f"agl_lab.model.path={model_dir}", "data.dataloader_num_workers=0"])
    assert cfg.agl_lab.engine == "verl"
    rows = [{"question": f"q{i}"} for i in range(16)]
    trainer, model_name = build_trainer(cfg, rows, rows[:4])  # verl's validate_config runs inside
    assert model_name == model_dir  # the name vLLM serves (`vllm serve <local_path>`)
    assert trainer.config.actor_rollout_ref.model.path == model_dir
    assert cfg.actor_rollout_ref.model.path != model_dir  # the Trainer's config is not edited
    assert trainer.tokenizer is not None and trainer.tokenizer.pad_token_id is not None
    assert set(trainer.role_worker_mapping) == {Role.ActorRollout, Role.Critic}
    assert trainer.resource_pool_manager.resource_pool_spec == {"global_pool": [1]}
    assert len(trainer.train_dataloader) == 16 // cfg.data.train_batch_size
    assert not trainer.use_critic and not trainer.use_reference_policy
