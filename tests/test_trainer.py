"""The stepwise Trainer end to end on CPU: real tiny model, real gateway, real agents."""

from __future__ import annotations

import json

import pytest
import torch

from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


@pytest.fixture
def trainer(tmp_path):
    tr = Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL, run_dir=tmp_path / "run", console=False)
    yield tr
    tr.close()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_step_changes_weights_and_bumps_policy_version(trainer):
    before = _params(trainer.engine.model)
    assert trainer.engine.policy_version == 0

    ro = trainer.rollout()
    assert len(ro.rollouts) == 8 and len(ro.groups) == 4
    assert (ro.triplets["server_version"] == 0).all()  # every call served by policy version 0
    # the engine's server over the phase: every call's prompt was computed or served from the cache
    m = ro.metrics
    assert m["rollout/prefill_tokens"] + m["rollout/cached_tokens"] == ro.triplets["prompt_tokens"].sum()
    assert m["rollout/prefill_tokens"] > 0 and m["rollout/decode_steps"] > 0
    # the slowest rollout's calls in series: each a prefill, then its decode steps — all of them engine steps
    assert 0 < m["rollout/critical_path_decode_steps"] <= m["rollout/decode_steps"]
    b = trainer.build_batch()
    assert b.metrics["training/n_rollouts"] == 8
    assert set(b.rows["rollout_id"]) <= {r.rollout_id for r in ro.rollouts}
    u = trainer.update()

    assert not u.skipped and u.policy_version == 1 == trainer.engine.policy_version
    # before the first update the trainer's logprobs equal the sampling logprobs
    assert u.metrics["training/rollout_logprobs_diff_max"] < 1e-4
    after = _params(trainer.engine.model)
    if u.metrics["actor/grad_norm"] > 0:
        assert any(not torch.equal(before[k], after[k]) for k in before)
    assert set(u.weights.columns) >= {"rollout_id", "reward", "advantage", "n_rows", "loss_tokens"}

    # the next rollout phase is served by the new weights, and the events say so
    ro2 = trainer.rollout()
    assert (ro2.triplets["server_version"] == 1).all()


def test_step_logs_one_json_line_per_step(trainer):
    trainer.step()
    trainer.step()
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]  # verl's 1-based global_steps
    assert all("training/reward" in r and "actor/pg_loss" in r for r in records)


def test_with_wandb_on_the_step_and_validation_upload_agl_side_tables(trainer, monkeypatch):
    """The Trainer sends AGL v1's W&B tables through its metrics logger, at the logged step."""
    import sys
    import types

    from tests.fake_wandb import FakeArtifact, FakeRun, FakeTable

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Table=FakeTable, Artifact=FakeArtifact))
    run = FakeRun()
    monkeypatch.setattr(trainer.metrics_logger, "_wandb_run", run)
    metrics = trainer.step()
    [(step, mismatches)] = run.tables("training/trace_merge_mismatches")
    assert step == 1 and len(mismatches.data) == metrics["training/n_trace_merge_mismatch_rows"]
    [(step, pointer)] = run.tables("training/rollout_trajectories")
    assert step == 1 and pointer.data[0][-1] == 8  # 4 tasks × n=2 rollouts, all under 24
    assert run.logged[-1][0] == 1 and "training/reward" in run.logged[-1][1]  # metrics at the same step
    trainer.validate()
    [(step, pointer)] = run.tables("val/rollout_trajectories")
    assert step == 1 and pointer.data[0][-1] == 4
    assert [a.type for a in run.artifacts] == ["train_trajectories", "validation_trajectories"]
    records = run.artifacts[0].files["step_1/train_trajectories.jsonl.zip"]
    assert records[:2] == b"PK"  # a zip of decoded trajectories


def test_stages_accept_explicit_results_and_rebuild_at_another_level(trainer):
    ro = trainer.rollout()
    traj = trainer.build_batch(ro)
    trans = trainer.build_batch(ro, level="transition")
    n_calls = sum(len(r.triplets) for r in ro.rollouts)
    assert len(trans.data) == n_calls
    assert len(traj.data) <= n_calls


def test_validate_runs_one_rollout_per_val_task(trainer):
    metrics = trainer.validate()
    assert metrics["val/n_rollouts"] == 4
    assert 0.0 <= metrics["val/reward"] <= 1.0


def test_update_before_build_batch_is_a_clear_error(trainer):
    with pytest.raises(RuntimeError, match=r"call trainer.build_batch\(\) first"):
        trainer.update()


def _numbers(metrics):
    keep = (
        "training/reward",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "training/n_sample_trained",
        "training/n_zero_adv_groups",
    )
    return {k: metrics[k] for k in keep if k in metrics}


def test_save_load_continue_matches_an_uninterrupted_run(tmp_path):
    """Seeded calls + saved optimiser/RNG/data cursor: resuming reproduces the same curve."""
    with Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=SMALL, run_dir=tmp_path / "a", console=False
    ) as straight:
        expected = [_numbers(straight.step()) for _ in range(3)]

    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL, run_dir=tmp_path / "b", console=False) as first:
        got = [_numbers(first.step()) for _ in range(2)]
        first.save(tmp_path / "ckpt")
    with Trainer.load(tmp_path / "ckpt", run_dir=tmp_path / "c", console=False) as resumed:
        assert resumed.global_step == 2 and resumed.engine.policy_version == 2
        got.append(_numbers(resumed.step()))

    assert got[:2] == expected[:2]  # same seed, same run
    for key, value in expected[2].items():
        assert got[2][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
