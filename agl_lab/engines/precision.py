"""Mixed precision on the CPU: float32 weights, bfloat16 matrix products (`agl_lab.model.compute_dtype`).

    agl_lab.model.compute_dtype: null        # null or float32: every product in float32 (the default)
    agl_lab.model.compute_dtype: bfloat16    # the products in bfloat16, everything else float32

This machine's CPUs have AVX-512 BF16: a bfloat16 matrix product runs ~2× a float32 one (oneDNN,
measured for the decode step's and the update's shapes, `benchmarks/precision.py`). With
`bfloat16` the weights, the optimizer's state, the norms, the softmax and the loss stay float32;
only the products drop to bfloat16 inputs (accumulating in float32):

* the decode loop (`fast_decode`) packs a bfloat16 copy of each linear weight once per weight
  version (as it packs float32 ones) and casts each product's input to bfloat16, its output back;
* HF's forward (the trainer's: `local_ppo._response_forward`, `shared_prefix` — the update, the old
  and reference logprobs; the engine's prefill where it does not run `fast_decode.forward`) runs
  inside `autocast(model)`. Where the base weights are frozen (LoRA, a reference copy) that is the
  decode loop's function: each linear layer reads a bfloat16 copy of its weight (a LoRA layer of
  its merged weight), kept once per weight version, and casts its input to bfloat16 and its output
  back (`Bf16Product`; the gradient to the input likewise); norms, RoPE, attention, the softmax and
  the adapter's rank-r gradients stay float32. Where the base weights train (a full fine-tune) it
  is `torch.autocast("cpu", bfloat16)`, which casts each trainable weight at each use. The cached
  K/V are float32 either way.

The price is exactness: the engine's sampling logprobs and the trainer's are no longer the same
bits. The copies make the products the engine's (equal on the tiny model), but the float32 ops
between them are other kernels, and a last-bit difference that rounds an input to the other
bfloat16 grows layer by layer on a trained model's activations: up to 0.18–0.25 a step on SmolLM2
`calc` with LoRA, as under autocast (float32: ~3e-5; docs/benchmarks.md).
`training/rollout_logprobs_diff_*` shows the gap (with `bypass_mode` off: under bypass nothing is
recomputed); the rollout correction keys (`algorithm.rollout_correction`) correct for it.

The setting travels with the module (`set_compute_dtype`: an attribute, so the engine's serving
copy and reference copy — deep copies — keep it). On a GPU the weights themselves are bfloat16
and the key has no effect (the engine warns).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from types import MethodType
from typing import Any

import torch

from agl_lab.rules import check_compute_dtype

KEY = "agl_lab.model.compute_dtype"
_ATTR = "agl_compute_dtype"  # on the module: deep copies (serving, reference) inherit it
_local = threading.local()  # `copies`: inside `autocast` of a frozen-base model, on this thread


def parse(value: Any) -> torch.dtype | None:
    """The key's value (a name, or a torch dtype) → torch dtype (None for null); a ValueError
    naming the key otherwise (`rules.check_compute_dtype`, the config's own check)."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    name = check_compute_dtype(value)
    return None if name is None else getattr(torch, name)


def set_compute_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Run `model`'s matrix products in `dtype` (None: in its weights' dtype)."""
    setattr(model, _ATTR, dtype)


def compute_dtype(model: Any) -> torch.dtype:
    """The dtype `model`'s matrix products run in: the setting, else the weights' dtype."""
    weights = next(model.parameters()).dtype
    return getattr(model, _ATTR, None) or weights


def mixed(model: Any) -> bool:
    """True when the products run in bfloat16 over float32 CPU weights."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.float32 and compute_dtype(model) == torch.bfloat16


def use_weight_copies(model: torch.nn.Module, on: bool) -> None:
    """Whether `autocast(model)` may read bfloat16 weight copies (the default) or always runs
    `torch.autocast` — the comparison `benchmarks/lora_update.py` draws."""
    model._agl_no_bf16_copies = not on


def autocast(model: Any) -> contextlib.AbstractContextManager:
    """The context a forward of `model` runs in (its backward follows the forward's choices): when
    `mixed`, the bfloat16 copies for a model whose base weights are frozen, else bfloat16 autocast."""
    if not mixed(model):
        return contextlib.nullcontext()
    frozen = getattr(model, "_agl_lora", False) or not any(p.requires_grad for p in model.parameters())
    if frozen and not getattr(model, "_agl_no_bf16_copies", False):
        return _bf16_copies(model)
    return torch.autocast("cpu", dtype=torch.bfloat16)


def copies() -> bool:
    """True inside `autocast(model)` of a frozen-base model: products read bfloat16 weight copies."""
    return getattr(_local, "copies", False)


@contextlib.contextmanager
def _bf16_copies(model: torch.nn.Module):
    for m in model.modules():  # bound once per module (deep copies keep the binding)
        if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__:
            m.forward = MethodType(_linear_forward, m)
    before, _local.copies = copies(), True
    try:
        yield
    finally:
        _local.copies, _local.cast = before, None


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward; inside the bfloat16 copies, a frozen layer's product from its copy."""
    w, bias = self.weight, self.bias
    if copies() and x.dtype == w.dtype == torch.float32 and not w.requires_grad:
        if bias is None or not bias.requires_grad:
            return Bf16Product.apply(x, bf16_copy(self, w), bias)
    return torch.nn.functional.linear(x, w, bias)


def bf16_copy(owner: Any, weight: torch.Tensor) -> torch.Tensor:
    """`weight` in bfloat16, cached on `owner` until `weight` is another tensor or changed in place
    (its version counter). The cache refers to `weight` weakly: a LoRA layer's merged weight of the
    last version is freed when the layer merges the next one, not kept alive by its copy."""
    cached = getattr(owner, "_agl_bf16", None)
    if cached is None or cached[0]() is not weight or cached[1] != weight._version:
        with torch.inference_mode(False), torch.no_grad():
            cached = (weakref.ref(weight), weight._version, weight.detach().to(torch.bfloat16))
        owner._agl_bf16 = cached
    return cached[2]


def bf16_linear(x: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] float32 @ `low`ᵀ ([out, in] bfloat16) → [..., out] float32: the input rounded to
    bfloat16, the product accumulated in float32 and rounded to bfloat16, the bias added in float32
    (as `fast_decode.packed_product` with `mixed`)."""
    out = torch.nn.functional.linear(_low_input(x, low.dtype), low).float()
    return out if bias is None else out + bias


def bf16_input_grad(dy: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The input's gradient of `bf16_linear`: dy [..., out] float32 rounded to bfloat16, @ `low`
    ([out, in] bfloat16) → dx [..., in] float32."""
    return (dy.to(low.dtype) @ low).float()


def _low_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, the last cast kept for the next product of the same input (q, k and v of
    one layer read one normed input, gate and up another: one cast each, not three and two)."""
    version = None if x.is_inference() else x._version  # inference tensors keep no version
    last = getattr(_local, "cast", None)
    if last is not None and last[0] is x and last[1] == version and last[2].dtype == dtype:
        return last[2]
    low = x.to(dtype)
    _local.cast = (x, version, low)
    return low


class Bf16Product(torch.autograd.Function):
    """y = `bf16_linear`(x, low, bias) for a frozen weight; dx = bfloat16(dy) @ low in float32.

    x [..., in] float32, low [out, in] bfloat16, bias [out] | None → y [..., out] float32."""

    @staticmethod
    def forward(ctx, x, low, bias):
        ctx.save_for_backward(low)
        return bf16_linear(x, low, bias)

    @staticmethod
    def backward(ctx, dy):
        (low,) = ctx.saved_tensors
        return bf16_input_grad(dy, low), None, None
