"""agl_lab.algorithms.loss: per-rollout normalisation, the per_rollout_mean loss, its registration, weights.

Parity tests (marked `# AGL parity`) use the fixtures and expected values of AGL v1's
tests/verl/test_per_rollout_loss.py; the others pin
the improvement (the rollouts divisor).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from verl.trainer.ppo import core_algos

import agl_lab.algorithms as alg
import agl_lab.algorithms.loss as loss_module
from tests.algo_batches import make_batch

MASK_753 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


def _mass(norm: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> float:
    return float((norm * mask)[rows].sum())


def test_normalize_rows_divisor_matches_upstream():  # AGL parity
    norm = alg.normalize_advantages_by_rollout(
        torch.ones(3, 3), MASK_753, ["A", "A", "B"], num_trained_rows=3, divisor="rows"
    )
    assert _mass(norm, MASK_753, [0, 1]) == pytest.approx(1 / 3)
    assert _mass(norm, MASK_753, [2]) == pytest.approx(1 / 3)


def test_normalize_rollouts_divisor_gives_each_rollout_one_over_R():
    norm = alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"])
    assert _mass(norm, MASK_753, [0, 1]) == pytest.approx(1 / 2)
    assert _mass(norm, MASK_753, [2]) == pytest.approx(1 / 2)
    # golden per-token values: A has 3 tokens → 1/(3·2); B has 3 tokens → 1/(3·2)
    assert norm[0, 0].item() == pytest.approx(1 / 6) and norm[2, 2].item() == pytest.approx(1 / 6)


def test_normalize_validates_inputs():  # AGL parity
    with pytest.raises(ValueError, match="rollout_ids length"):
        alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "B"], num_trained_rows=3)
    with pytest.raises(ValueError, match="num_trained_rows"):
        alg.normalize_advantages_by_rollout(
            torch.ones(3, 3), MASK_753, ["A", "A", "B"], num_trained_rows=0, divisor="rows"
        )
    with pytest.raises(ValueError, match="agl_lab.algorithm.normalize_by"):
        alg.normalize_advantages_by_rollout(torch.ones(3, 3), MASK_753, ["A", "A", "B"], divisor="tokens")


def test_one_merged_row_equals_its_transition_rows_under_rollouts_divisor():
    # Rollout r1 = two calls of 2 tokens each. Trajectory level: one row with an observation
    # token between them (mask 0). Transition level: two rows. r2 is one 3-token call.
    merged = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    split = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    adv_m = torch.tensor([[2.0], [-1.0]]) * merged
    adv_s = torch.tensor([[2.0], [2.0], [-1.0]]) * split
    n_m = alg.normalize_advantages_by_rollout(adv_m, merged, ["r1", "r2"])
    n_s = alg.normalize_advantages_by_rollout(adv_s, split, ["r1", "r1", "r2"])
    # the same coefficient on every loss token of r1 (2/(4·2)) and r2, in both layouts
    assert n_m[0, 0].item() == n_s[0, 0].item() == n_s[1, 1].item() == pytest.approx(0.25)
    assert _mass(n_m, merged, [0]) == _mass(n_s, split, [0, 1]) == pytest.approx(1.0)
    cfg = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, global_batch_info={}
    )
    loss_m, _ = alg.compute_policy_loss_per_rollout_mean(torch.zeros(2, 5), torch.zeros(2, 5), n_m, merged, config=cfg)
    loss_s, _ = alg.compute_policy_loss_per_rollout_mean(torch.zeros(3, 5), torch.zeros(3, 5), n_s, split, config=cfg)
    assert loss_m.item() == pytest.approx(loss_s.item())
    # AGL v1's rows divisor does not have this property: r1 gets 1/2 merged, 1/3 split
    r_m = alg.normalize_advantages_by_rollout(adv_m, merged, ["r1", "r2"], divisor="rows")
    r_s = alg.normalize_advantages_by_rollout(adv_s, split, ["r1", "r1", "r2"], divisor="rows")
    assert _mass(r_m, merged, [0]) == pytest.approx(1.0) and _mass(r_s, split, [0, 1]) == pytest.approx(2 / 3)


def test_importing_registers_nothing_register_loss_does():  # AGL parity: the name verl's actor looks up
    code = (
        "import sys\nimport agl_lab.algorithms as alg\nfrom verl.trainer.ppo import core_algos\n"
        "before = 'per_rollout_mean' in core_algos.POLICY_LOSS_REGISTRY\nalg.register_loss()\n"
        "print(before, core_algos.get_policy_loss_fn('per_rollout_mean') is alg.compute_policy_loss_per_rollout_mean)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split()[-2:] == ["False", "True"]


def test_reimport_keeps_one_registered_loss():
    mod = importlib.reload(loss_module)
    mod.register_loss()  # replaces the function of the module's earlier import, no warning
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is mod.compute_policy_loss_per_rollout_mean
    mod.register_in_worker()  # the Ray hook re-registers the same function: no change
    assert core_algos.get_policy_loss_fn("per_rollout_mean") is mod.compute_policy_loss_per_rollout_mean
    # the package re-exports the reloaded function (so later tests see one registered loss)
    assert importlib.reload(alg).compute_policy_loss_per_rollout_mean is mod.compute_policy_loss_per_rollout_mean


def test_ray_hook_path_resolves_to_the_registration():
    from agl_lab.engines.verl.engine import WORKER_SETUP_HOOK

    module, _, name = WORKER_SETUP_HOOK.rpartition(".")
    assert getattr(importlib.import_module(module), name) is alg.register_in_worker


def test_policy_loss_matches_masked_sum():  # AGL parity
    adv = torch.tensor([[0.5, 0.5, 0.0], [-0.2, -0.2, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    cfg = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, global_batch_info={"dp_size": 2}
    )
    loss, metrics = alg.compute_policy_loss_per_rollout_mean(logp, logp.clone(), adv, mask, config=cfg)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() * 2)
    assert metrics["actor/ppo_kl"] == 0.0
    # through verl's registry, with verl's own actor config
    from verl.workers.config import FSDPActorConfig

    vcfg = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=None,
        clip_ratio_high=None,
    )
    vcfg.global_batch_info["dp_size"] = 2
    loss2, _ = core_algos.get_policy_loss_fn("per_rollout_mean")(
        old_log_prob=logp,
        log_prob=logp.clone(),
        advantages=adv,
        response_mask=mask.bool(),
        loss_agg_mode="token-mean",
        config=vcfg,
        rollout_is_weights=None,
    )
    assert loss2.item() == pytest.approx(loss.item())


def test_policy_loss_equals_verl_vanilla_with_token_sum():
    from verl.workers.config import FSDPActorConfig

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 6, generator=g) * 3
    new = old + torch.randn(8, 6, generator=g)  # ratios far outside [0.9, 1.28] and above c = 2
    adv = torch.randn(8, 1, generator=g).expand(8, 6) * 2
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    weights = torch.rand(8, 6, generator=g) + 0.5
    cfg = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.1,
        clip_ratio_high=0.28,
        clip_ratio_c=2.0,
    )
    cfg.global_batch_info["dp_size"] = 3
    ours, m_ours = alg.compute_policy_loss_per_rollout_mean(old, new, adv, mask, config=cfg, rollout_is_weights=weights)
    theirs, m_theirs = core_algos.compute_policy_loss_vanilla(
        old, new, adv, mask, loss_agg_mode="token-sum", config=cfg, rollout_is_weights=weights
    )
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert m_ours == pytest.approx(m_theirs)
    assert 0 < m_ours["actor/pg_clipfrac"] < 1 and m_ours["actor/pg_clipfrac_lower"] > 0


def test_policy_loss_checks_its_config():
    t = torch.zeros(1, 2)
    with pytest.raises(AssertionError, match="requires the actor config"):
        alg.compute_policy_loss_per_rollout_mean(t, t, t, torch.ones(1, 2))
    cfg = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=1.0)
    with pytest.raises(AssertionError, match="clip_ratio_c must be greater than 1.0, got 1.0"):
        alg.compute_policy_loss_per_rollout_mean(t, t, t, torch.ones(1, 2), config=cfg)


def test_rollout_weights_table():
    data = make_batch(MASK_753.tolist(), [1, 1, 3], ["A", "A", "B"], ["g"] * 3)
    data.batch["advantages"] = torch.tensor([[2.0], [2.0], [-1.0]]) * MASK_753
    table = alg.rollout_weights_table(data)
    assert list(table.columns) == [
        "rollout_id",
        "data_id",
        "reward",
        "advantage",
        "n_rows",
        "loss_tokens",
        "loss_weight",
        "signed_weight",
    ]
    assert table.loss_weight.tolist() == pytest.approx([0.5, 0.5])
    assert table.advantage.tolist() == [2.0, -1.0] and table.n_rows.tolist() == [2, 1]
    assert table.loss_tokens.tolist() == [3, 3] and table.reward.tolist() == [1.0, 3.0]
    assert alg.rollout_weights_table(data, divisor="rows").loss_weight.tolist() == pytest.approx([1 / 3, 1 / 3])
    tm = alg.rollout_weights_table(data, loss_mode="vanilla", loss_agg_mode="token-mean")
    assert tm.loss_weight.tolist() == pytest.approx([0.5, 0.5])
    sm = alg.rollout_weights_table(data, loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean")
    assert sm.loss_weight.tolist() == pytest.approx([2 / 3, 1 / 3])  # 2 rows of A vs 1 of B
    # the weights are the coefficients normalize_advantages_by_rollout really applies
    norm = alg.normalize_advantages_by_rollout(data.batch["advantages"], MASK_753, ["A", "A", "B"])
    assert (norm * MASK_753)[:2].sum().item() == pytest.approx(table.signed_weight[0])
