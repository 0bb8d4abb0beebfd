"""What each config key the user set does: type and range checks, and "no effect" warnings.

Two promises of the config language (`agl_lab.config`):

1. A value of the wrong type or range fails at load, naming the key
   (`data.train_batch_size=abc` → "data.train_batch_size must be an integer, got 'abc'").
   The expected type is the type of the key's default (verl's generated `ppo_trainer`,
   AGL's and agl_lab's sections); `RANGES` adds the bounds of the keys that have one.
2. Every key the user set either works or produces **one** warning naming it. On the local
   engine, `LOCAL_HONOURED` lists the keys (prefixes) agl_lab reads; any other key the user
   set to a non-default value is read by verl engines only and gets a `ConfigWarning`
   ("… has no effect on the local engine"). Python's warning filter shows each once.

    user_keys(layer)            leaf paths a user layer sets
    check_values(cfg, keys)     ConfigError for a wrong type/range
    warn_ineffective(cfg, keys) one ConfigWarning per key without effect (plus a few
                                settings that are legal but surprising, e.g. GRPO with n=1)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from agl_lab.rules import ZERO_SKIP_LOSSES, check_compute_dtype


class ConfigWarning(UserWarning):
    """A key the user set has no effect here, or a legal setting that defeats its purpose."""


# Keys (or prefixes) the local engine and the Trainer read. Everything else the user sets to
# a non-default value warns on `agl_lab.engine=local`.
LOCAL_HONOURED = (
    "agl_lab",
    "agentlightning",
    "algorithm.adv_estimator",
    "algorithm.gamma",
    "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.enable_rollout_level_advantage",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty",
    "algorithm.kl_ctrl",
    "algorithm.rollout_correction",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.shuffle",
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.clip_grad",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.policy_loss",
    "actor_rollout_ref.actor.data_loader_seed",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor",
    "actor_rollout_ref.actor.shuffle",
    "actor_rollout_ref.actor.use_prefix_grouper",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.val_before_train",
    "trainer.val_only",
    "trainer.test_freq",
    "trainer.save_freq",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.logger",
    "trainer.max_actor_ckpt_to_keep",
)

# agl_lab keys only the local engine reads → what the verl engine reads instead.
VERL_IGNORED = {
    "agl_lab.engine_options": "verl's rollout replicas batch by their own settings "
    "(actor_rollout_ref.rollout.max_num_seqs, max_num_batched_tokens)",
    "agl_lab.model.max_model_len": "set actor_rollout_ref.rollout.max_model_len",
    "agl_lab.model.device": "verl places its workers on GPUs, or on CPU with agl_lab.verl.device=cpu",
    "agl_lab.algorithm.skip_zero_advantage": "verl's actor forwards every micro-batch (its loss loop is verl's own)",
    "agl_lab.model.compute_dtype": "set actor_rollout_ref.actor.fsdp_config.mixed_precision and "
    "actor_rollout_ref.rollout.dtype",
}

# (key, lower bound, strict?) for numbers; None values pass (the key's own check decides).
RANGES: tuple[tuple[str, float, bool], ...] = (
    ("data.train_batch_size", 0, True),
    ("data.max_prompt_length", 0, True),
    ("data.max_response_length", 0, True),
    ("actor_rollout_ref.rollout.n", 0, True),
    ("actor_rollout_ref.rollout.temperature", 0, True),
    ("actor_rollout_ref.rollout.val_kwargs.n", 0, True),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 0, True),
    ("actor_rollout_ref.actor.ppo_epochs", 0, True),
    ("actor_rollout_ref.actor.optim.lr", 0, False),
    ("actor_rollout_ref.actor.clip_ratio_low", 0, False),
    ("actor_rollout_ref.actor.clip_ratio_high", 0, False),
    ("trainer.total_epochs", 0, True),
    ("agentlightning.rollout_timeout_seconds", 0, True),
    ("agl_lab.rollout.poll_interval_seconds", 0, True),
    ("agl_lab.rollout.drain_timeout_seconds", 0, True),
    ("agl_lab.rollout.max_staleness", 0, False),
    ("agl_lab.runner.concurrency", 0, True),
    ("agl_lab.algorithm.max_abs_reward", 0, True),
    ("agl_lab.verl.placement_timeout_seconds", 0, True),
    ("agl_lab.task.max_turns", 0, True),
)


# Keys read as a number whose default is null or a word, or whose default's type says too little
# (verl's `entropy_coeff: 0` is an int, the key a float): key → (kind, the words accepted besides
# a number). `trainer.total_training_steps=ten` fails at load naming the key, not after the
# engine is built. These override the type of the default.
TYPED: dict[str, tuple[str, tuple[str, ...]]] = {
    "actor_rollout_ref.actor.entropy_coeff": ("float", ()),
    "actor_rollout_ref.model.lora_alpha": ("float", ()),
    "trainer.total_training_steps": ("int", ()),
    "agentlightning.max_ppo_update_times": ("int", ()),
    "agentlightning.async_rollout.async_train_batch_size": ("int", ()),
    "agl_lab.runner.agent_timeout_seconds": ("float", ()),
    "agl_lab.torch_threads": ("int", ("auto",)),
    "agl_lab.engine_options.decode_threads": ("int", ("auto",)),
    "agl_lab.record.max_steps": ("int", ()),  # null: keep every step's recording
    "trainer.max_actor_ckpt_to_keep": ("int", ()),  # null or 0: keep every checkpoint (verl)
    "agl_lab.task.size": ("int", ()),  # null: as many generator entries as tasks asked for
    "agl_lab.task.seed": ("int", ()),  # null: agl_lab.seed
}

# verl's agg_loss modes (core_algos.agg_loss); the local engine accepts the same ones.
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Keys of TYPED (None: checked above) that must be > 0 when set.
TYPED_POSITIVE = (
    "trainer.total_training_steps",
    "agentlightning.max_ppo_update_times",
    "agentlightning.async_rollout.async_train_batch_size",
    "agl_lab.runner.agent_timeout_seconds",
    "agl_lab.torch_threads",
    "agl_lab.engine_options.decode_threads",
    "agl_lab.record.max_steps",
    "agl_lab.task.size",
)


# verl 0.9.1's own async trainers (verl/experimental/fully_async_policy, one_step_off_policy) read
# these keys; their trainers run the rollouter and the trainer as separate Ray actors on separate
# GPU pools, syncing weights through a message queue and an NCCL checkpoint engine. Neither agl_lab
# engine runs them (both run the one AGL loop), so each key is refused with its agl_lab counterpart.
_OVERLAP_FIX = (
    "agl_lab.rollout.max_staleness=N (policy versions a trained token may lag) with "
    'agentlightning.async_rollout.enabled=true, on agl_lab.engine=local (docs/engines.md "Overlap")'
)
VERL_ASYNC_KEYS = {
    "async_training.staleness_threshold": f"a share of extra samples, not versions: set {_OVERLAP_FIX}",
    "async_training.partial_rollout": "carried-over groups keep generating across versions already: set "
    "agentlightning.async_rollout.enabled=true",
    "async_training.trigger_parameter_sync_step": "weights reach the server at every step boundary "
    f"(one version a step): set {_OVERLAP_FIX}",
    "async_training.require_batches": "a step trains data.train_batch_size groups: set that",
    "async_training": f"set {_OVERLAP_FIX}",
    "rollout": "the rollouter's own GPU pool: agl_lab's engine serves where it trains (agl_lab.engine, "
    "actor_rollout_ref.rollout.tensor_model_parallel_size)",
    "actor_rollout_ref.actor.use_rollout_log_probs": "set algorithm.rollout_correction.bypass_mode=true "
    "(the sampling logprobs are the old ones)",
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": "there are no standalone rollout GPUs: set "
    "actor_rollout_ref.rollout.gpu_memory_utilization",
}


def refused_async_keys(paths: Iterable[str], source: str) -> list[str]:
    """One line per key of verl's separate async trainers among `paths` (a layer's leaf paths,
    Hydra's `+` prefix allowed): the key, why agl_lab does not run it, and the fix."""
    lines = []
    for path in paths:
        key = path.lstrip("+")
        match = next((k for k in VERL_ASYNC_KEYS if key == k or key.startswith(k + ".")), None)
        if match is not None:
            lines.append(
                f"{key} (from {source}) is a key of verl's fully-async / one-step-off trainer, which runs "
                f"rollouter and trainer as separate Ray actors on their own GPUs; agl_lab does not: "
                f"{VERL_ASYNC_KEYS[match]}"
            )
    return lines


def user_keys(layer: Any, prefix: str = "") -> list[str]:
    """Leaf paths a user layer sets (a mapping's keys recursively; a set empty dict is a leaf)."""
    out: list[str] = []
    items = layer.items_ex(resolve=False) if isinstance(layer, DictConfig) else dict(layer).items()
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, (DictConfig, dict)) and len(value) > 0:
            out += user_keys(value, path)
        else:
            out.append(path)
    return out


def _kind(default: Any) -> str | None:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    return None  # strings, lists, None: free type (the key's own check decides)


def _type_error(path: str, value: Any, kind: str) -> str | None:
    if value is None or isinstance(value, (DictConfig, ListConfig)):
        return None
    if kind == "bool" and not isinstance(value, bool):
        return f"{path} must be true or false, got {value!r}"
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        if isinstance(value, float) and value.is_integer():
            return None
        return f"{path} must be an integer, got {value!r}"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{path} must be a number, got {value!r}"
    return None


def check_values(cfg: DictConfig, defaults: DictConfig, keys: Iterable[str]) -> list[str]:
    """Problems (messages naming the key) with the values of `keys` in `cfg`: the type of the
    key's default, then `RANGES`. Returns `[]` when all is well."""
    problems: list[str] = []
    for path in keys:
        default = OmegaConf.select(defaults, path, default=None, throw_on_missing=False)
        kind = None if path in TYPED else _kind(default)
        if kind is None:
            continue
        value = OmegaConf.select(cfg, path, default=None, throw_on_missing=False)
        msg = _type_error(path, value, kind)
        if msg:
            problems.append(msg)
    for path, (kind, words) in TYPED.items():
        value = OmegaConf.select(cfg, path, default=None, throw_on_missing=False)
        if value in words:
            continue
        msg = _type_error(path, value, kind)
        if msg:
            problems.append(msg + (f" (or {' / '.join(words)})" if words else ""))
        elif path in TYPED_POSITIVE and value is not None and value <= 0:
            problems.append(f"{path} must be > 0, got {value!r}")
    mode = OmegaConf.select(cfg, "actor_rollout_ref.actor.loss_agg_mode", default=None)
    if mode is not None and mode not in LOSS_AGG_MODES:
        problems.append(
            f"actor_rollout_ref.actor.loss_agg_mode={mode!r} is not one of verl's modes {list(LOSS_AGG_MODES)}"
        )
    try:
        check_compute_dtype(OmegaConf.select(cfg, "agl_lab.model.compute_dtype", default=None))
    except ValueError as err:
        problems.append(str(err))
    for path, low, strict in RANGES:
        value = OmegaConf.select(cfg, path, default=None, throw_on_missing=False)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        bad = (value <= low) if strict else (value < low)
        if bad or (isinstance(value, float) and not math.isfinite(value)):
            problems.append(f"{path} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return problems


def _honoured(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in LOCAL_HONOURED)


def ineffective_keys(cfg: DictConfig, defaults: DictConfig, keys: Iterable[str]) -> list[str]:
    """User keys with a non-default value that the local engine does not read."""
    out = []
    for path in keys:
        if _honoured(path) or path.rsplit(".", 1)[-1] == "_target_":
            continue
        if _changed(cfg, defaults, path):
            out.append(path)
    return out


def _changed(cfg: DictConfig, defaults: DictConfig, path: str) -> bool:
    """The user's value at `path` differs from the default (a missing key reads as None)."""
    return OmegaConf.select(cfg, path, default=None, throw_on_missing=False) != OmegaConf.select(
        defaults, path, default=None, throw_on_missing=False
    )


def _task_tools_unused(cfg: DictConfig, keys: list[str]) -> list[str]:
    """`agl_lab.task.tools` acts on reasoning-gym tasks only (agl_lab/tasks/rgym.py)."""
    name = str(cfg.agl_lab.task.name)
    if "agl_lab.task.tools" not in keys or not cfg.agl_lab.task.get("tools") or name.startswith("reasoning_gym:"):
        return []
    return [
        f"agl_lab.task.tools has no effect on agl_lab.task.name={name}: only reasoning_gym:<dataset> tasks "
        "offer a tool with it (calc's agent has its calculator already)"
    ]


def warn_ineffective(cfg: DictConfig, defaults: DictConfig, keys: Iterable[str]) -> list[str]:
    """One ConfigWarning per key without effect; returns the messages (for tests and logs)."""
    keys = list(keys)
    messages: list[str] = []
    if str(cfg.agl_lab.engine) == "local":
        messages += [
            f"{p} has no effect on the local engine (agl_lab.engine=local); verl engines read it"
            for p in ineffective_keys(cfg, defaults, keys)
        ]
        if cfg.agl_lab.server.embedded and "agentlightning.agl_base_url" in keys:
            messages.append(
                "agentlightning.agl_base_url has no effect with agl_lab.server.embedded=true "
                "(the Trainer starts its own store + gateway); set embedded=false to use it"
            )
        rc = cfg.algorithm.get("rollout_correction") or {}
        if rc.get("bypass_mode") and str(rc.get("loss_type", "ppo_clip")) != "ppo_clip":
            messages.append(
                f"algorithm.rollout_correction.loss_type={rc.get('loss_type')} has no effect on the local "
                "engine: bypass mode keeps actor.policy_loss.loss_mode with old logprobs = the sampling "
                "logprobs (verl's ppo_clip bypass); use agl_lab.engine=verl for reinforce"
            )
    if str(cfg.agl_lab.engine) == "verl":
        messages += [
            f"{p} has no effect on the verl engine (agl_lab.engine=verl): {VERL_IGNORED[prefix]}"
            for p in keys
            for prefix in VERL_IGNORED
            if (p == prefix or p.startswith(prefix + ".")) and _changed(cfg, defaults, p)
        ]
    if str(cfg.agl_lab.engine) == "verl" and bool(cfg.actor_rollout_ref.actor.get("use_prefix_grouper", False)):
        messages.append(
            "actor_rollout_ref.actor.use_prefix_grouper=true does not compute the shared prefix once on the "
            "verl engine: verl 0.9.1's workers never call its prefix-grouper forward (the trainer only balances "
            "whole groups with it); the local engine (agl_lab.engine=local) does (docs/engines.md)"
        )
    if not cfg.agl_lab.server.embedded:  # every other agl_lab.server key configures the embedded server
        messages += [
            f"{p} has no effect with agl_lab.server.embedded=false: the server at "
            "agentlightning.agl_base_url runs with its own settings (set them there)"
            for p in keys
            if p.startswith("agl_lab.server.") and p != "agl_lab.server.embedded" and _changed(cfg, defaults, p)
        ]
    if "trainer.max_actor_ckpt_to_keep" in keys and cfg.trainer.get("max_actor_ckpt_to_keep") == 0:
        messages.append(
            "trainer.max_actor_ckpt_to_keep=0 keeps every checkpoint (verl's rule: null or 0 is no "
            "limit); set N > 0 to keep the newest N"
        )
    messages += _task_tools_unused(cfg, keys)
    messages += contradictions(cfg)
    messages += _zero_skip_inexact(cfg, keys)
    messages += mini_batch_clamped(cfg)
    messages += _loss_agg_unused(cfg, keys)  # both engines: per_rollout_mean is the same loss in verl's registry
    n, est = int(cfg.actor_rollout_ref.rollout.n), str(cfg.algorithm.adv_estimator).lower()
    if n == 1 and est in ("grpo", "grpo_passk", "rloo", "opo", "gpg"):
        messages.append(
            f"actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator={est}: every group has one "
            "rollout and no baseline (verl's GRPO uses mean 0, std 1 for it: the advantage is the raw "
            "reward, plain REINFORCE) — set rollout.n >= 2 for a group baseline (AGL uses 4)"
        )
    for m in messages:
        warnings.warn(m, ConfigWarning, stacklevel=3)
    return messages


def contradictions(cfg: DictConfig) -> list[str]:
    """Settings that work against each other but can both be meant: one message per pair, naming both keys."""
    lab, out = cfg.agl_lab, []
    if lab.server.embedded and not lab.runner.enabled:
        out.append(
            "agl_lab.runner.enabled=false with agl_lab.server.embedded=true: nothing runs the agents of the "
            "embedded server's rollouts unless you start a Runner on trainer.base_url with trainer.key "
            "yourself (rollouts wait until agl_lab.rollout.wait_timeout_seconds); enable the runner, or set "
            "agl_lab.server.embedded=false to use the runners of an external server"
        )
    fill = float(cfg.agentlightning.reward_fillna_value)
    if lab.algorithm.exclude_failed_rollouts and fill != 0.0:
        out.append(
            f"agentlightning.reward_fillna_value={fill:g} with agl_lab.algorithm.exclude_failed_rollouts=true: "
            "failed rollouts get no rows, so the fill value reaches only succeeded rollouts without a "
            "reward; set exclude_failed_rollouts=false to train failed rollouts with it"
        )
    return out


def mini_batch_clamped(cfg: DictConfig) -> list[str]:
    """`ppo_mini_batch_size` (counted in tasks, verl's unit) above the tasks of a step: every step is
    one smaller mini-batch, not the size asked for. The message has the numbers and the value to set."""
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size or 0)
    tasks, n = int(cfg.data.train_batch_size), int(cfg.actor_rollout_ref.rollout.n)
    if mini <= tasks or bool(cfg.agentlightning.async_rollout.enabled):
        return []
    return [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} is more than data.train_batch_size={tasks}: "
        f"ppo_mini_batch_size counts tasks (each with rollout.n={n} rollouts), so a mini-batch of {mini} × {n} = "
        f"{mini * n} rollouts is asked for but a step has {tasks} × {n} = {tasks * n}: every step trains them as "
        f"one mini-batch of {tasks * n} (clamped). Set actor_rollout_ref.actor.ppo_mini_batch_size={tasks} "
        f"(one update per step), or a divisor of {tasks} for more updates; rescale it with "
        "data.train_batch_size when you change rollout.n at a fixed number of rollouts per step"
    ]


def check_validation_tasks(cfg: DictConfig, n_val_tasks: int) -> None:
    """The validation keys against the validation tasks there are: with none, `trainer.val_only`
    fails (ValueError naming the keys) and `val_before_train` / `test_freq > 0` warn (they
    would silently validate nothing)."""
    if n_val_tasks > 0:
        return
    source = "there are no validation tasks (agl_lab.task.n_val=0 and no data.val_files or val_dataset; set one of them"
    if cfg.trainer.val_only:
        raise ValueError(f"trainer.val_only=true but {source}, or trainer.val_only=false)")
    keys = [
        k
        for k, on in (
            ("trainer.val_before_train=true", cfg.trainer.val_before_train),
            (f"trainer.test_freq={cfg.trainer.test_freq}", int(cfg.trainer.test_freq) > 0),
        )
        if on
    ]
    if keys:
        warnings.warn(
            f"{' and '.join(keys)} validate nothing: {source}, or turn validation off)", ConfigWarning, stacklevel=3
        )


def _loss_agg_unused(cfg: DictConfig, keys: list[str]) -> list[str]:
    """loss_agg_mode set under `per_rollout_mean`: that loss is a plain token sum (its normalisation is
    in the advantages), so the mode aggregates only the entropy and KL terms — none when both are off."""
    actor = cfg.actor_rollout_ref.actor
    if "actor_rollout_ref.actor.loss_agg_mode" not in keys or str(actor.policy_loss.loss_mode) != "per_rollout_mean":
        return []
    if float(actor.entropy_coeff) != 0 or bool(actor.use_kl_loss):
        return []
    return [
        f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode} has no effect under "
        "actor_rollout_ref.actor.policy_loss.loss_mode=per_rollout_mean (a token sum normalised per rollout "
        "in the advantages; the mode aggregates only the entropy and KL terms, and entropy_coeff=0, "
        "use_kl_loss=false): set policy_loss.loss_mode=vanilla for verl's aggregation"
    ]


def _zero_skip_inexact(cfg: DictConfig, keys: list[str]) -> list[str]:
    """`agl_lab.algorithm.skip_zero_advantage=true` set where the skip would not be exact: the local
    engine does not apply it (`ActorUpdateConfig.zero_skip_blocker`, metric actor/zero_adv_skip_active=0)."""
    key = "agl_lab.algorithm.skip_zero_advantage"
    if key not in keys or not cfg.agl_lab.algorithm.get("skip_zero_advantage") or str(cfg.agl_lab.engine) != "local":
        return []
    actor = cfg.actor_rollout_ref.actor
    exact = ZERO_SKIP_LOSSES
    if float(actor.entropy_coeff) != 0:
        why = f"actor_rollout_ref.actor.entropy_coeff={actor.entropy_coeff} is non-zero for every row"
    elif bool(actor.use_kl_loss):
        why = "actor_rollout_ref.actor.use_kl_loss=true is non-zero for every row"
    elif str(actor.policy_loss.loss_mode) not in exact:
        why = f"actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode} is not one of {list(exact)}"
    else:
        return []
    return [
        f"{key}=true has no effect: {why}, so skipping zero-advantage rows would change the gradient; "
        "every micro-batch is forwarded (set entropy_coeff=0 and use_kl_loss=false for the skip)"
    ]
