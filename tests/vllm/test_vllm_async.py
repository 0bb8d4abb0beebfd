"""Async rollout on verl's vLLM replicas (CPU): the Trainer pauses and drains the gateway, then verl
sleeps the replicas (on CPU: vLLM's scheduler pause), syncs the weights and wakes them.

Its own engine (one start, ~50 s): `agentlightning.async_rollout.enabled=true` on
configs/cpu_vllm.yaml. Two steps: no verl abort runs (sync mode's), the gateway's drain metrics
are recorded, the replicas were asleep for the update and serve the trained weights after it
(the first step's batch is on-policy; later ones carry groups over from the previous policy).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment: tests/vllm run in .venv-vllm (`./lab test` sets it "
        "up and runs them there)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

from tests.ray_env import isolated_ray_env  # noqa: E402
from tests.replica_probe import fixed_sequence, served_logprobs_of  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_vllm.yaml")


@pytest.fixture(scope="module")
def trainer():
    from agl_lab.trainer import Trainer

    with isolated_ray_env("aglva") as path:
        t = Trainer.from_config(
            CONFIG,
            [
                "agl_lab.task.n_train=16",
                "agl_lab.task.n_val=2",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "trainer.total_training_steps=4",
                "agentlightning.async_rollout.enabled=true",
                "agentlightning.async_rollout.async_train_batch_size=8",
            ],
            console=False,
            run_dir=os.path.join(path, "run"),
        )
        yield t
        t.close()


def test_async_steps_drain_the_gateway_then_sleep_sync_and_wake_the_replicas(trainer):
    engine = trainer.engine
    calls: list[str] = []
    for name in ("abort", "pause", "sync_weights", "resume"):  # record the engine calls the Trainer makes
        original = getattr(engine, name)

        def recorded(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(engine, name, recorded)
    v0 = engine.policy_version
    for k in range(2):
        before = len(calls)
        metrics = trainer.step()
        assert engine.policy_version == v0 + k + 1
        assert "training/async/proxy_drain_seconds" in metrics and "training/n_aborted_generations" not in metrics
        assert metrics["training/async/proxy_inflight_at_pause"] >= 0
        if k == 0:  # later batches mix in groups carried over from the previous policy: off-policy by design
            assert metrics["training/rollout_logprobs_diff_max"] <= 1e-4
        probe, _ = fixed_sequence(engine)
        served = served_logprobs_of(engine, probe)
        assert (served - engine.compute_log_probs(probe)[0].float()).abs().max().item() <= 1e-5
        step_calls = calls[before:]
        assert "abort" not in step_calls, step_calls
        # sleep before the update, then the weight sync wakes them, then generation reopens
        assert step_calls.index("pause") < step_calls.index("sync_weights") < len(step_calls) - 1, step_calls
        assert step_calls[-1] == "resume", step_calls
    # the carried-over groups of the async manager keep going on the new weights
    assert trainer.async_manager is not None


def test_a_killed_vllm_enginecore_fails_the_step_naming_the_replica_never_a_hang(trainer):
    """Runs last: SIGKILL vLLM's EngineCore process (the server actor itself stays alive: without the
    engine's check, verl's next resume would wait for ever); then close leaves no process behind."""
    import re
    import signal
    import time

    import psutil
    import ray

    from agl_lab.engines.verl.engine import VerlEngine, VerlWorkerDied

    engine = trainer.engine
    ours = psutil.Process().children(recursive=True)
    (core,) = [p for p in ours if p.name() == "VLLM::EngineCore"]
    watched = [p for p in ours if p.name() in ("raylet", "gcs_server") or p.name().startswith(("ray::", "VLLM::"))]
    os.kill(core.pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(
        VerlWorkerDied,
        match=r"the vLLM engine of rollout_replica/0/server_0 \(vLLMReplica\) died "
        r"\(EngineDeadError",
    ):
        trainer.step()
    print(f"step failed {time.time() - t0:.1f} s after the EngineCore kill")
    with pytest.raises(VerlWorkerDied, match=re.escape("rollout_replica/0/server_0")):
        engine.resume()
    assert isinstance(engine, VerlEngine)
    trainer.close()
    assert not ray.is_initialized()
    _, alive = psutil.wait_procs(watched, timeout=60)
    assert alive == [], [(p.pid, p.name()) for p in alive]
