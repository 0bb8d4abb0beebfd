"""The verl engine for real on CPU: verl's FSDP2 workers on Ray, the agl_lab_cpu replica, weight sync.

One engine (Ray + one FSDP2 actor/ref/rollout worker + agl_lab's OpenAI server inside it) is
built per module and driven by a real `agl_lab.Trainer` on the built-in lookup task:

- two full `Trainer.step()`s: the policy version advances, per_rollout_mean runs in the worker;
- after the weight sync, logprobs the replica serves for a fixed prompt equal the actor's
  recomputed logprobs (float32 everywhere, < 1e-4);
- a killed worker ends the next call with an error naming it, and closing leaves no Ray process.

Wall time on an idle 2-core machine: ~15 s imports + Ray, ~10 s workers, a few s per step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "cpu_verl.yaml")


@pytest.fixture(scope="module")
def ray_env():
    path = tempfile.mkdtemp(prefix="aglv", dir="/tmp")  # Ray's socket paths stay short
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=path, RAY_AUTH_MODE="disabled")
    yield path
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def trainer(ray_env):
    from agl_lab.trainer import Trainer

    t = Trainer.from_config(CONFIG, [
        "agl_lab.model.warm_start_steps=0", "agl_lab.task.n_train=16", "agl_lab.task.n_val=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=4"], console=False, run_dir=os.path.join(ray_env, "run"))
    yield t
    t.close()


def _count_loss_calls_in_workers(workers):
    """Wrap per_rollout_mean in each worker's registry with a call counter (nested: pickled by value)."""

    def install(_actor):
        from verl.trainer.ppo import core_algos

        fn = core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"]
        if not hasattr(fn, "calls"):
            def counted(*args, **kwargs):
                counted.calls += 1
                return fn(*args, **kwargs)

            counted.calls = 0
            core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"] = counted
        return core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"].calls

    def read(_actor):
        from verl.trainer.ppo import core_algos

        return core_algos.POLICY_LOSS_REGISTRY["per_rollout_mean"].calls

    ray.get([w.__ray_call__.remote(install) for w in workers])
    return lambda: sum(ray.get([w.__ray_call__.remote(read) for w in workers]))


def test_two_trainer_steps_through_verl_workers(trainer):
    engine = trainer.engine
    assert type(engine).__name__ == "VerlEngine"
    assert engine.trainer.config.actor_rollout_ref.rollout.name == "agl_lab_cpu"
    loss_calls = _count_loss_calls_in_workers(engine.trainer.actor_rollout_wg.workers)
    v0 = engine.policy_version
    results = [trainer.step() for _ in range(2)]
    assert engine.policy_version == v0 + 2
    for metrics in results:
        assert "actor/pg_loss" in metrics and metrics["training/policy_version"] >= 1
    assert loss_calls() >= 2, "per_rollout_mean never ran in the worker"


def test_served_logprobs_equal_the_actors_after_sync(trainer):
    import httpx
    from verl import DataProto

    engine = trainer.engine
    engine.resume()
    body = {"prompt": "Look up the capital of", "max_tokens": 12, "logprobs": 1, "temperature": 1.0,
            "seed": 7, "return_token_ids": True}
    choice = httpx.post(engine.endpoints()[0] + "/completions", json=body, timeout=60).json()["choices"][0]
    prompt, response = choice["prompt_token_ids"], choice["token_ids"]
    served = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
    ids = torch.tensor([prompt + response])
    data = DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1]).unsqueeze(0), "prompts": torch.tensor([prompt]),
        "responses": torch.tensor([response])})
    actor = engine.compute_log_probs(data, temperature=1.0)[0].float()
    assert engine.policy_version >= 2  # weights trained and synced at least twice
    assert torch.allclose(served, actor, atol=1e-4), (served - actor).abs().max()
