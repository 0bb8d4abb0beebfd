"""One config language: verl's `ppo_trainer` defaults + `agentlightning:` + `agl_lab:`.

The composition mirrors Agent Lightning v1, so an AGL training config loads unchanged:

    verl ppo_trainer defaults          (verl/trainer/config/_generated_ppo_trainer.yaml)
      └─ AGL overrides + `agentlightning:` section   (same keys and defaults as AGL v1)
          └─ `agl_lab:` section         (engine, model, task, gateway, loss divisor, …)
              └─ the user's YAML file, then `key=value` overrides

Every key the user sets must exist in the composed defaults (a typo fails with the key's name
and the closest known key); a few verl sub-trees are free-form (engine kwargs, override
configs) and accept anything. `validate()` then rejects contradictory settings with the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from agl_lab.algorithms import (
    DIVISORS,
    SMALL_BATCH_CHOICES,
    check_divisor,
    check_estimator,
    check_selection_args,
)
from agl_lab.batch import LEVELS, check_level

# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------

# Keys AGL v1 adds to or changes in verl's ppo_trainer (upstream config.yaml).
AGL_DEFAULTS: dict[str, Any] = {
    # verl defaults to gae, which rollout-level advantage rejects; every AGL example sets grpo.
    "algorithm": {"enable_rollout_level_advantage": True, "adv_estimator": "grpo"},
    "data": {"filter_overlong_prompts": False},
    "actor_rollout_ref": {
        "actor": {"calculate_entropy": True, "policy_loss": {"loss_mode": "per_rollout_mean"}},
        "rollout": {"mode": "async"},
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "",
        "hooks": None,
        "rollout_timeout_seconds": 1800,
        "local": {"agent_class": None, "env_map": {}},
        "k8s": {"job_template_path": None},
        "reward_fillna_value": 0.0,
        "max_ppo_update_times": None,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 2048,
            "trajectory_max_response_length": 8192,
            # agl_lab: keep several open segments so interleaved sub-agent calls still merge
            "multi_segment": False,
        },
        "async_rollout": {"enabled": False, "async_train_batch_size": None},
    },
}

# The agl_lab section: what AGL leaves to separate processes (server, controller) and what we
# add (engine choice, built-in tasks, the loss divisor, bounded waits).
AGL_LAB_DEFAULTS: dict[str, Any] = {
    "agl_lab": {
        "engine": "local",  # local | verl
        "seed": 0,
        "run_dir": None,  # default: runs/<experiment_name>-<timestamp>
        "model": {
            "path": None,  # None → the built-in tiny model (built from config, cached)
            "device": None,  # None → cuda if available else cpu
            "max_model_len": 1024,
            "warm_start_steps": 0,  # supervised warm start on the task's transcripts (tiny model)
        },
        "task": {"name": "lookup", "n_train": 256, "n_val": 32},
        "server": {
            "embedded": True,  # start store + gateway in process; false → use agl_base_url
            "store": "memory",  # memory | sqlite:///path.db
            "include_log_probs": True,
            "val_temperature": 0.7,
            "token_preserving": False,
            "seed_calls": True,  # calls without a seed get one from their position: reproducible runs
        },
        "runner": {"enabled": True, "concurrency": 32, "agent_timeout_seconds": None},
        "rollout": {"wait_timeout_seconds": 600, "poll_interval_seconds": 0.05,
                    "drain_timeout_seconds": 60},
        # (not named `update`: DictConfig attribute access would hit dict.update)
        "algorithm": {
            "normalize_by": "rollouts",  # rollouts (tech report Eq. 16) | rows (AGL v1 parity)
            "small_batch": "train",  # train a batch smaller than one mini-batch | skip the step
            "exclude_failed_rollouts": False,  # true: FAILED rollouts get no rows (AGL: reward_fillna_value)
        },
        "engine_options": {"batch_window_ms": 3, "max_batch_size": 64},
        "wandb": {"mode": "disabled"},  # disabled | offline | online
    }
}

# verl sub-trees whose keys are free-form (anything goes below them).
_OPEN_PREFIXES = (
    "actor_rollout_ref.rollout.engine_kwargs",
    "actor_rollout_ref.model.override_config",
    "critic.model.override_config",
    "ray_kwargs",
    "agentlightning.local.env_map",
    "custom_reward_function",
    "reward",
    "global_profiler",
)


class ConfigError(ValueError):
    """A config key is unknown, has a bad value, or contradicts another key."""


def verl_defaults_path() -> Path:
    """verl's generated, flat `ppo_trainer` config (no Hydra composition needed)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ConfigError("verl is not installed: pip install -e '.[dev]' (it pins verl)")
    return Path(spec.origin).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"


def default_config() -> DictConfig:
    base = OmegaConf.load(verl_defaults_path())
    return OmegaConf.merge(base, AGL_DEFAULTS, AGL_LAB_DEFAULTS)


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------


def _leaf_paths(node: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(node, (DictConfig, Mapping)):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for key, value in items:
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, (DictConfig, Mapping)) and len(value) > 0:
                yield from _leaf_paths(value, path)
            else:
                yield path
    elif prefix:
        yield prefix


def _known(defaults: DictConfig, path: str) -> bool:
    if any(path == p or path.startswith(p + ".") for p in _OPEN_PREFIXES):
        return True
    node: Any = defaults
    for part in path.split("."):
        if isinstance(node, DictConfig):
            child = node._get_node(part)  # `in` is False for '???' values: ask for the node
            if child is None:
                return False
            node = child
            if isinstance(node, DictConfig) and len(node) == 0:
                return True  # an empty default dict is a free-form mapping
        else:
            return False
    return True


def check_unknown_keys(defaults: DictConfig, user: DictConfig, source: str) -> None:
    """Raise ConfigError naming every key of `user` that the defaults do not have."""
    all_known = list(_leaf_paths(defaults))
    bad = [p for p in _leaf_paths(user) if not _known(defaults, p)]
    if not bad:
        return
    lines = []
    for path in bad:
        close = difflib.get_close_matches(path, all_known, n=1, cutoff=0.75)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        lines.append(f"  unknown key '{path}' (from {source}){hint}")
    raise ConfigError("Config has unknown keys:\n" + "\n".join(lines))


def load_config(
    path: str | os.PathLike | Mapping | DictConfig | None = None,
    overrides: Iterable[str] | Mapping | None = None,
) -> DictConfig:
    """Compose defaults + a YAML file (or mapping) + `key=value` overrides, then validate.

    >>> cfg = load_config("configs/cpu_tiny.yaml", ["data.train_batch_size=8"])
    """
    cfg = default_config()
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        if isinstance(path, (str, os.PathLike)):
            if not Path(path).exists():
                raise ConfigError(f"config file not found: {path}")
            layers.append((str(path), OmegaConf.load(path)))
        else:
            layers.append(("the config mapping", OmegaConf.create(dict(path))))
    if overrides:
        if isinstance(overrides, Mapping):
            layers.append(("overrides", OmegaConf.create(dict(overrides))))
        else:
            overrides = list(overrides)
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(f"override {item!r} is not key=value (e.g. data.train_batch_size=8)")
            layers.append(("command-line overrides", OmegaConf.from_dotlist(overrides)))
    for source, layer in layers:
        check_unknown_keys(cfg, layer, source)
        cfg = OmegaConf.merge(cfg, layer)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Validation: contradictions, with the fix
# ---------------------------------------------------------------------------------------------

# Allowed values. The learning rules' tuples and checks live in the pure modules that apply
# them (batch, algorithms); `validate` calls those checks, so each rule has one message.
ENGINES = ("local", "verl")
WANDB_MODES = ("disabled", "offline", "online")
CHOICES = {
    "agl_lab.engine": ENGINES,
    "agl_lab.wandb.mode": WANDB_MODES,
    "agl_lab.algorithm.normalize_by": DIVISORS,
    "agl_lab.algorithm.small_batch": SMALL_BATCH_CHOICES,
    "agentlightning.trace_aggregator.level": LEVELS,
}


def validate(cfg: DictConfig) -> None:
    for key in ("agl_lab.engine", "agl_lab.wandb.mode"):
        value = OmegaConf.select(cfg, key)
        if value not in CHOICES[key]:
            raise ConfigError(f"{key}={value!r} is not one of {list(CHOICES[key])}")
    if cfg.actor_rollout_ref.rollout.n < 1:
        raise ConfigError("actor_rollout_ref.rollout.n must be >= 1 (the GRPO group size)")
    try:
        _check_learning_rules(cfg)
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None
    agl = cfg.agentlightning
    if agl.async_rollout.enabled:
        a, b = agl.async_rollout.async_train_batch_size, cfg.data.train_batch_size
        if a is None or a <= b:
            raise ConfigError(
                f"agentlightning.async_rollout.async_train_batch_size ({a}) must be > "
                f"data.train_batch_size ({b}) when async_rollout.enabled=true; "
                f"AGL recommends 2 × train_batch_size (e.g. {2 * b})"
            )
    rc = cfg.algorithm.get("rollout_correction") or {}
    if rc.get("bypass_mode") and not cfg.agl_lab.server.include_log_probs:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true needs sampling logprobs: "
            "set agl_lab.server.include_log_probs=true"
        )


def _check_learning_rules(cfg: DictConfig) -> None:
    """The checks of the modules that apply the rules (their ValueError names the config key)."""
    check_level(cfg.agentlightning.trace_aggregator.level)
    check_divisor(cfg.agl_lab.algorithm.normalize_by)
    check_estimator(cfg.algorithm.adv_estimator, rollout_level=bool(cfg.algorithm.enable_rollout_level_advantage))
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    max_updates = cfg.agentlightning.max_ppo_update_times
    check_selection_args(int(mini or 0) * int(n), None if max_updates is None else int(max_updates),
                         small_batch=str(cfg.agl_lab.algorithm.small_batch))


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def trace_limits(cfg: DictConfig, level: str | None = None) -> tuple[int, int]:
    """(max_prompt_length, max_response_length) for the batch builder at `level` (default: the
    configured level), as AGL picks them: trajectory limits for trajectory, `data.*` otherwise."""
    ta = cfg.agentlightning.trace_aggregator
    if str(level or ta.level).startswith("trajectory"):
        return int(ta.trajectory_max_prompt_length), int(ta.trajectory_max_response_length)
    return int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)


def as_listconfig_free(value: Any) -> Any:
    """Plain Python value of a config node (lists and dicts resolved)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
