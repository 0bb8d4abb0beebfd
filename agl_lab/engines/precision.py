"""Mixed precision on the CPU: float32 weights, bfloat16 matrix products (`agl_lab.model.compute_dtype`).

    agl_lab.model.compute_dtype: null        # null or float32: every product in float32 (the default)
    agl_lab.model.compute_dtype: bfloat16    # the products in bfloat16, everything else float32

This machine's CPUs have AVX-512 BF16: a bfloat16 matrix product runs ~2× a float32 one (oneDNN,
measured for the decode step's and the update's shapes, `benchmarks/precision.py`). With
`bfloat16` the weights, the optimizer's state, the norms, the softmax and the loss stay float32;
only the products drop to bfloat16 inputs (accumulating in float32):

* the decode loop (`fast_decode`) packs a bfloat16 copy of each linear weight once per weight
  version (as it packs float32 ones) and casts each product's input to bfloat16, its output back;
* the prompts' prefill (HF's forward, `DecodeBatch.prefill`) and the trainer's forward and backward
  (`local_ppo._response_forward`, `shared_prefix`: the update, the old and reference logprobs) run
  under `torch.autocast("cpu", bfloat16)`; the prefill's K/V are cached in float32 for the decode.

The price is exactness: the engine's sampling logprobs and the trainer's differ by up to 0.2–0.3 a
step on SmolLM2 `calc` (float32: ~3e-5), since the two sides run different bfloat16 functions.
`training/rollout_logprobs_diff_*` shows the gap (with `bypass_mode` off: under bypass nothing is
recomputed); the rollout correction keys (`algorithm.rollout_correction`) correct for it.

The setting travels with the module (`set_compute_dtype`: an attribute, so the engine's serving
copy and reference copy — deep copies — keep it). On a GPU the weights themselves are bfloat16
and the key has no effect (the engine warns).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from agl_lab.rules import check_compute_dtype

KEY = "agl_lab.model.compute_dtype"
_ATTR = "agl_compute_dtype"  # on the module: deep copies (serving, reference) inherit it


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


def autocast(model: Any) -> contextlib.AbstractContextManager:
    """The context a forward (and its backward) of `model` runs in: bfloat16 autocast when `mixed`."""
    if mixed(model):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
