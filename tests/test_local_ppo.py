"""agl_lab.engines.local_ppo on a real tiny Qwen2 (2 layers, hidden 64, vocab 300, built from a config).

The batch is sampled from the model itself with HF `generate` (logprobs from its raw
logits, like the local engine's server), so the trainer/rollout logprob mismatch must be ~0.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import Qwen2ForCausalLM
from verl import DataProto

import agl_lab.algorithms as alg
from agl_lab.engines import zero_skip
from agl_lab.engines.base import logprob_gap, sampling_log_probs
from agl_lab.engines.local_ppo import (
    ActorUpdateConfig,
    batch_log_probs,
    build_optimizer,
    ppo_update,
    rollout_mismatch_metrics,
    sequence_log_probs,
)
from tests.hand_built import tiny_qwen2

P, R, T = 6, 8, 0.7
ROLLOUTS = ["r0", "r0", "r1", "r2", "r3", "r3", "r4", "r5"]  # r0 and r3 have two rows each
GROUPS = ["g0"] * 4 + ["g1"] * 4
REWARD = {"r0": 1.0, "r1": 0.0, "r2": 1.0, "r3": 0.0, "r4": 1.0, "r5": 0.0}
RESPONSE_LEN = [8, 5, 8, 3, 6, 8, 2, 7]  # right padding after these many response tokens


def sample_batch(model: Qwen2ForCausalLM) -> DataProto:
    """8 rows sampled at temperature T: left-padded prompts, right-padded responses, an
    observation (attended, loss-masked) at response position 2 of the first row of each group."""
    n = len(ROLLOUTS)
    g = torch.Generator().manual_seed(1)
    prompts = torch.zeros(n, P, dtype=torch.long)
    prompt_mask = torch.zeros(n, P, dtype=torch.long)
    for i, length in enumerate([6, 3, 4, 5, 2, 6, 4, 3]):
        prompts[i, P - length :] = torch.randint(3, 300, (length,), generator=g)
        prompt_mask[i, P - length :] = 1
    torch.manual_seed(2)
    out = model.generate(
        input_ids=prompts,
        attention_mask=prompt_mask,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        max_new_tokens=R,
        min_new_tokens=R,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    responses = out.sequences[:, P:].clone()
    logits = torch.stack(out.logits, 1).float() / T
    rollout_lp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    attn = torch.zeros(n, R, dtype=torch.long)
    for i, length in enumerate(RESPONSE_LEN):
        attn[i, :length] = 1
    responses[attn == 0] = 0
    rollout_lp[attn == 0] = 0.0
    loss_mask = attn.clone().float()
    loss_mask[[0, 4], 2] = 0.0  # observation tokens
    scores = torch.zeros(n, R)
    for i, rid in enumerate(ROLLOUTS):
        scores[i, RESPONSE_LEN[i] - 1] = REWARD[rid]
    attention = torch.cat([prompt_mask, attn], 1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
        "response_mask": loss_mask,
        "token_level_scores": scores,
        "rollout_log_probs": rollout_lp,
    }
    non_tensors = {"rollout_id_list": np.array(ROLLOUTS, dtype=object), "data_id_list": np.array(GROUPS, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


@pytest.fixture(scope="module")
def base() -> tuple[Qwen2ForCausalLM, DataProto]:
    model = tiny_qwen2()
    return model, sample_batch(model)


def prepared(model, data: DataProto, loss_mode: str = "per_rollout_mean") -> DataProto:
    """The trainer's chain: advantages (verl GRPO, rollout level) → normalisation → old logprobs
    at the sampling temperature, which travels in `meta_info` (as `run_update` sets it)."""
    out, _, _ = alg.prepare_update_batch(copy.deepcopy(data), mini_batch_rows=4, num_repeat=4, loss_mode=loss_mode)
    out.batch["old_log_probs"] = batch_log_probs(model, out, T, micro_batch_size=3)
    out.meta_info["temperature"] = T
    return out


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------------------------
# Log-probabilities
# ---------------------------------------------------------------------------------------------


def test_sequence_log_probs_match_sampling_logprobs(base):
    model, data = base
    b = data.batch
    with torch.no_grad():
        whole, ent = sequence_log_probs(
            model, b["input_ids"], b["attention_mask"], b["position_ids"], R, temperature=T, with_entropy=True
        )
        micro, _ = sequence_log_probs(
            model, b["input_ids"], b["attention_mask"], None, R, temperature=T, micro_batch_size=3
        )
        hot, _ = sequence_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], R)
    on = b["response_mask"].bool()
    assert whole.shape == (8, R) and ent.shape == (8, R)
    assert (whole - b["rollout_log_probs"])[on].abs().max() < 1e-5
    torch.testing.assert_close(micro, whole, atol=1e-6, rtol=0)
    assert (hot - whole)[on].abs().max() > 1e-2  # the temperature really divides the logits
    assert ((ent > 0) & (ent < np.log(300) + 1e-4))[on].all()


def test_old_log_probs_recomputed_and_in_bypass_mode(base):
    model, data = base
    d = copy.deepcopy(data)
    d.batch["old_log_probs"] = batch_log_probs(model, d, T, micro_batch_size=4)
    gap, m = logprob_gap(d), rollout_mismatch_metrics(d)
    assert gap["training/rollout_logprobs_diff_max"] < 1e-5 and gap["training/rollout_logprobs_diff_mean"] < 1e-6
    assert m["training/rollout_probs_diff_max"] < 1e-5 and m["training/rollout_probs_diff_valid"] == 1
    assert not any(k.startswith("training/rollout_logprobs_diff") for k in m)  # the log gap has one owner
    torch.testing.assert_close(sampling_log_probs(data), data.batch["rollout_log_probs"])
    missing = copy.deepcopy(data)
    missing.batch.pop("rollout_log_probs")
    with pytest.raises(RuntimeError, match="bypass_mode=true needs rollout_log_probs in the batch"):
        sampling_log_probs(missing)
    bad = copy.deepcopy(data)
    bad.batch["rollout_log_probs"][0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="bypass_mode needs finite rollout_log_probs everywhere"):
        sampling_log_probs(bad)


# ---------------------------------------------------------------------------------------------
# The update
# ---------------------------------------------------------------------------------------------


def test_ppo_update_moves_the_policy_along_the_advantages(base):
    model = copy.deepcopy(base[0])
    data = prepared(model, base[1])
    cfg = ActorUpdateConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, lr=1e-2)
    before = params(model)
    metrics = ppo_update(model, build_optimizer(model, cfg), data, cfg)
    assert not torch.equal(before, params(model))
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert metrics["actor/n_updates"] == 2 and metrics["actor/lr"] == 1e-2
    assert not [k for k in metrics if "*" in k or k == "entropy_sum"]  # accumulators stay internal (#12)
    assert metrics["training/rollout_probs_diff_max"] < 1e-5  # same model sampled the batch
    assert metrics["actor/entropy"] > 0 and metrics["actor/grad_norm"] > 0
    # the first mini-batch starts at ratio 1: the loss is −Σ Â (per_rollout_mean sums tokens)
    # and the policy moved towards positive-advantage tokens
    b = data.batch
    with torch.no_grad():
        after, _ = sequence_log_probs(model, b["input_ids"], b["attention_mask"], b["position_ids"], R, temperature=T)
    gain = ((after - b["old_log_probs"]) * b["rollout_advantages"] * b["response_mask"]).sum()
    assert gain > 0


@pytest.mark.parametrize(
    "loss_mode,agg,entropy_coeff",
    [
        ("per_rollout_mean", "token-mean", 0.0),
        ("vanilla", "token-mean", 0.01),
        ("vanilla", "seq-mean-token-mean", 0.0),
    ],
)
def test_grad_accumulation_equals_one_big_batch(base, loss_mode, agg, entropy_coeff):
    data = prepared(base[0], base[1], loss_mode=loss_mode)
    # old logprobs off the current policy, so ratios leave the clip range and clipping is exercised
    g = torch.Generator().manual_seed(3)
    data.batch["old_log_probs"] = data.batch["old_log_probs"] + 0.4 * torch.randn(8, R, generator=g)
    results = []
    for micro in (1, 4):
        model = copy.deepcopy(base[0])
        cfg = ActorUpdateConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=micro,
            loss_mode=loss_mode,
            loss_agg_mode=agg,
            entropy_coeff=entropy_coeff,
            grad_clip=None,
        )
        # SGD: the parameter change is the gradient itself (Adam's first step would hide its scale)
        metrics = ppo_update(model, torch.optim.SGD(model.parameters(), lr=1.0), data, cfg)
        results.append((params(model), metrics))
    (p1, m1), (p4, m4) = results
    moved = (p4 - params(base[0])).abs().max()
    assert moved > 1e-3
    torch.testing.assert_close(p1, p4, atol=1e-6, rtol=0)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key
    assert m4["actor/pg_clipfrac"] > 0


def four_groups(data: DataProto, order: list[str]) -> DataProto:
    """16 rows, 4 groups: g0, g1 as sampled (non-zero advantages), g2 all reward 1 and g3 all
    reward 0 (advantage exactly 0), the groups in `order`."""
    twin = copy.deepcopy(data)
    twin.non_tensor_batch["rollout_id_list"] = np.array([f"{r}b" for r in ROLLOUTS], dtype=object)
    twin.non_tensor_batch["data_id_list"] = np.array(["g2"] * 4 + ["g3"] * 4, dtype=object)
    scores = twin.batch["token_level_scores"]
    for i, length in enumerate(RESPONSE_LEN):
        scores[i, length - 1] = 1.0 if i < 4 else 0.0
    both = DataProto.concat([copy.deepcopy(data), twin])
    rows = {g: [i for i, d in enumerate(both.non_tensor_batch["data_id_list"]) if d == g] for g in order}
    return both.select_idxs(np.array([i for g in order for i in rows[g]]))


@pytest.mark.parametrize(
    "order,mini,micro,skipped,skipped_micro",
    [
        (["g2", "g0", "g3", "g1"], 16, 2, 8, 4),  # zero groups interleaved: regrouped, 4 micro-batches skipped
        (["g2", "g3", "g0", "g1"], 8, 4, 8, 2),  # the first mini-batch all zero: zero-filled AdamW step
        (["g0", "g2", "g1", "g3"], 16, 3, 7, 3),  # micro-batches of 3: rows 6-8 mix signal and zero
    ],
)
def test_zero_advantage_skip_is_exact(base, order, mini, micro, skipped, skipped_micro):
    """Skipping micro-batches of zero-advantage rows changes no gradient and no weight, bit for
    bit, with the per-rollout normalisation (D counts every rollout, zero groups too)."""
    data, _, _ = alg.prepare_update_batch(four_groups(base[1], order), mini_batch_rows=4, num_repeat=4)
    assert len(data) == 16  # nothing dropped: the zero groups stay in the batch and its divisor
    zero = (data.batch["advantages"] == 0).all(-1)
    assert int(zero.sum()) == 8 and not (data.batch["advantages"][~zero] == 0).all()
    data.batch["old_log_probs"] = batch_log_probs(base[0], data, T)
    g = torch.Generator().manual_seed(3)
    data.batch["old_log_probs"] += 0.3 * torch.randn(16, R, generator=g)  # ratios off 1: clipping too
    data.meta_info["temperature"] = T
    runs = {}
    for skip in (False, True):
        model = copy.deepcopy(base[0])
        cfg = ActorUpdateConfig(
            ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro, lr=1e-2, skip_zero_advantage=skip
        )
        metrics = ppo_update(model, build_optimizer(model, cfg), data, cfg)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])  # the last mini-batch's
        runs[skip] = (params(model), grads, metrics)
    (p_off, g_off, m_off), (p_on, g_on, m_on) = runs[False], runs[True]
    assert torch.equal(g_on, g_off) and torch.equal(p_on, p_off)
    assert not torch.equal(p_on, params(base[0]))
    assert m_on["actor/pg_loss"] == m_off["actor/pg_loss"] and m_on["actor/grad_norm"] == m_off["actor/grad_norm"]
    assert m_on["actor/rows_by_length"] == m_off["actor/rows_by_length"]  # one row order, skip on or off
    assert m_on["actor/skipped_zero_adv_rows"] == skipped and m_off["actor/skipped_zero_adv_rows"] == 0
    assert m_on["actor/diagnostic_rows"] == 16 - skipped and m_off["actor/diagnostic_rows"] == 16
    assert m_on["actor/skipped_zero_adv_micro_batches"] == skipped_micro
    assert (m_on["actor/zero_adv_skip_active"], m_off["actor/zero_adv_skip_active"]) == (1.0, 0.0)
    assert np.isfinite(m_on["actor/entropy"]) and np.isfinite(m_on["actor/pg_clipfrac"])


def test_zero_advantage_skip_only_where_exact(base):
    """An entropy bonus or a KL loss is non-zero for zero-advantage rows: the skip stays off."""
    data = prepared(base[0], base[1])
    data.batch["advantages"][:4] = 0.0
    for kwargs, blocker in (
        (dict(entropy_coeff=0.01), "entropy_coeff"),
        (dict(use_kl_loss=True), "use_kl_loss"),
        (dict(loss_mode="gspo"), "loss_mode=gspo"),
    ):
        cfg = ActorUpdateConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, **kwargs)
        assert not cfg.zero_skip_active and blocker in cfg.zero_skip_blocker()
    model = copy.deepcopy(base[0])
    cfg = ActorUpdateConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01)
    metrics = ppo_update(model, build_optimizer(model, cfg), data, cfg)
    assert metrics["actor/skipped_zero_adv_rows"] == 0 and metrics["actor/zero_adv_skip_active"] == 0


def test_kl_loss_against_a_frozen_reference(base):
    model = copy.deepcopy(base[0])
    ref = copy.deepcopy(base[0])
    data = prepared(model, base[1])
    cfg = ActorUpdateConfig(ppo_epochs=2, ppo_mini_batch_size=8, use_kl_loss=True, kl_loss_coef=0.1, lr=1e-2)
    metrics = ppo_update(model, build_optimizer(model, cfg), data, cfg, ref_model=ref)
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/kl_coef"] == 0.1  # epoch 2 has moved from ref
    assert metrics["actor/n_updates"] == 2
    with pytest.raises(ValueError, match="use_kl_loss=true needs ref_log_prob"):
        ppo_update(model, build_optimizer(model, cfg), prepared(model, base[1]), cfg)


def test_ppo_update_errors_name_the_fix(base):
    model = copy.deepcopy(base[0])
    cfg = ActorUpdateConfig(ppo_mini_batch_size=4)
    data, _, _ = alg.prepare_update_batch(copy.deepcopy(base[1]), mini_batch_rows=4, num_repeat=4)
    with pytest.raises(KeyError, match="Engine.prepare"):
        ppo_update(model, build_optimizer(model, cfg), data, cfg)
    data = prepared(model, base[1])
    del data.meta_info["temperature"]
    with pytest.raises(KeyError, match=r"meta_info\['temperature'\].*run_update sets it"):
        ppo_update(model, build_optimizer(model, cfg), data, cfg)
    data.meta_info["temperature"] = 0.0
    with pytest.raises(ValueError, match="must be > 0 .*actor_rollout_ref.rollout.temperature"):
        ppo_update(model, build_optimizer(model, cfg), data, cfg)
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.loss_agg_mode"):
        ActorUpdateConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        ppo_update(
            model,
            build_optimizer(model, cfg),
            prepared(model, base[1]),
            ActorUpdateConfig(ppo_mini_batch_size=4, loss_mode="nope"),
        )


def test_plan_forwards_puts_zero_rows_last_and_skips_only_their_micro_batches():
    """6 rows, micro-batches of 2: rows 1 and 3 carry a signal (row 5's advantage sits on a masked
    token: no signal), so the order is 1, 3, 0, 2, 4, 5 and only the first micro-batch is forwarded."""
    adv = torch.zeros(6, 3)
    adv[1, 0], adv[3, 2], adv[5, 1] = 0.5, -0.25, 1.0
    mask = torch.ones(6, 3)
    mask[5, 1] = 0.0
    mb = {"advantages": adv, "response_mask": mask, "input_ids": torch.arange(6).unsqueeze(1)}
    ordered, starts = zero_skip.plan_forwards(mb, 2, skip=True)
    assert ordered["input_ids"].flatten().tolist() == [1, 3, 0, 2, 4, 5] and starts == [0]
    ordered, starts = zero_skip.plan_forwards(mb, 2, skip=False)  # the same order, every micro-batch
    assert ordered["input_ids"].flatten().tolist() == [1, 3, 0, 2, 4, 5] and starts == [0, 2, 4]
    ordered, starts = zero_skip.plan_forwards(mb, 6, skip=True)  # one micro-batch: the order is kept
    assert ordered["input_ids"].flatten().tolist() == list(range(6)) and starts == [0]
    # by attended length, shortest first within each part: signal rows 3 (2 tokens), 1 (4); zero rows 4 (1),
    # 5 (2), 0 (3), 2 (3: after 0, stable)
    mb["attention_mask"] = torch.tensor(
        [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    )
    ordered, starts = zero_skip.plan_forwards(mb, 2, skip=True, by_length=True)
    assert ordered["input_ids"].flatten().tolist() == [3, 1, 4, 5, 0, 2] and starts == [0]


# ---------------------------------------------------------------------------------------------
# Config mapping
# ---------------------------------------------------------------------------------------------


def test_from_verl_actor_config_reads_verl_defaults():
    import verl

    path = Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml"
    actor = OmegaConf.load(path).actor_rollout_ref.actor
    cfg = ActorUpdateConfig.from_verl_actor_config(actor, rollout_n=4)
    assert cfg.ppo_mini_batch_size == 256 * 4 and cfg.ppo_epochs == 1 and cfg.loss_mode == "vanilla"
    assert (cfg.clip_ratio, cfg.clip_ratio_c, cfg.grad_clip, cfg.lr) == (0.2, 3.0, 1.0, 1e-6)
    assert cfg.kl_loss_type == "low_var_kl" and cfg.loss_agg_mode == "token-mean"
    assert "rollout_correction" not in cfg.policy_loss_options and "_target_" not in cfg.policy_loss_options
    verl_cfg = cfg.to_verl_actor_config()
    assert verl_cfg.policy_loss.loss_mode == "vanilla" and verl_cfg.ppo_micro_batch_size_per_gpu == 1024
    agl = {
        "ppo_mini_batch_size": 2,
        "ppo_micro_batch_size_per_gpu": 1,
        "clip_ratio_high": 0.28,
        "policy_loss": {"loss_mode": "per_rollout_mean"},
        "optim": {"lr": 3e-4, "clip_grad": 0.5},
    }
    cfg = ActorUpdateConfig.from_verl_actor_config(agl, rollout_n=4)
    assert (cfg.ppo_mini_batch_size, cfg.micro_batch_rows, cfg.loss_mode) == (8, 1, "per_rollout_mean")
    assert (cfg.clip_ratio_high, cfg.lr, cfg.grad_clip) == (0.28, 3e-4, 0.5)
    with pytest.raises(ValueError, match="policy_loss has unknown keys"):
        ActorUpdateConfig(policy_loss_options={"bogus": 1}).to_verl_actor_config()
