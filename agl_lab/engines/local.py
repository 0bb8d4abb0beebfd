"""LocalEngine: one transformers model that both serves (OpenAI-style) and trains, in process.

The CPU path of agl_lab — and the one-GPU path for small models — needs no Ray, no vLLM
and no weight transfer: the OpenAI server's scheduler and the PPO update hold the *same*
`torch.nn.Module`. What keeps that safe is one lock (`weights_lock`): every decode step
runs under it, and so do `compute_log_probs`, `update` and `load`; a forward therefore
never sees half-updated weights. `sync_weights()` has nothing to copy and only bumps
`policy_version` (the gateway stamps it on every model_request as `model_version`).

    engine = LocalEngine()                        # tiny model, served on a free port
    engine.endpoints()                            # ['http://127.0.0.1:PORT/v1']
    old = engine.compute_log_probs(batch, 1.0)    # [N, R]
    metrics = engine.update(batch)                # agl_lab.engines.local_ppo.ppo_update
    engine.sync_weights()                         # policy_version += 1

Device: `device=None` → CUDA if available (bfloat16 weights), else CPU (float32).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from agl_lab.engines import openmp
from agl_lab.engines.base import Engine
from agl_lab.engines.serving.openai_server import OpenAIServer
from agl_lab.engines.tiny import DEFAULT_MODEL_NAME, load_model_and_tokenizer
from agl_lab.rules import BATCH_WINDOW_MS, MAX_BATCH_SIZE, MAX_MODEL_LEN, uses_bypass

_STATE_FILE = "engine_state.pt"
DEFAULT_TINY_LR = 1e-3  # the tiny model learns at this rate; verl's 1e-6 default would not move it


def actor_config(actor: Any = None, lr: float | None = None) -> Any:
    """`ActorUpdateConfig` from None, an ActorUpdateConfig, its field dict, or a verl actor section."""
    from agl_lab.engines.local_ppo import ActorUpdateConfig

    if actor is None:
        cfg = ActorUpdateConfig(lr=DEFAULT_TINY_LR)
    elif isinstance(actor, ActorUpdateConfig):
        cfg = actor
    elif isinstance(actor, Mapping) and not {"optim", "policy_loss"} & set(actor):  # a field dict
        unknown = sorted(set(actor) - {f.name for f in fields(ActorUpdateConfig)})
        if unknown:
            raise ValueError(
                f"actor={{...}} has keys that are not ActorUpdateConfig fields: {unknown}. Pass its fields "
                "(lr, ppo_mini_batch_size, ...) or a verl actor section (with optim: and policy_loss:); the "
                "sampling temperature is not an actor key: it travels in data.meta_info['temperature']"
            )
        cfg = ActorUpdateConfig(**dict(actor))
    else:  # `actor_rollout_ref.actor` of a verl config (dict, DictConfig or dataclass)
        cfg = ActorUpdateConfig.from_verl_actor_config(actor)
    if lr is not None:
        cfg.lr = float(lr)
    return cfg


def _bypass_mode(bypass_mode: bool | None, algorithm: Any) -> bool:
    """Bypass mode as `algorithm.rollout_correction.bypass_mode` says (the config path, `from_config`)
    unless the `bypass_mode` argument says it; ValueError when the two disagree."""
    correction = algorithm.get("rollout_correction") or {}
    if bypass_mode is None:
        return uses_bypass(correction)
    if "bypass_mode" in correction and bool(correction["bypass_mode"]) != bool(bypass_mode):
        raise ValueError(
            f"LocalEngine(bypass_mode={bypass_mode}) disagrees with algorithm.rollout_correction.bypass_mode="
            f"{correction['bypass_mode']}: pass one of them (the algorithm's alone is enough)"
        )
    return bool(bypass_mode)


def _warn_invariance_gap(model: Any) -> None:
    from agl_lab.config_keys import ConfigWarning
    from agl_lab.engines.serving.fast_decode import invariance_gap

    gap = invariance_gap(model)
    if gap:
        warnings.warn(
            f"agl_lab.engine_options.batch_invariant=true: a row's bits may still depend on its batch-mates: "
            f"{gap} (the mode's matrix products are row-invariant only in float32 on the CPU, docs/engines.md "
            f'"One seed, one run on any load"); a seed may not repeat exactly on another load',
            ConfigWarning,
            stacklevel=3,
        )


def _set_compute_dtype(model: torch.nn.Module, value: Any) -> None:
    """`agl_lab.model.compute_dtype` on `model` (agl_lab/engines/precision.py); warns where it does nothing."""
    from agl_lab.config_keys import ConfigWarning
    from agl_lab.engines import precision

    try:
        dtype = precision.parse(value)
    except ValueError as err:
        from agl_lab.config import ConfigError

        raise ConfigError(str(err)) from None
    p = next(model.parameters())
    if dtype is not None and (p.device.type != "cpu" or p.dtype != torch.float32):
        warnings.warn(
            f"{precision.KEY}={value} has no effect: the model's weights are {str(p.dtype).removeprefix('torch.')} "
            f"on {p.device.type}, and the key sets the products' precision over float32 CPU weights",
            ConfigWarning,
            stacklevel=3,
        )
        return
    precision.set_compute_dtype(model, dtype)


class LocalEngine(Engine):
    """A transformers model served by `OpenAIServer` and trained by `agl_lab.engines.local_ppo.ppo_update`."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        device: str | None = None,
        dtype: Any = None,
        compute_dtype: Any = None,
        seed: int = 0,
        max_model_len: int = MAX_MODEL_LEN,
        actor: Any = None,
        lr: float | None = None,
        model_name: str | None = None,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 0,
        batch_window_ms: float = BATCH_WINDOW_MS,
        max_batch_size: int = MAX_BATCH_SIZE,
        log_prob_micro_batch_size: int | None = 16,
        bypass_mode: bool | None = None,
        algorithm: Any = None,
        lora: Any = None,
        batch_invariant: bool = False,
        overlap: bool = False,
    ):
        from agl_lab.engines.lora import LoraSpec, add_lora

        self.actor_cfg = actor_config(actor, lr)  # first: a bad actor dict fails before the model loads
        self.lora = lora if isinstance(lora, LoraSpec) else LoraSpec.from_model_config(lora)
        self.model, self.tokenizer = load_model_and_tokenizer(model_path, device=device, dtype=dtype, seed=seed)
        self.device = next(self.model.parameters()).device
        _set_compute_dtype(self.model, compute_dtype)  # before the copies below: they inherit it
        self.model_name = model_name or (Path(model_path).resolve().name if model_path else DEFAULT_MODEL_NAME)
        # `algorithm.*` of a verl config: KL in reward and rollout correction (see `prepare`)
        self.algorithm = OmegaConf.create(
            OmegaConf.to_container(algorithm, resolve=True) if OmegaConf.is_config(algorithm) else (algorithm or {})
        )
        self.use_kl_in_reward = bool(self.algorithm.get("use_kl_in_reward", False))
        self.kl_ctrl = None
        if self.use_kl_in_reward:
            from verl.trainer.ppo.core_algos import get_kl_controller

            self.kl_ctrl = get_kl_controller(self.algorithm.kl_ctrl)  # adaptive ones keep state across steps
        needs_ref = self.actor_cfg.use_kl_loss or self.use_kl_in_reward
        self.ref_model = self._frozen_copy() if needs_ref else None  # before LoRA: the reference is the base
        self.lora_params = None
        if self.lora.enabled:
            with torch.random.fork_rng(devices=[]):  # the adapter's init (A Kaiming-uniform) follows `seed`
                torch.manual_seed(seed)
                self.lora_params = add_lora(self.model, self.lora)
        from agl_lab.engines.local_ppo import build_optimizer

        self.optimizer = build_optimizer(self.model, self.actor_cfg)  # over the trainable parameters only
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.bypass_mode = _bypass_mode(bypass_mode, self.algorithm)  # old logprobs = the sampling logprobs
        self.weights_lock = threading.RLock()
        self._policy_version = self._serving_version = 0
        self._closed = False
        # Overlap (agl_lab.rollout.max_staleness > 0, docs/engines.md "Overlap"): the server holds a
        # serving copy under its own lock, so generation goes on while `update` trains `self.model`;
        # `publish()` copies the trained weights over at a step boundary. Without it: one module.
        self.serving_model = self._serving_copy() if overlap else self.model
        self.serving_lock = threading.RLock() if overlap else self.weights_lock
        self.server = OpenAIServer(
            self.serving_model,
            self.tokenizer,
            model_name=self.model_name,
            host=host,
            advertise_host=advertise_host,
            port=port,
            max_model_len=max_model_len,
            batch_window_ms=batch_window_ms,
            max_batch_size=max_batch_size,
            weights_lock=self.serving_lock,
        )
        self.server.scheduler.batch_invariant = batch_invariant  # a seed is one run on any load (serving/scheduler.py)
        if batch_invariant:
            _warn_invariance_gap(self.serving_model)
        self._warm()

    def _warm(self) -> None:
        """LoRA merged and decode weights packed before serving (fast_decode.warm), not in a decode step."""
        from agl_lab.engines.serving.fast_decode import warm

        with self.serving_lock:
            warm(self.serving_model)

    @property
    def overlaps(self) -> bool:
        """True when the server serves a copy of the weights (generation overlaps the update)."""
        return self.serving_model is not self.model

    def _serving_copy(self) -> torch.nn.Module:
        """The module the server decodes under overlap. With LoRA the frozen base is shared, not
        copied (it never trains: the same tensors, so the same bits), and only the adapters and
        buffers are the copy's own — the memory of an adapter swap with a copy's exactness."""
        import copy

        memo = {id(p): p for p in self.model.parameters() if not p.requires_grad} if self.lora.enabled else {}
        serving = copy.deepcopy(self.model, memo).eval()
        for p in serving.parameters():
            p.requires_grad_(False)
        return serving

    @property
    def serving_copy_bytes(self) -> int:
        """Bytes of parameters the serving copy holds apart from the trained model (0 without overlap)."""
        shared = {p.data_ptr() for p in self.model.parameters()}
        own = {p.data_ptr(): p.numel() * p.element_size() for p in self.serving_model.parameters()}
        return sum(n for ptr, n in own.items() if ptr not in shared)

    @property
    def vocab_size(self) -> int:
        """The embedding's rows: every id the model can sample and score."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @classmethod
    def from_config(cls, cfg: Any) -> LocalEngine:
        """Build from a composed agl_lab config (`agl_lab.model.*`, `agl_lab.engine_options.*`,
        `actor_rollout_ref.actor.*`, `actor_rollout_ref.rollout.n`,
        `algorithm.rollout_correction.bypass_mode`, LoRA from `actor_rollout_ref.model.lora_*`)."""
        from agl_lab.engines.local_ppo import ActorUpdateConfig

        lab, rollout = cfg.agl_lab, cfg.actor_rollout_ref.rollout
        actor = ActorUpdateConfig.from_verl_actor_config(
            cfg.actor_rollout_ref.actor,
            rollout_n=int(rollout.n),
            skip_zero_advantage=bool((lab.get("algorithm") or {}).get("skip_zero_advantage", True)),
        )
        opts = lab.get("engine_options", {}) or {}
        serving = lab.get("serving", {}) or {}  # agl_lab.serving.host / advertise_host (agl_lab/addresses.py)
        _check_model_dir(cfg)
        log_prob_micro = rollout.get("log_prob_micro_batch_size_per_gpu") or actor.ppo_micro_batch_size_per_gpu
        from agl_lab.models import resolve_model_path

        return cls(
            resolve_model_path(lab.model),
            device=lab.model.device,
            compute_dtype=lab.model.get("compute_dtype"),
            seed=int(lab.seed),
            max_model_len=int(lab.model.max_model_len),
            actor=actor,
            model_name=lab.model.get("name"),
            host=str(serving.get("host") or "127.0.0.1"),
            advertise_host=serving.get("advertise_host"),
            batch_window_ms=float(opts.get("batch_window_ms", BATCH_WINDOW_MS)),
            max_batch_size=int(opts.get("max_batch_size", MAX_BATCH_SIZE)),
            log_prob_micro_batch_size=int(log_prob_micro) if log_prob_micro else 16,
            bypass_mode=uses_bypass(OmegaConf.select(cfg, "algorithm.rollout_correction", default=None)),
            algorithm=cfg.get("algorithm"),
            lora=cfg.actor_rollout_ref.get("model"),
            batch_invariant=bool(opts.get("batch_invariant", False)),
            overlap=int(OmegaConf.select(lab, "rollout.max_staleness", default=0) or 0) > 0,
        )

    def _frozen_copy(self) -> torch.nn.Module:
        import copy

        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # --- serving --------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The trained weights' version (+1 per `sync_weights`)."""
        return self._policy_version

    @property
    def serving_version(self) -> int:
        """The version the server generates with (the gateway stamps it as `model_version`):
        `policy_version` without overlap; with it, the version of the last `publish()`."""
        return self._serving_version if self.overlaps else self._policy_version

    def endpoints(self) -> list[str]:
        return [self.server.base_url]

    def serving_counters(self) -> dict[str, float]:
        """The scheduler's running totals (`BatchScheduler.stats`) under the `Engine` names."""
        stats = self.server.scheduler.stats
        return {
            "prefill_tokens": float(stats["prefill_tokens"]),
            "cached_tokens": float(stats["cached_tokens"]),
            "decode_steps": float(stats["steps"]),
            "shared_prefills": float(stats["shared_prefills"]),
            "decode_rows": float(stats["decode_rows"]),
            "shared_columns": float(stats["shared_columns"]),
            "spilled_columns": float(stats["spilled_columns"]),
        }

    def pause(self, timeout: float | None = 300.0) -> None:
        """Admit no new generation and wait (at most `timeout` s) until the running ones have finished.
        Under overlap the update never touches the serving copy: the server goes on serving."""
        if not self.overlaps:
            self.server.pause(wait=True, timeout=timeout)

    def resume(self) -> None:
        """Serve again. The calling thread (the trainer's) is done computing until the phase ends: its
        OpenMP pool goes, so the decode loop's is the only one (`agl_lab.engines.openmp`)."""
        openmp.release_threads()
        self.server.resume()

    def publish(self, timeout: float | None = 300.0) -> int:
        """Overlap's step boundary: let the running generations finish on the old weights, copy the
        trained weights into the serving copy, serve them as `policy_version`. Returns the version.
        The caller drains the gateway first and registers the new version after (`Execution.publish`)."""
        if self.overlaps and self._serving_version != self._policy_version:
            self.server.pause(wait=True, timeout=timeout)
            try:
                self.copy_to_serving()
            finally:
                self.server.resume()
        return self.serving_version

    def copy_to_serving(self) -> None:
        """Overlap: the serving copy takes `model`'s weights now, as `policy_version` (after a
        warm start, a load, a publish)."""
        with self.weights_lock, self.serving_lock, torch.no_grad():
            for dst, src in zip(self.serving_model.parameters(), self.model.parameters(), strict=True):
                if dst is not src:  # a shared frozen base (LoRA) is already the trained one
                    dst.copy_(src)
            for dst, src in zip(self.serving_model.buffers(), self.model.buffers(), strict=True):
                dst.copy_(src)
            self._serving_version = self._policy_version
            self._warm()

    def abort(self) -> int:
        return self.server.abort()

    # --- training -------------------------------------------------------------------------

    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> torch.Tensor:
        """log π(responses) under the current weights at `temperature`: float32 [N, R] on CPU.

        Reads `input_ids`, `attention_mask`, `position_ids` (optional) and `responses` from
        `data.batch`; the response occupies the last R columns of `input_ids`.
        """
        from agl_lab.engines.local_ppo import batch_log_probs

        with self.weights_lock:
            return batch_log_probs(self.model, data, temperature, self.log_prob_micro_batch_size).float()

    def compute_log_probs_and_entropy(self, data: Any, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(responses), entropy of π) [N, R] each, float32 on CPU: one eval-mode forward of the
        current weights at `temperature`, no gradients (the entropy of `actor/entropy`, per token)."""
        from agl_lab.engines.local_ppo import sequence_log_probs

        b = data.batch
        with self.weights_lock, torch.no_grad():
            was_training = self.model.training
            self.model.eval()
            try:
                logp, ent = sequence_log_probs(
                    self.model,
                    b["input_ids"],
                    b["attention_mask"],
                    b["position_ids"],
                    b["responses"].shape[-1],
                    temperature,
                    self.log_prob_micro_batch_size,
                    with_entropy=True,
                )
            finally:
                self.model.train(was_training)
        return logp.float().cpu(), ent.float().cpu()

    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        """Old logprobs (base: recomputed, or the sampling ones in bypass mode), then what AGL's
        trainer does before the advantage, with verl's own functions and metric names:

        - `algorithm.use_kl_in_reward`: `ref_log_prob` from the frozen initial model, then verl's
          `apply_kl_penalty` (token_level_rewards = scores − β·KL; `actor/reward_kl_penalty*`);
        - `algorithm.rollout_correction` (not bypass, sampling logprobs present): verl's
          `compute_rollout_correction_and_add_to_batch` — token/sequence IS weights
          (`rollout_is_weights`, read by the loss), rejection masks on `response_mask`, and the
          `rollout_corr/*` metrics (logged even with rollout_is/rollout_rs null, as AGL does).
        """
        data, metrics = super().prepare(data)
        if self.use_kl_in_reward:
            from verl.trainer.ppo.ray_trainer import apply_kl_penalty

            from agl_lab.engines.local_ppo import batch_log_probs

            temperature = float(data.meta_info.get("temperature", 1.0))
            data.batch["ref_log_prob"] = batch_log_probs(
                self.ref_model, data, temperature, self.log_prob_micro_batch_size
            ).float()
            data, kl_metrics = apply_kl_penalty(data, self.kl_ctrl, str(self.algorithm.get("kl_penalty", "kl")))
            metrics.update(kl_metrics)
        rc = self.algorithm.get("rollout_correction")
        if rc is not None and not self.bypass_mode and "rollout_log_probs" in data.batch.keys():
            from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

            data, rc_metrics = compute_rollout_correction_and_add_to_batch(data, rc)
            metrics.update({k: float(v) for k, v in rc_metrics.items()})
        return data, metrics

    def update(self, data: Any) -> dict[str, float]:
        """One PPO update (`agl_lab.engines.local_ppo.ppo_update`) on a prepared batch; returns its metrics."""
        from agl_lab.engines.local_ppo import ppo_update

        with self.weights_lock:
            try:
                return ppo_update(self.model, self.optimizer, data, self.actor_cfg, ref_model=self.ref_model)
            finally:
                self.model.eval()  # the scheduler serves in eval mode

    def sync_weights(self) -> None:
        """The server serves this very module: nothing to copy, the version moves on; the new
        weights are merged (LoRA) and packed here, before serving resumes. Under overlap the
        serving copy keeps the old weights until `publish()`."""
        if not self.overlaps:
            self._warm()
        self._policy_version += 1

    # --- checkpoints ----------------------------------------------------------------------

    def save(self, path: str) -> None:
        """`path/` = a loadable HF model dir (weights + tokenizer) + `engine_state.pt`
        (optimizer, policy_version); with LoRA the dir holds the base weights and
        `lora_adapter/` the adapter (PEFT's format). The process's RNG states are the Trainer's to save."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        with self.weights_lock:
            if self.lora_params is None:
                self.model.save_pretrained(out)
            else:  # the base under HF's names (a loadable dir) + the adapter in PEFT's format
                from agl_lab.engines.lora import ADAPTER_DIR, save_adapter, split_state_dict

                self.model.save_pretrained(out, state_dict=split_state_dict(self.model)[0])
                save_adapter(self.model, self.lora, out / ADAPTER_DIR)
            self.tokenizer.save_pretrained(out)
            state = {
                "optimizer": self.optimizer.state_dict(),
                "policy_version": self._policy_version,
                "model_name": self.model_name,
            }
            torch.save(state, out / _STATE_FILE)

    def load(self, path: str) -> None:
        """Restore `save(path)` in place (the server keeps serving the same, now loaded, module)."""
        from transformers import AutoModelForCausalLM

        src = Path(path)
        if not (src / _STATE_FILE).exists():
            raise FileNotFoundError(f"{src} has no {_STATE_FILE}; pass a directory written by LocalEngine.save")
        dtype = next(self.model.parameters()).dtype
        loaded = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True)
        state = torch.load(src / _STATE_FILE, weights_only=True, map_location="cpu")  # tensors and plain data
        with self.weights_lock:
            if self.lora_params is None:
                self.model.load_state_dict(loaded.state_dict())
            else:
                from agl_lab.engines.lora import ADAPTER_DIR, load_adapter, load_base

                load_base(self.model, loaded.state_dict())
                load_adapter(self.model, src / ADAPTER_DIR)
            self.optimizer.load_state_dict(state["optimizer"])
            self._policy_version = int(state["policy_version"])
            if self.overlaps:  # the restored weights are served at once
                self.copy_to_serving()
            else:
                self._warm()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.server.stop()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_model_dir(cfg: Any) -> None:
    """The local engine loads a model directory from disk and never downloads: a hub id fails
    here, naming the key it came from and the fix."""
    from agl_lab.config import ConfigError

    path = cfg.agl_lab.model.path
    if path is None or (Path(str(path)).expanduser() / "config.json").exists():
        return
    key = (
        "actor_rollout_ref.model.path"
        if str(path) == str(OmegaConf.select(cfg, "actor_rollout_ref.model.path"))
        else "agl_lab.model.path"
    )
    raise ConfigError(
        f"{key}={str(path)!r} is not a local Hugging Face model directory (no config.json) and the local "
        f"engine never downloads: fetch it first (`huggingface-cli download {path} --local-dir DIR`) and "
        f"set {key}=DIR, or use agl_lab.engine=verl"
    )
