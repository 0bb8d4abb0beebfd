"""Overlap (#50 item 1, docs/engines.md "Overlap"): generation goes on while the update trains.

- `agl_lab.rollout.max_staleness=0` is today's synchronous loop, bit for bit (learning metrics and
  weights after 3 steps), with no serving copy built;
- at 1 the server generates from its serving copy while `update()` trains: it decodes during the
  update, those calls carry the old version, and the trained weights reach the server at the step
  boundary (`publish`);
- no trained rollout holds a call older than the bound;
- a checkpoint taken mid-overlap resumes the run: versions, carry-over, serving copy.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

OVERLAP = [
    *SMALL,
    "agentlightning.async_rollout.enabled=true",
    "agentlightning.async_rollout.async_train_batch_size=6",
    "agl_lab.rollout.max_staleness=1",
    "algorithm.rollout_correction.bypass_mode=true",
]
# warm-started (rewards that vary, so the update moves the weights) and batch-invariant (a call's
# logprobs do not depend on its batch-mates: two runs log the same sampler numbers; docs/engines.md)
EXACT = ["agl_lab.model.warm_start_steps=200", "agl_lab.engine_options.batch_invariant=true"]
_TIMING = ("timing", "perf/", "rollout/", "recording/")


def _run(tmp_path, name, overrides, steps=3):
    run_dir = tmp_path / name
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=run_dir, console=False) as t:
        start = {k: v.detach().clone() for k, v in t.engine.model.state_dict().items()}
        for _ in range(steps):
            t.step()
        weights = {k: v.detach().clone() for k, v in t.engine.model.state_dict().items()}
        assert t.engine.serving_model is t.engine.model  # no serving copy at staleness 0
    assert any(not torch.equal(start[k], weights[k]) for k in start)  # the steps trained
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in rows], weights


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tmp_path):
    base, w_base = _run(tmp_path, "sync", [*SMALL, *EXACT])
    zero, w_zero = _run(tmp_path, "zero", [*SMALL, *EXACT, "agl_lab.rollout.max_staleness=0"])
    assert len(base) == len(zero) == 3
    for step, (a, b) in enumerate(zip(base, zero, strict=True), start=1):
        assert "actor/pg_loss" in a and a.keys() == b.keys()
        differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
        assert not differ, f"step {step}: {differ}"
    assert w_base.keys() == w_zero.keys()
    assert all(torch.equal(w_base[k], w_zero[k]) for k in w_base)


@pytest.fixture
def overlapped(tmp_path):
    # warm-started: the serving copy must hold the warm-started weights, not the ones before
    overrides = [*OVERLAP, "agl_lab.model.warm_start_steps=50"]
    t = Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path / "run", console=False)
    yield t
    t.close()


def _watch_updates(engine):
    """Wrap engine.update: inside it, wait (bounded) until the server has run a decode step, and
    note the versions then; a paused server would never decode, so a True is overlap observed."""
    seen, update = [], engine.update

    def watched(data):
        start = engine.serving_counters()["decode_steps"]
        deadline = time.time() + 60
        while engine.serving_counters()["decode_steps"] == start and time.time() < deadline:
            time.sleep(0.01)
        seen.append(
            {
                "decoded": engine.serving_counters()["decode_steps"] > start,
                "training": engine.policy_version,
                "serving": engine.serving_version,
            }
        )
        return update(data)

    engine.update = watched
    return seen


def test_staleness_one_generates_while_the_update_trains_within_the_bound(overlapped):
    t = overlapped
    assert t.engine.overlaps and t.engine.serving_model is not t.engine.model
    served = dict(t.engine.serving_model.named_parameters())
    assert all(torch.equal(served[k], p) for k, p in t.engine.model.named_parameters())
    seen = _watch_updates(t.engine)
    versions = []
    for _ in range(3):
        serving_before = t.engine.serving_version
        logged = t.step()
        ro = t._last_rollout
        versions.append([r.policy_version for r in ro.rollouts if r.policy_version is not None])
        # the bound: no trained rollout holds a call older than max_staleness versions
        assert all(serving_before - v <= 1 for v in versions[-1]), (serving_before, versions[-1])
        assert logged["training/overlap/serving_version"] == t.engine.policy_version == t.global_step
    assert len(seen) == 3 and all(s["decoded"] for s in seen), seen  # the server decoded during every update
    assert all(s["serving"] == s["training"] for s in seen)  # ... with the weights of the version before it
    # step k+1 trains rollouts started under version k (sampled while update k ran): one-step off-policy
    assert any(v == k - 1 for k in (1, 2) for v in versions[k]), versions
    # the serving copy holds the trained weights after publish
    served = dict(t.engine.serving_model.named_parameters())
    assert all(torch.equal(served[k], p) for k, p in t.engine.model.named_parameters())


def test_overlapped_run_resumes_from_a_checkpoint(tmp_path):
    # the carry-over's pending rollouts live in the ledger: a sqlite store outlives the first Trainer,
    # and a short lease re-queues the ones its runner held when it closed (5 s: the runner beats beside
    # a training update on 2 cores, and a live claim must not expire)
    ledger = [f"agl_lab.server.store=sqlite:///{tmp_path}/ledger.db", "agl_lab.server.lease_seconds=5"]
    with Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=[*OVERLAP, *ledger], run_dir=tmp_path / "run", console=False
    ) as t:
        t.step()
        t.step()
        t.save(tmp_path / "ckpt")
        carried = {g["data_id"]: g["policy_version"] for g in t.async_manager.carry_over_groups()}
    assert carried  # next-step groups were in flight at the checkpoint
    with Trainer.load(tmp_path / "ckpt", run_dir=tmp_path / "resumed", console=False) as resumed:
        assert resumed.engine.overlaps and resumed.engine.serving_version == resumed.engine.policy_version == 2
        # carried-over groups keep the versions they were enqueued under
        back = {g["data_id"]: g["policy_version"] for g in resumed.async_manager.carry_over_groups()}
        assert back == carried
        logged = resumed.step()
        assert resumed.global_step == 3 and logged["training/overlap/serving_version"] == 3


def test_overlap_rules_name_the_key():
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="agentlightning.async_rollout.enabled=true"):
        load_config("configs/cpu_tiny.yaml", [*SMALL, "agl_lab.rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="agl_lab.rollout.stale_groups"):
        load_config("configs/cpu_tiny.yaml", [*OVERLAP, "agl_lab.rollout.stale_groups=later"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config("configs/cpu_tiny.yaml", [*SMALL, "agl_lab.rollout.max_staleness=-1"])


# ---------------------------------------------------------------------------------------------
# The bound under a slow agent: the carry-over manager against a real server and FakeRunner
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agl():
    from agl_lab.client import AglClient
    from agl_lab.server.embedded import EmbeddedServer
    from tests.fake_runner import KEY

    with EmbeddedServer(key=KEY, default_proxy={"model_name": "test-model"}) as srv:
        with AglClient(srv.url, key=KEY, backoff_base=0.001) as client:
            yield srv, client


def _manager(client):
    from agl_lab.rollout import AsyncRolloutManager

    return AsyncRolloutManager(
        client, n=2, train_batch_size=2, async_train_batch_size=3, rollout_config={}, poll_interval=0.01
    )


def _tasks(*names):
    return [{"name": n, "x": int(n[1:])} for n in names]


def test_a_slow_group_older_than_the_bound_is_dropped_never_trained(agl):
    from tests.fake_runner import FakeRunner

    server, client = agl
    manager, hold, trained = _manager(client), {"t2"}, []  # t2's agent never finishes while held
    with FakeRunner(server.url, hold=hold):
        for version, new in ((1, ("t0", "t1", "t2")), (2, ("t3", "t4")), (3, ("t5", "t6")), (4, ("t7", "t8"))):
            if version == 4:
                hold.clear()  # the slow group finishes late: it is collected and ignored
            manager.drop_stale(version, 1)  # as the Trainer does before topping up
            done, metrics = manager.run(
                _tasks(*new[: manager.n_new_tasks_needed()]), step=version, policy_version=version, max_staleness=1
            )
            trained += [(version, c) for c in done]
            assert metrics["training/overlap/n_stale_groups_dropped"] == (1.0 if version == 3 else 0.0)
    assert trained and all(v - c.enqueue_policy_version <= 1 for v, c in trained)
    assert "t2" not in {c.input["name"] for _, c in trained}


def test_wait_trains_the_group_at_the_bound_instead_of_dropping_it(agl):
    import threading

    from tests.fake_runner import FakeRunner

    server, client = agl
    manager, hold = _manager(client), {"t2"}
    with FakeRunner(server.url, hold=hold):
        done, _ = manager.run(_tasks("t0", "t1", "t2"), step=1, policy_version=1, max_staleness=1, stale_groups="wait")
        assert "t2" not in {c.input["name"] for c in done}
        threading.Timer(0.5, hold.clear).start()  # the slow agent ends; the phase waits for it
        done, metrics = manager.run(_tasks("t3", "t4"), step=2, policy_version=2, max_staleness=1, stale_groups="wait")
    assert [c.input["name"] for c in done][:2] == ["t2", "t2"]  # exactly one version old: trained now
    assert metrics["training/overlap/n_stale_groups_dropped"] == 0.0


def test_with_lora_the_serving_copy_shares_the_frozen_base_and_takes_the_adapters_at_publish():
    """The adapter swap's memory at the copy's exactness: the base tensors are the trained model's
    own (same storage), the adapters the copy's, equal to the trained ones after copy_to_serving."""
    from agl_lab.engines.local import LocalEngine

    lora = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    with LocalEngine(lora=lora, overlap=True) as engine:
        pairs = list(zip(engine.serving_model.parameters(), engine.model.parameters(), strict=True))
        frozen = [(s, t) for s, t in pairs if not t.requires_grad]
        adapters = [(s, t) for s, t in pairs if t.requires_grad]
        assert frozen and adapters
        assert all(s is t for s, t in frozen)  # shared, not copied
        assert all(s.data_ptr() != t.data_ptr() for s, t in adapters)
        assert engine.serving_copy_bytes == sum(t.numel() * t.element_size() for _, t in adapters)
        with torch.no_grad():
            for _, t in adapters:
                t.add_(0.01)  # what an optimizer step does to the adapters
        assert not all(torch.equal(s, t) for s, t in adapters)  # the server still has the old ones
        engine.copy_to_serving()
        assert all(torch.equal(s, t) for s, t in adapters)
    with LocalEngine(overlap=True) as full:  # full fine-tuning: every parameter is the copy's own
        assert full.serving_copy_bytes == sum(p.numel() * p.element_size() for p in full.model.parameters())
