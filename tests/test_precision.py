"""`agl_lab.model.compute_dtype=bfloat16` (agl_lab/engines/precision.py): bfloat16 matrix products
over float32 weights, in the decode loop and in the update — near the float32 numbers, not equal."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from agl_lab.config import ConfigError, load_config
from agl_lab.config_keys import ConfigWarning
from agl_lab.engines import precision
from agl_lab.engines.local import _set_compute_dtype
from agl_lab.engines.local_ppo import _response_forward
from agl_lab.engines.lora import LoraSpec, add_lora, effective_weight
from agl_lab.engines.serving import fast_decode
from agl_lab.engines.serving.decode_batch import DecodeBatch
from agl_lab.engines.tiny import load_model_and_tokenizer
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer(None, device="cpu")
    return model, tokenizer


@pytest.mark.parametrize("value", ["float16", "bf16", "int8"])
def test_a_bad_compute_dtype_fails_at_load_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"agl_lab\.model\.compute_dtype='{value}' is not one of null, float32"):
        load_config(None, [f"agl_lab.model.compute_dtype={value}"])


def test_the_engine_reads_the_key_with_the_config_s_own_check():
    assert precision.parse(None) is None and precision.parse("float32") is torch.float32
    assert precision.parse("bfloat16") is torch.bfloat16 and precision.parse(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match=r"agl_lab\.model\.compute_dtype='float16' is not one of null, float32"):
        precision.parse("float16")


def _prefill_and_decode(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of `prompt`: the prefill's and one `fast_decode` step's logprobs, [3, V] each.
    The cached K/V are float32 whatever the products' precision (the decode reads them as such)."""
    with torch.inference_mode():
        batch, logits = DecodeBatch.prefill(model, [prompt] * 3, [1.0] * 3, [1.0] * 3, [False] * 3, pad_id=0)
        assert logits.dtype == torch.float32
        assert all(layer.keys.dtype == layer.values.dtype == torch.float32 for layer in batch.layers)
        batch.tokens = logits.argmax(-1)
        return logits.log_softmax(-1), batch.decode(model).log_softmax(-1)


def _decode_logprobs(model, prompt: list[int]) -> torch.Tensor:
    return _prefill_and_decode(model, prompt)[1]


def _hf_logprobs(model, prompt: list[int], token: int) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prompt, token]])).logits[0, -1]
    return logits.float().log_softmax(-1)


def test_the_decode_step_in_bfloat16_is_near_the_float32_one_and_not_equal(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("The capital of the tiny model's country is").input_ids
    try:
        precision.set_compute_dtype(model, None)
        plain_prefill, plain = _prefill_and_decode(model, prompt)
        reference = _hf_logprobs(model, prompt, int(plain[0].argmax()))  # float32 HF forward
        precision.set_compute_dtype(model, torch.bfloat16)
        assert precision.mixed(model) and fast_decode.invariance_gap(model).startswith(precision.KEY)
        mixed_prefill, mixed = _prefill_and_decode(model, prompt)  # packed copies rebuilt for the setting
    finally:
        precision.set_compute_dtype(model, None)
    assert (plain[0] - reference).abs().max() < 1e-4
    # the products really ran in bfloat16 (the prefill under autocast, the decode from packed copies)
    assert 1e-4 < (mixed_prefill - plain_prefill).abs().max() < 0.1
    assert 1e-4 < (mixed - plain).abs().max() < 0.1
    assert torch.equal(_decode_logprobs(model, prompt), plain)  # back to float32: the float32 bits again


def test_the_trainer_forward_runs_its_products_in_bfloat16_and_keeps_float32_gradients(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer("a b c d e f g h").input_ids])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    seen: list[torch.dtype] = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        for dtype in (None, torch.bfloat16):
            precision.set_compute_dtype(model, dtype)
            model.zero_grad()
            logprobs, _ = _response_forward(model, ids, mask, positions, 4, 1.0, "none")
            assert logprobs.dtype == torch.float32
            logprobs.sum().backward()
            grad = model.model.layers[0].mlp.down_proj.weight.grad
            assert grad is not None and grad.dtype == torch.float32
    finally:
        hook.remove()
        precision.set_compute_dtype(model, None)
        model.zero_grad()
    assert seen == [torch.float32, torch.bfloat16]


def _lora_model(rank: int = 8):
    model, tokenizer = load_model_and_tokenizer(None, device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        add_lora(model, LoraSpec(rank=rank, alpha=2 * rank))
        for p in model.parameters():
            if p.requires_grad:  # B is zero at init: give the adapter something to say
                p.data.normal_(0, 0.05)
    return model, tokenizer


def test_a_lora_model_in_bfloat16_reads_bfloat16_copies_of_its_merged_weights_once_per_version():
    model, tokenizer = _lora_model()
    ids = torch.tensor([tokenizer("a b c d e f g h i j").input_ids])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    q_proj = model.model.layers[0].self_attn.q_proj
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = q_proj.register_forward_hook(lambda m, i, out: seen.append((i[0].detach(), out.detach())))
    grads = {}
    try:
        for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
            precision.set_compute_dtype(model, dtype)
            model.zero_grad()
            logprobs, _ = _response_forward(model, ids, mask, positions, 5, 1.0, "none")
            logprobs.sum().backward()
            grads[name] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        copy = q_proj._agl_bf16[2]
        merged = effective_weight(q_proj).detach().clone()
        assert torch.equal(copy, merged.to(torch.bfloat16))
        _response_forward(model, ids, mask, positions, 5, 1.0, "none")  # same weights: the same copy
        assert q_proj._agl_bf16[2] is copy
        with torch.inference_mode(), precision.autocast(model):  # the engine's HF prefill: inference tensors
            served = model(input_ids=ids).logits
        with torch.no_grad(), precision.autocast(model):
            assert torch.equal(served, model(input_ids=ids).logits)
        with torch.no_grad():
            q_proj.lora_B["default"].weight.add_(0.01)  # an optimizer step's in-place change
        _response_forward(model, ids, mask, positions, 5, 1.0, "none")
        assert q_proj._agl_bf16[2] is not copy
    finally:
        hook.remove()
        precision.set_compute_dtype(model, None)
    (x32, y32), (x16, y16) = seen[:2]
    assert y16.dtype == torch.float32  # attention, norms and RoPE stay float32 (no autocast)
    # the bfloat16 product of the bfloat16 merged weight, bit for bit, and not the float32 one
    assert torch.equal(y16, torch.nn.functional.linear(x16.to(torch.bfloat16), copy).float())
    assert 1e-4 < (y16 - torch.nn.functional.linear(x16, merged)).abs().max() < 0.1
    assert torch.allclose(y32, torch.nn.functional.linear(x32, merged), atol=1e-5)  # float32: float32's
    # the frozen LM head read its own copy; the adapter's gradients: float32, near float32's
    assert model.lm_head._agl_bf16[2].dtype == torch.bfloat16
    for g32, g16 in zip(grads["float32"], grads["bfloat16"], strict=True):
        assert g16.dtype == torch.float32
        assert 0 < (g16 - g32).norm() / g32.norm() < 0.1


def test_the_trainer_s_copies_score_a_prompt_as_the_engine_s_packed_bfloat16_products_do():
    """The engine's prefill and decode step (`fast_decode`, packed bfloat16 copies) against HF's forward
    in the trainer's context: with the copies nearer than autocast (on this tiny LoRA model, equal)."""
    model, tokenizer = _lora_model()
    prompt = tokenizer("The capital of the tiny model's country is a place where").input_ids
    try:
        precision.set_compute_dtype(model, torch.bfloat16)
        engine_prefill, engine_decode = _prefill_and_decode(model, prompt)
        token = int(engine_prefill[0].argmax())
        ids = torch.tensor([[*prompt, token]])
        with torch.no_grad(), precision.autocast(model):
            copies = model(input_ids=ids).logits[0, -2:].float().log_softmax(-1)
        precision.use_weight_copies(model, False)  # torch.autocast, as before the copies
        with torch.no_grad(), precision.autocast(model):
            autocast = model(input_ids=ids).logits[0, -2:].float().log_softmax(-1)
    finally:
        precision.set_compute_dtype(model, None)
        precision.use_weight_copies(model, True)
    engine = torch.stack([engine_prefill[0], engine_decode[0]])
    assert (autocast - engine).abs().max() > 1e-4  # autocast: bfloat16 attention, per-use weight casts
    assert (copies - engine).abs().max() <= (autocast - engine).abs().max() / 4


def test_a_frozen_reference_copy_reads_copies_and_a_full_fine_tune_keeps_autocast(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer("a b c d e f g h").input_ids])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    reference = copy.deepcopy(model).requires_grad_(False)
    try:
        for m in (model, reference):
            precision.set_compute_dtype(m, torch.bfloat16)
        with torch.no_grad():
            _response_forward(reference, ids, mask, positions, 4, 1.0, "none")
            _response_forward(model, ids, mask, positions, 4, 1.0, "none")
    finally:
        precision.set_compute_dtype(model, None)
    assert reference.lm_head._agl_bf16[2].dtype == torch.bfloat16  # the reference: copies
    assert not hasattr(model.lm_head, "_agl_bf16")  # trainable weights: autocast, no copy
    assert not precision.copies()  # the thread left the copies behind


def test_the_key_warns_where_the_weights_are_not_float32_on_the_cpu():
    model, _ = load_model_and_tokenizer(None, device="cpu", dtype="bfloat16")
    with pytest.warns(ConfigWarning, match=r"agl_lab\.model\.compute_dtype=bfloat16 has no effect: .* bfloat16 on cpu"):
        _set_compute_dtype(model, "bfloat16")
    assert not precision.mixed(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _set_compute_dtype(model, None)  # null: nothing to warn about


def test_a_trainer_step_in_bfloat16_trains_and_shows_the_logprob_gap(tmp_path):
    overrides = [*SMALL, "agl_lab.model.compute_dtype=bfloat16"]
    with Trainer.from_config("configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path, console=False) as trainer:
        assert precision.mixed(trainer.engine.model) and precision.mixed(trainer.engine.serving_model)
        trainer.rollout()
        trainer.build_batch()
        update = trainer.update()
    assert not update.skipped and update.policy_version == 1
    # float32 on both sides gives < 1e-4 (tests/test_trainer.py); bfloat16 products do not
    assert 1e-4 < update.metrics["training/rollout_logprobs_diff_max"] < 1.0
