"""LoRA on verl's own vLLM replicas (vLLM's CPU build): the replicas sample from base + adapter.

verl 0.9.1 loads the adapter into its vLLM workers under its own LoRA request (`VLLM_LORA_NAME`,
`VLLM_LORA_INT_ID`, tensors from the actor) and attaches it only in its own `generate()`; the
gateway calls vLLM's OpenAI routes with the served model name. This module starts one engine
(configs/cpu_vllm.yaml, a rank-4 adapter whose B is not zero, `lora.merge` off — verl's default)
and checks, after one LoRA update and verl's adapter sync:

- the rollout's sampled logprobs equal the actor's recompute (`training/rollout_logprobs_diff_max`
  ≤ 1e-4, the full-weight path's bound in test_vllm_engine.py);
- the served logprobs of a fresh sample equal the actor's to 1e-5 (the full-weight path's bound),
  and differ from the base model's by far more (the base model serving would fail both);
- the request that reaches vLLM under the served model name carries verl's LoRA request, and
  with that route removed the replica serves the base model.

Without the route (`AglRayPPOTrainer.route_calls_to_adapter` a no-op) the first test fails:
`rollout_logprobs_diff_max` 0.65 (measured), the replica sampling from the base model.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment: tests/vllm run in .venv-vllm (`./lab test` sets it "
        "up and runs them there; `./lab setup-vllm` alone builds it)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

import ray  # noqa: E402
import torch  # noqa: E402

from tests.ray_env import isolated_ray_env  # noqa: E402
from tests.replica_probe import give_rollouts_distinct_rewards, sample_fixed  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_vllm.yaml")
FIXED_PROMPT = "Look up the capital of"


def _adapter_dir(tmp: str) -> str:
    """A rank-4 adapter for the tiny model with A and B both random: base and base + adapter differ
    from the first rollout on (PEFT's B = 0 would serve the base model's logprobs at first)."""
    from agl_lab.engines.local import LocalEngine
    from agl_lab.engines.lora import save_adapter
    from agl_lab.engines.warmstart import warm_started_model_dir
    from agl_lab.tasks import get_task

    with LocalEngine(str(warm_started_model_dir(get_task("lookup"), 0)), device="cpu", lora={"lora_rank": 4}) as eng:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in eng.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        return str(save_adapter(eng.model, eng.lora, os.path.join(tmp, "adapter")))


@pytest.fixture(scope="module")
def trainer():
    from agl_lab.trainer import Trainer

    with isolated_ray_env("aglvlora") as path:
        adapter = _adapter_dir(path)
        t = Trainer.from_config(
            CONFIG,
            [
                "agl_lab.model.warm_start_steps=0",
                "agl_lab.task.n_train=8",
                "agl_lab.task.n_val=2",
                "data.train_batch_size=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "data.max_response_length=16",
                "trainer.total_training_steps=2",
                "actor_rollout_ref.model.lora_rank=4",
                "actor_rollout_ref.model.lora_alpha=8",
                f"actor_rollout_ref.model.lora_adapter_path={adapter}",
            ],
            console=False,
            run_dir=os.path.join(path, "run"),
        )
        try:
            yield t
        finally:
            t.close()


def _base_logprobs(trainer, data) -> torch.Tensor:
    """The logprobs of `data`'s response under the base model alone (no adapter), [R]."""
    from agl_lab.engines.local import LocalEngine

    with LocalEngine(trainer.cfg.agl_lab.model.path, device="cpu") as base:
        return base.compute_log_probs(data, temperature=1.0)[0].float()


def _fixed_sequence(engine):
    return sample_fixed(engine.endpoints()[0], FIXED_PROMPT, model=engine.model_name, timeout=120)


def test_one_lora_step_samples_from_the_adapter_the_actor_trains(trainer):
    engine = trainer.engine
    probe, _ = _fixed_sequence(engine)
    actor_before = engine.compute_log_probs(probe, temperature=1.0)[0].float()
    batch = trainer.build_batch(trainer.rollout())  # sampled from adapter v0
    give_rollouts_distinct_rewards(batch.data)  # a gradient for every group: the adapter moves
    metrics = trainer.update(batch).metrics  # the LoRA update, then verl's adapter sync
    assert engine.policy_version == 1
    # the sampler's logprobs of the sampled tokens against the actor's recompute (adapter v0)
    diff = metrics["training/rollout_logprobs_diff_max"]
    assert diff <= 1e-4, diff  # the full-weight path's bound (test_vllm_engine.py)
    engine.resume()
    data, served = _fixed_sequence(engine)  # sampled from adapter v1
    actor = engine.compute_log_probs(data, temperature=1.0)[0].float()
    base = _base_logprobs(trainer, data)
    moved = (engine.compute_log_probs(probe, temperature=1.0)[0].float() - actor_before).abs().max().item()
    gap, from_base = (served - actor).abs().max().item(), (served - base).abs().max().item()
    print(
        f"rollout_logprobs_diff_max {diff:.2e}; the update moved the probe's logprobs by {moved:.3g}; after the "
        f"sync: served vs actor {gap:.2e}, served vs base model {from_base:.3g}"
    )
    assert moved > 1e-3  # the adapter moved: the sync had something to carry
    assert gap <= 1e-5  # the full-weight path's bound (test_vllm_engine.py)
    assert from_base > 1e-2  # the adapter is far from the base: the base model serving fails the bound above


def _routes(server) -> dict:
    """Runs in the replica's server actor: what a call naming the served model is given."""
    from agl_lab.engines.verl.vllm_lora import _serving_models

    models = _serving_models(server)
    return {name: (r.lora_name, r.lora_int_id) for name, r in models.lora_requests.items()}


def _unroute(server) -> None:
    from agl_lab.engines.verl.vllm_lora import _serving_models

    _serving_models(server).lora_requests.clear()


def test_the_served_name_carries_verl_s_lora_request_and_without_it_the_base_model_serves(trainer):
    from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME

    engine = trainer.engine
    engine.resume()
    (server,) = [replica.servers[0] for replica in engine.trainer.rollout_replicas()]
    assert ray.get(server.__ray_call__.remote(_routes)) == {engine.model_name: (VLLM_LORA_NAME, VLLM_LORA_INT_ID)}
    ray.get(server.__ray_call__.remote(_unroute))  # what the replica did before the routing: the base model
    try:
        data, served = _fixed_sequence(engine)
        actor = engine.compute_log_probs(data, temperature=1.0)[0].float()
        base = _base_logprobs(trainer, data)
        print(
            f"unrouted: served vs base {(served - base).abs().max().item():.2e}, vs actor {(served - actor).abs().max().item():.3g}"
        )
        assert (served - base).abs().max().item() <= 1e-5
        assert (served - actor).abs().max().item() > 1e-2
    finally:
        assert engine.trainer.route_calls_to_adapter() == [engine.model_name]
    data, routed = _fixed_sequence(engine)
    assert torch.allclose(routed, engine.compute_log_probs(data, temperature=1.0)[0].float(), atol=1e-5)
