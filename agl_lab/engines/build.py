"""The engine a config asks for: `agl_lab.engine` = local | verl, with the tiny model's warm start.

    build_engine(cfg, task=…, train_dataset=…, val_dataset=…) -> Engine

- `local`: `LocalEngine.from_config(cfg)`; with the built-in tiny model (no `agl_lab.model.path`
  or preset) and a task with demonstrations, the model is first fitted for
  `agl_lab.model.warm_start_steps` steps on them (`agl_lab.engines.warmstart`), so the first
  rollouts parse.
- `verl`: verl's workers load weights from disk, so the tiny model is warm-started into a cached
  directory first (`warm_started_model_dir`) and `agl_lab.model.path` points at it.

Before either, `apply_torch_threads` sizes torch's intra-op pool from `agl_lab.torch_threads`
(`auto`: 1 thread on a machine with ≤ 4 cores, else half the cores; a number; null: torch's own
default, one thread per core). On a shared 2-core machine torch's default collapses: the warm
start ran 5–11× slower with 2 threads than with 1 (docs/benchmarks.md, "Torch threads"). The
local engine's decode loop then uses the same count: it never runs beside an update (both hold
the weights lock), and SmolLM2's decode batch of 16 ran 1.5× faster on 2 threads than on 1.

The caller owns the engine and closes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from agl_lab.engines.base import Engine
from agl_lab.engines.lora import LoraSpec

logger = logging.getLogger(__name__)


def build_engine(
    cfg: Any, *, task: Any = None, train_dataset: Sequence[dict] = (), val_dataset: Sequence[dict] = ()
) -> Engine:
    """The engine of `cfg.agl_lab.engine`, its model warm-started where that applies; agl_lab's
    `per_rollout_mean` loss registered in verl's registry first (both engines look it up there)."""
    from agl_lab.algorithms.loss import register_loss

    register_loss()
    lab = cfg.agl_lab
    threads = apply_torch_threads(lab.get("torch_threads", "auto"))
    steps = int(lab.model.warm_start_steps) if task is not None else 0
    if lab.engine == "verl":
        from agl_lab.engines.verl.engine import VerlEngine

        if lab.model.path is None:  # verl's workers load from disk: the tiny model, warm-started like local's
            _use_warm_started_dir(lab, task, steps)
        return VerlEngine(cfg, train_dataset=list(train_dataset), val_dataset=list(val_dataset))

    from agl_lab.engines.local import LocalEngine
    from agl_lab.quiet import quiet_hf

    preset = lab.model.get("preset")
    lora = LoraSpec.from_model_config(OmegaConf.select(cfg, "actor_rollout_ref.model", default=None))
    if lora.enabled and steps > 0 and lab.model.path is None and preset is None:
        _use_warm_started_dir(lab, task, steps)  # the warm start trains the full base, before the adapter
    label = lab.model.path or (
        f"preset {preset} (converted once into {_cache_hint()})"
        if preset
        else f"built-in tiny model (cached in {_cache_hint()})"
    )
    with quiet_hf(), _stage(f"model: {label}"):
        engine = LocalEngine.from_config(cfg)
    if lab.get("torch_threads", "auto") == "auto":  # now that the model's size is known
        threads = apply_torch_threads("auto", n_params=sum(p.numel() for p in engine.model.parameters()))
    scheduler = getattr(getattr(engine, "server", None), "scheduler", None)
    if scheduler is not None:
        decode = (lab.get("engine_options") or {}).get("decode_threads", "auto")
        scheduler.num_threads = decode_threads(decode, threads)
    if steps > 0 and lab.model.path is None and preset is None:
        try:
            _warm_start(engine, task, steps, int(lab.seed))
            if engine.overlaps:  # the serving copy was taken before the warm start (docs/engines.md "Overlap")
                engine.copy_to_serving()
        except BaseException:
            engine.close()
            raise
    return engine


def _use_warm_started_dir(lab: Any, task: Any, steps: int) -> None:
    """Point `agl_lab.model.path` at the tiny model warm-started on `task`, saved as an HF directory
    (for models loaded from disk: verl's workers, the base under a LoRA adapter)."""
    from agl_lab.engines.warmstart import warm_started_model_dir

    lab.model.path = str(warm_started_model_dir(task, steps, seed=int(lab.seed)))


AUTO_THREADS_MAX_CORES = 4  # at or below this many cores, `auto` means 1 thread for a small model…
AUTO_THREADS_BIG_MODEL = 50_000_000  # …and every core from this many parameters (SmolLM2-135M: 2.7× faster)


def torch_threads(value: Any, cores: int | None = None, n_params: int | None = None) -> int | None:
    """The thread count `agl_lab.torch_threads` asks for (None: leave torch's default).

    `auto`: half the cores on a machine with more than 4; on a smaller one 1 thread (the tiny model's
    small matmuls collapse under 2 threads on a shared machine, docs/engines.md "Torch threads") unless the
    model has `n_params` ≥ 50 M, whose compute-bound update wants every core."""
    if value is None:
        return None
    if value == "auto":
        cores = cores or os.cpu_count() or 1
        if cores > AUTO_THREADS_MAX_CORES:
            return cores // 2
        return cores if n_params is not None and n_params >= AUTO_THREADS_BIG_MODEL else 1
    return int(value)


def decode_threads(value: Any, threads: int) -> int:
    """The decode loop's intra-op threads (`agl_lab.engine_options.decode_threads`): an int as given;
    `auto`: `threads`, the update's count. Synchronously the loop runs only while no update does (they
    share the weights lock); under overlap both run at once on the same cores, and giving the decode
    half of them was measured slower on 2 cores (docs/benchmarks.md, the overlap's decode threads)."""
    return threads if value == "auto" else int(value)


def apply_torch_threads(value: Any, n_params: int | None = None) -> int:
    """Set torch's intra-op threads from `agl_lab.torch_threads`; returns the count in force."""
    import torch

    n = torch_threads(value, n_params=n_params)
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
        logger.info("torch uses %d intra-op thread(s) (agl_lab.torch_threads=%s)", n, value)
    return torch.get_num_threads()


def _warm_start(engine: Any, task: Any, steps: int, seed: int) -> None:
    from agl_lab.engines.warmstart import warm_start

    if task.demonstrations is None:
        logger.warning(
            "task %r has no demonstrations: agl_lab.model.warm_start_steps=%s has no effect "
            "(give Task(demonstrations=...) for a warm start)",
            task.name,
            steps,
        )
        return
    warm_start(engine.model, engine.tokenizer, task, steps=steps, seed=seed, progress=True)


def _cache_hint() -> str:
    from agl_lab.cache import cache_root

    return str(cache_root()).replace(str(Path.home()), "~")


@contextlib.contextmanager
def _stage(description: str):
    """A one-step progress bar naming long first-run work (model build/load)."""
    from agl_lab.progress import progress_bar

    bar = progress_bar(total=1, desc=description, leave=False, bar_format="{desc} {elapsed}")
    try:
        yield
    finally:
        bar.update(1)
        bar.close()
