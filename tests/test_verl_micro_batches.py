"""configs/gpu_verl.yaml's fixed micro-batches on verl's real FSDP2 worker (CPU): the same update.

Both CPU configs micro-batch by tokens (`use_dynamic_bsz`); configs/gpu_verl.yaml uses fixed
micro-batches of one row (`ppo_micro_batch_size_per_gpu: 1`, `log_prob_micro_batch_size_per_gpu: 1`)
with gradient checkpointing, remove-padding and `balance_batch`, as on the GPU. One engine on
configs/cpu_verl.yaml with those keys of the GPU config makes one update on a real batch; the
reference is the local engine on the same batch and weights — the update
tests/test_verl_cpu.py::test_local_and_verl_engines_make_the_same_update shows the dynamic
path makes (pg_loss to 1e-5, parameter change to 2e-5 relative). Equal here, fixed = dynamic
at those tolerances. Also: old logprobs recomputed row by row equal the replica's sampling
logprobs (float32).

Wall time on the shared 2-core machine: ~40-70 s (Ray, one worker, one rollout, one update).
"""

from __future__ import annotations

import os

import pandas as pd
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # Ray and FSDP workers start slowly on a busy machine

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from tests.ray_env import isolated_ray_env  # noqa: E402
from tests.replica_probe import give_rollouts_distinct_rewards  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "cpu_verl.yaml")
GPU_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "gpu_verl.yaml")
#: the GPU config's micro-batching and memory keys, taken from configs/gpu_verl.yaml itself
GPU_KEYS = (
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding",
    "trainer.balance_batch",
)


def _gpu_overrides() -> list[str]:
    from omegaconf import OmegaConf

    from agl_lab.config import load_config

    gpu = load_config(GPU_CONFIG)
    values = {key: OmegaConf.select(gpu, key) for key in GPU_KEYS}
    assert values["actor_rollout_ref.actor.use_dynamic_bsz"] is False
    assert values["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 1
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in values.items()]


def test_fixed_micro_batches_of_one_make_the_same_update(tmp_path):
    from agl_lab.engines.local import LocalEngine
    from agl_lab.trainer import Trainer
    from agl_lab.update import run_update

    if ray.is_initialized():
        ray.shutdown()
    overrides = _gpu_overrides()
    with isolated_ray_env("aglmb") as path:
        trainer = Trainer.from_config(
            CONFIG,
            [
                "agl_lab.model.warm_start_steps=0",
                "agl_lab.task.n_train=16",
                "agl_lab.task.n_val=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "trainer.total_training_steps=2",
                *overrides,
            ],
            console=False,
            run_dir=os.path.join(path, "run"),
        )
        try:
            cfg = trainer.cfg
            assert cfg.actor_rollout_ref.actor.use_dynamic_bsz is False
            assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1
            batch = trainer.build_batch(trainer.rollout())
            give_rollouts_distinct_rewards(batch.data)
            rows = len(batch.data)
            assert rows >= 8  # two mini-batches of 8 rows, each 8 micro-batches of one row
            engine = trainer.engine
            old = engine.compute_log_probs(batch.data)
            served = batch.data.batch["rollout_log_probs"]
            mask = batch.data.batch["response_mask"].bool()
            assert (old[mask] - served[mask]).abs().max().item() < 1e-4  # row-by-row recompute = sampling

            local = LocalEngine.from_config(cfg)
            try:
                before = {k: v.detach().clone() for k, v in local.model.state_dict().items()}
                local_result = run_update(cfg, local, batch, step=batch.step)
                after_local = {k: v.detach().clone() for k, v in local.model.state_dict().items()}
            finally:
                local.close()
            verl_result = trainer.update(batch)

            def read(_actor):
                from agl_lab.engines.verl.cpu_rollout import _ADAPTERS

                model = _ADAPTERS[0].server.scheduler.model
                return {k: v.detach().clone() for k, v in model.state_dict().items()}

            after_verl = ray.get(engine.trainer.actor_rollout_wg.workers[0].__ray_call__.remote(read))
        finally:
            trainer.close()
    lm, vm = local_result.metrics, verl_result.metrics
    assert lm["actor/pg_loss"] == pytest.approx(vm["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert lm["actor/grad_norm"] == pytest.approx(vm["actor/grad_norm"], rel=1e-5)
    pd.testing.assert_frame_equal(local_result.weights, verl_result.weights)
    d_local = torch.cat([(after_local[k] - before[k]).flatten() for k in before])
    d_verl = torch.cat([(after_verl[k] - before[k]).flatten() for k in before])
    rel = ((d_local - d_verl).norm() / d_local.norm()).item()
    print(
        f"fixed micro-batches of 1: pg_loss local {lm['actor/pg_loss']:.6g} verl {vm['actor/pg_loss']:.6g}; "
        f"grad_norm {lm['actor/grad_norm']:.6g} / {vm['actor/grad_norm']:.6g}; parameter change rel. diff {rel:.2e}"
    )
    assert d_local.abs().max() > 0 and rel < 2e-5
