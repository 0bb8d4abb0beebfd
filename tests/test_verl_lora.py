"""LoRA through verl's own keys on both engines: the same update from the same adapter.

verl's FSDP2 actor (its `_build_lora_module`: PEFT's `get_peft_model`, or `PeftModel.from_pretrained`
for `lora_adapter_path`) and the local engine (`agl_lab.engines.lora`, PEFT's layers injected in
place) start from one adapter file whose B is not zero (so A and B both get gradients), take one
update on the same batch, and must agree: pg_loss, grad norm, the loss-weight table and the change
of every adapter tensor. verl's sync sends the adapter alone (`actor_rollout_ref.model.lora.merge: false`, its default); the
agl_lab_cpu replica injects the same PEFT layers into its model once and serves base + adapter, so its
logprobs equal the actor's.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
]  # the module fixture starts Ray, FSDP workers and a replica: > 300 s beside two busy loops

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from tests.ray_env import isolated_ray_env  # noqa: E402
from tests.replica_probe import give_rollouts_distinct_rewards, sample_fixed  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "cpu_verl.yaml")


def _adapter_dir(tmp: str) -> str:
    """A rank-4 adapter for the tiny model with A and B both random (B = 0 would leave A no gradient)."""
    from agl_lab.engines.local import LocalEngine
    from agl_lab.engines.lora import save_adapter
    from agl_lab.engines.warmstart import warm_started_model_dir
    from agl_lab.tasks import get_task

    with LocalEngine(str(warm_started_model_dir(get_task("lookup"), 0)), device="cpu", lora={"lora_rank": 4}) as eng:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in eng.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return str(save_adapter(eng.model, eng.lora, os.path.join(tmp, "adapter")))


@pytest.fixture(scope="module")
def trainer():
    from agl_lab.trainer import Trainer

    with isolated_ray_env("aglora") as path:
        adapter = _adapter_dir(path)
        t = Trainer.from_config(
            CONFIG,
            [
                "agl_lab.model.warm_start_steps=0",
                "agl_lab.task.n_train=16",
                "agl_lab.task.n_val=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
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


def _actor_adapter(engine) -> dict:
    """The actor's adapter tensors (PEFT's names without the wrapper prefix), read from the worker."""

    def find(obj, depth=0):  # the worker's FSDP module, wherever this verl version keeps it
        if isinstance(obj, torch.nn.Module) and any(".lora_A." in n for n, _ in obj.named_parameters()):
            return obj
        if depth < 5:
            values = obj.values() if isinstance(obj, dict) else getattr(obj, "__dict__", {}).values()
            for value in list(values):
                found = find(value, depth + 1)
                if found is not None:
                    return found
        return None

    def read(actor):
        module = find(actor)
        if module is None:
            raise LookupError(f"no LoRA module in the worker: {sorted(vars(actor))}")
        out = {}
        for name, p in module.named_parameters():
            if ".lora_" in name:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                out[name.split("base_model.model.", 1)[-1].replace(".default", "")] = full.detach().clone()
        return out

    return ray.get(engine.trainer.actor_rollout_wg.workers[0].__ray_call__.remote(read))


def test_local_and_verl_engines_make_the_same_lora_update(trainer):
    from agl_lab.engines.local import LocalEngine
    from agl_lab.update import run_update

    engine = trainer.engine
    batch = trainer.build_batch(trainer.rollout())
    give_rollouts_distinct_rewards(batch.data)
    local = LocalEngine.from_config(trainer.cfg)
    try:
        assert local.lora.rank == 4 and local.lora_params is not None
        before = {
            k.replace(".default", ""): v.detach().clone() for k, v in local.model.state_dict().items() if ".lora_" in k
        }
        verl_before = _actor_adapter(engine)
        assert set(verl_before) == set(before)
        assert all(torch.equal(verl_before[k], before[k]) for k in before)  # one adapter file, both engines
        local_result = run_update(trainer.cfg, local, batch, step=batch.step)
        after_local = {
            k.replace(".default", ""): v.detach().clone() for k, v in local.model.state_dict().items() if ".lora_" in k
        }
    finally:
        local.close()
    verl_result = trainer.update(batch)
    after_verl = _actor_adapter(engine)
    lm, vm = local_result.metrics, verl_result.metrics
    assert lm["actor/pg_loss"] == pytest.approx(vm["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert lm["actor/grad_norm"] == pytest.approx(vm["actor/grad_norm"], rel=1e-5)
    pd.testing.assert_frame_equal(local_result.weights, verl_result.weights)
    d_local = torch.cat([(after_local[k] - before[k]).flatten() for k in sorted(before)])
    d_verl = torch.cat([(after_verl[k] - before[k]).flatten() for k in sorted(before)])
    assert d_local.abs().max() > 0
    rel = ((d_local - d_verl).norm() / d_local.norm()).item()
    print(
        f"LoRA: pg_loss local {lm['actor/pg_loss']:.6g} verl {vm['actor/pg_loss']:.6g}; grad_norm "
        f"{lm['actor/grad_norm']:.6g} / {vm['actor/grad_norm']:.6g}; adapter change rel. diff {rel:.2e}"
    )
    assert rel < 2e-5


def _replica_events(_actor) -> list[str]:
    """Runs in the worker: what verl asked of the replica, in order."""
    from agl_lab.engines.verl.cpu_rollout import _ADAPTERS

    return list(_ADAPTERS[0].events)


def test_the_replica_serves_base_plus_adapter_after_the_sync(trainer):
    """After the LoRA update and verl's adapter sync, the replica's logprobs are the actor's
    (base + adapter), and not the base model's."""
    from agl_lab.engines.local import LocalEngine

    engine = trainer.engine
    assert engine.policy_version >= 1  # the update above trained and synced
    events = ray.get(engine.trainer.actor_rollout_wg.workers[0].__ray_call__.remote(_replica_events))
    assert "adapter:injected" in events  # the adapter path, not merged weights
    engine.resume()
    data, served = sample_fixed(engine.endpoints()[0], "Look up the capital of")
    actor = engine.compute_log_probs(data, temperature=1.0)[0].float()
    assert torch.allclose(served, actor, atol=1e-4), (served - actor).abs().max()
    with LocalEngine(trainer.cfg.agl_lab.model.path, device="cpu") as base:  # the base without any adapter
        base_lp = base.compute_log_probs(data, temperature=1.0)[0].float()
    assert (base_lp - served).abs().max() > 1e-3
