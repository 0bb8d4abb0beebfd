"""LoRA on the local engine (agl_lab/engines/lora.py): verl's keys, PEFT's adapter, served as trained.

What a user relies on:
- only the adapter trains (the base weights stay bit-equal), and the optimizer holds only it;
- the server samples from base + adapter: after an update its logprobs equal the recomputation
  (the on-policy check the trainer reports as the logprob gap), through the fast decode path;
- the checkpoint is a base model dir + a PEFT adapter that PEFT itself loads to the same logits,
  and an engine resumes from it exactly; `lora_adapter_path` starts from such an adapter;
- each weight version is merged once, before serving resumes (at start and in sync_weights), never
  again in the decode steps of a phase on unchanged weights (#51: the merge stalled the first phase);
- bad LoRA keys fail naming the key.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from agl_lab.config import ConfigError
from agl_lab.engines import lora
from agl_lab.engines.local import LocalEngine
from agl_lab.engines.lora import LoraSpec, adapted_layers, effective_weight, merge_all, merge_count, merged_state_dict
from agl_lab.engines.serving import fast_decode
from tests.replica_probe import calls_to_batch, sample_calls

ACTOR = {"ppo_mini_batch_size": 64, "loss_mode": "vanilla", "lr": 5e-2}


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine(device="cpu", actor=ACTOR, lora={"lora_rank": 4, "lora_alpha": 8})
    yield eng
    eng.close()


def _update(engine: LocalEngine) -> tuple:
    calls = sample_calls(engine, 1.0)
    data = calls_to_batch(calls, engine.tokenizer.pad_token_id)
    data.batch["old_log_probs"] = engine.compute_log_probs(data, 1.0)
    data.batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.batch["response_mask"].float()
    metrics = engine.update(data)
    engine.sync_weights()
    return data, metrics


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(engine):
    assert fast_decode.supports(engine.model)  # the module keeps its class: the fast path still serves it
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every projection of every layer, not the LM head (PEFT's rule, verl's default)
    assert len(trainable) == 2 * 7 * engine.model.config.num_hidden_layers
    assert engine.lora_params["trainable"] == sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    n_opt = sum(p.numel() for group in engine.optimizer.param_groups for p in group["params"])
    assert n_opt == engine.lora_params["trainable"] < engine.lora_params["total"] / 5
    base_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}
    _, metrics = _update(engine)
    assert metrics["actor/grad_norm"] > 0
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base_before.items())
    assert any(not torch.equal(params[n], v) for n, v in lora_before.items())


def test_the_server_samples_from_base_plus_adapter_after_an_update(engine):
    _update(engine)  # B is no longer zero: the adapter changes the function
    proj = engine.model.model.layers[0].self_attn.q_proj
    assert not torch.equal(effective_weight(proj), proj.base_layer.weight)
    fresh = sample_calls(engine, 1.0, n=3)
    batch = calls_to_batch(fresh, engine.tokenizer.pad_token_id)
    recomputed = engine.compute_log_probs(batch, 1.0)  # HF's forward through PEFT's layers
    mask = batch.batch["response_mask"].bool()
    gap = (recomputed - batch.batch["rollout_log_probs"]).abs()[mask].max().item()
    assert gap < 1e-4
    # …and the adapter matters: the base alone scores these tokens differently
    with _adapters_off(engine.model):
        base_only = engine.compute_log_probs(batch, 1.0)
    assert (base_only - recomputed).abs()[mask].max().item() > 10 * max(gap, 1e-6)


def test_each_weight_version_is_merged_once_before_serving_resumes(engine):
    layers = len(adapted_layers(engine.model))
    assert layers == 7 * engine.model.config.num_hidden_layers
    assert merge_all(engine.model) == 0  # the engine's start merged them: nothing left for a decode step
    _update(engine)  # an optimizer step moves A and B; sync_weights merges the new version
    assert merge_all(engine.model) == 0
    merged = merge_count(engine.model)
    sample_calls(engine, 1.0)  # two phases on unchanged weights, through the fast decode path
    sample_calls(engine, 1.0)
    assert merge_count(engine.model) == merged
    _update(engine)
    assert merge_count(engine.model) == merged + layers  # one merge per projection for the next version


class _adapters_off:
    """Context: every LoRA layer of an injected model skips its adapter (PEFT's `disable_adapters`)."""

    def __init__(self, model):
        self.layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "disable_adapters")]

    def __enter__(self):
        for m in self.layers:
            m.enable_adapters(False)

    def __exit__(self, *exc):
        for m in self.layers:
            m.enable_adapters(True)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (torch.log_softmax(logits.float(), -1)[..., 7].mean() * 1000).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "with-bias"])
def test_the_training_forward_is_peft_s_function_through_the_merged_weight(engine, bias):
    """The update's forward reads the merged W + s·B@A the engine decodes with (one product, #51);
    its logits and its gradients for every A and B equal PEFT's unmerged layer's, to float32 rounding."""
    import copy

    model = copy.deepcopy(engine.model)
    torch.manual_seed(3)
    with torch.no_grad():
        for proj in adapted_layers(model):  # a trained adapter: B non-zero, so both gradients matter
            proj.lora_B["default"].weight.normal_(0, 0.05)
            if bias and proj.base_layer.bias is None:
                proj.base_layer.bias = torch.nn.Parameter(torch.randn(proj.out_features) * 0.1, requires_grad=False)
    ids = torch.randint(0, model.config.vocab_size, (3, 21))
    peft = copy.deepcopy(model)
    for proj in adapted_layers(peft):
        del proj.forward  # PEFT's own layer: W x + s · B(A(x)), as verl's FSDP engine runs it
    calls = []
    real = lora._MergedProduct.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora._MergedProduct, "apply", lambda *a: calls.append(1) or real(*a))
        merged_logits, merged_grads = _loss_and_grads(model, ids)
        assert len(calls) == len(adapted_layers(model))  # every adapted projection ran the merged product
        peft_logits, peft_grads = _loss_and_grads(peft, ids)
        assert len(calls) == len(adapted_layers(model))
    assert (merged_logits - peft_logits).abs().max() < 1e-4
    for name, g in peft_grads.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(merged_grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item()), name
    # …and PEFT's forward still runs where the merged product does not hold: adapters switched off
    with _adapters_off(model), torch.no_grad():
        base_only = model(input_ids=ids).logits
    assert (base_only - peft_logits).abs().max() > 1e-3


def test_checkpoint_is_a_base_dir_plus_a_peft_adapter_and_resumes_exactly(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with LocalEngine(device="cpu", actor=ACTOR, lora={"lora_rank": 4}) as eng:
        data, _ = _update(eng)
        eng.save(str(tmp_path / "ckpt"))
        saved = {k: v.clone() for k, v in eng.model.state_dict().items()}
        logp = eng.compute_log_probs(data)
        merged = merged_state_dict(eng.model)
        _update(eng)  # move away
        eng.load(str(tmp_path / "ckpt"))
        assert eng.policy_version == 1
        assert all(torch.equal(saved[k], v) for k, v in eng.model.state_dict().items())
        assert torch.equal(eng.compute_log_probs(data), logp)
    # PEFT itself reads the pair: same logits as the engine's
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "ckpt" / "lora_adapter").eval()
    ids = data.batch["input_ids"][:1]
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
        plain.load_state_dict(merged)
        merged_logits = plain(input_ids=ids).logits
    assert torch.allclose(theirs, merged_logits, atol=1e-5)
    # lora_adapter_path (verl's key) starts a new engine from the adapter: the same function
    cfg = {"lora_rank": 0, "lora_adapter_path": str(tmp_path / "ckpt" / "lora_adapter")}
    with LocalEngine(str(tmp_path / "ckpt"), device="cpu", lora=cfg) as again:
        assert again.lora.rank == 0 and again.lora_params is not None  # the adapter's own rank (4) applies
        assert torch.allclose(again.compute_log_probs(data), logp, atol=1e-6)


def test_from_config_reads_verls_keys_and_bad_values_name_the_key():
    spec = LoraSpec.from_model_config(
        OmegaConf.create({"lora_rank": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]})
    )
    assert (spec.rank, spec.alpha, spec.target_modules, spec.enabled) == (8, 32, ["q_proj", "v_proj"], True)
    assert not LoraSpec.from_model_config({"lora_rank": 0}).enabled
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.lora_rank must be an integer ≥ 0"):
        LoraSpec.from_model_config({"lora_rank": -1})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.target_modules"):
        LoraSpec.from_model_config({"lora_rank": 4, "target_modules": 3})
    with pytest.raises(ConfigError, match=r"target_modules=\['qkv'\] selects no layer.*q_proj"):
        LocalEngine(device="cpu", lora={"lora_rank": 4, "target_modules": ["qkv"]})
    with pytest.raises(ConfigError, match=r"lora_adapter_path=.*no adapter_config.json"):
        LocalEngine(device="cpu", lora={"lora_adapter_path": "/nonexistent"})
