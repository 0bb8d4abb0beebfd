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

import copy
import difflib
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from agl_lab import config_keys, rules
from agl_lab.config_keys import ConfigWarning, check_values, user_keys, warn_ineffective  # noqa: F401 (re-export)
from agl_lab.rules import (
    DIVISORS,
    DROP_ORDERS,
    LEVELS,
    SMALL_BATCH_CHOICES,
    TURN_CREDITS,
    check_async_sizes,
    check_divisor,
    check_drop_order,
    check_estimator,
    check_level,
    check_selection_args,
    check_turn_credit,
)
from agl_lab.server.config import LIMITS

# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------

# Keys AGL v1 adds to or changes in verl's ppo_trainer (upstream config.yaml).
AGL_DEFAULTS: dict[str, Any] = {
    # verl defaults to gae, which rollout-level advantage rejects; every AGL example sets grpo.
    "algorithm": {"enable_rollout_level_advantage": True, "adv_estimator": "grpo"},
    # agl_lab: verl defaults to [console, wandb]; a CPU run should not start W&B unasked
    "trainer": {"logger": ["console"]},
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

# agl_lab.server keys handed to the embedded server's ServerConfig as they are (when not null):
# its limits (listed once, in server/config.py) and the upstream client.
SERVER_PASSTHROUGH = (*LIMITS, "upstream_client")


def server_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The agl_lab.server limits the user set (not null), as ServerConfig keyword arguments."""
    server = cfg.agl_lab.server
    return {
        key: OmegaConf.to_object(server[key]) if OmegaConf.is_config(server[key]) else server[key]
        for key in SERVER_PASSTHROUGH
        if server.get(key) is not None
    }


# The agl_lab section: what AGL leaves to separate processes (server, controller) and what we
# add (engine choice, built-in tasks, the loss divisor, bounded waits).
AGL_LAB_DEFAULTS: dict[str, Any] = {
    "agl_lab": {
        "engine": "local",  # local | verl
        # verl engine device: auto → CUDA if present, else verl's real workers on CPU through
        # agl_lab's CPU platform (agl_lab/engines/verl/cpu.py); cpu | cuda force one
        # placement_timeout_seconds: longest wait for verl's placement groups (a clear error, never a hang)
        "verl": {"device": "auto", "placement_timeout_seconds": 120.0},
        "seed": 0,
        # torch intra-op threads: auto = 1 on ≤ 4 cores (torch's default collapses on a shared
        # machine, docs/engines.md "Torch threads"), else half the cores; a number; null = torch's default
        "torch_threads": "auto",
        "run_dir": None,  # default: runs/<experiment_name>-<timestamp>
        "model": {
            "path": None,  # None → the built-in tiny model (built from config, cached)
            "preset": None,  # e.g. smollm2-135m: a real model from PyPI (agl_lab/models.py), instead of path
            "device": None,  # None → cuda if available else cpu
            "max_model_len": rules.MAX_MODEL_LEN,
            "warm_start_steps": 0,  # supervised warm start on the task's transcripts (tiny model)
            # CPU: null/float32, or bfloat16 — the matrix products in bfloat16 over float32 weights
            # (~2× faster products, engine-vs-trainer logprob gaps up to ~0.3: agl_lab/engines/precision.py)
            "compute_dtype": None,
        },
        # name: built-in, registered, module:attr, reasoning_gym:<dataset> or gem:<env id>
        # (docs/environments.md: size = the generator's entries, null: n_train; seed null: agl_lab.seed;
        # config = the dataset's or environment's own keys; max_turns: model calls per GEM episode)
        "task": {
            "name": "lookup",
            "n_train": 256,
            "n_val": 32,
            "size": None,
            "seed": None,
            "config": {},
            "max_turns": 8,
            "tools": [],  # reasoning_gym:<dataset> only: [calculator] offers calc's calculator tool
        },
        "agent": None,  # "module:function" agent(task, ctx) → overrides the task's agent (CLI)
        "server": {
            "embedded": True,  # start store + gateway in process; false → use agl_base_url
            # the embedded server binds `host` and hands out `advertise_host` in its URL (null: the
            # bind host; a wildcard such as 0.0.0.0 advertises this machine's address) — addresses.py
            "host": "127.0.0.1",
            "port": 0,  # 0: a free port (agl-lab train prints the URL); set it for runners on other hosts
            "advertise_host": None,
            "store": "memory",  # memory | sqlite:///path.db | postgresql://user:pass@host:5432/db
            "include_log_probs": True,
            "val_temperature": 0.7,
            "token_preserving": False,
            "seed_calls": True,  # calls without a seed get one from their position: reproducible runs
            # the embedded server's limits and upstream retry policy (ServerConfig, docs/robustness.md);
            # null keeps the server's own default
            **{key: None for key in SERVER_PASSTHROUGH},
        },
        # the engine's OpenAI servers (the local engine's; the verl CPU replicas', one per Ray node):
        # the host they bind and the one their registered endpoints name. null host: loopback (the
        # CPU replicas: their Ray node IP when the cluster's nodes are on several machines);
        # "node_ip" (CPU replicas): the worker's Ray node IP; advertise_host null: the bind host
        "serving": {"host": None, "advertise_host": None},
        "runner": {"enabled": True, "concurrency": 32, "agent_timeout_seconds": None},
        # wait_timeout_seconds: "auto" = agentlightning.rollout_timeout_seconds + 60 s (every
        # rollout ends by its own timeout first); a number; or null = unbounded (AGL v1)
        # keep_repeated_prompts: false = AGL v1's triplet reduction (the last call per distinct prompt;
        # the dropped ones are counted: training/n_repeated_prompt_calls_dropped); true keeps every call
        "rollout": {
            "wait_timeout_seconds": "auto",
            "poll_interval_seconds": 0.05,
            "drain_timeout_seconds": 60,
            "keep_repeated_prompts": False,
            # max_staleness: policy versions a trained token may lag (0 = the synchronous loop; N > 0:
            # generation overlaps the update, local engine; docs/engines.md "Overlap");
            # stale_groups: drop | wait — a group that would exceed it (docs/configs.md)
            "max_staleness": 0,
            "stale_groups": "drop",
        },
        # (not named `update`: DictConfig attribute access would hit dict.update)
        "algorithm": {
            "normalize_by": "rollouts",  # rollouts (tech report Eq. 16) | rows (AGL v1 parity)
            "small_batch": "train",  # train a batch smaller than one mini-batch | skip the step
            "exclude_failed_rollouts": False,  # true: FAILED rollouts get no rows (AGL: reward_fillna_value)
            "max_abs_reward": 1.0e6,  # a rollout with a larger |reward| fails alone (learnable.learning_problem)
            # rollout: every row the rollout's reward | return: each transition its discounted return of
            # turn rewards, G_t = r_t + turn_gamma·G_{t+1} (algorithms/credit.py, docs/environments.md)
            "turn_credit": "rollout",
            "turn_gamma": 1.0,
            # local engine: micro-batches of zero-advantage rows are not forwarded, exactly (the
            # optimiser step still runs); applied only where exact: no entropy/KL term, a row-separable loss
            "skip_zero_advantage": True,
        },
        # Parity switches: reproduce AGL v1's numbers for side-by-side runs (the defaults are
        # agl_lab's deliberate improvements; agl_lab.algorithm.normalize_by=rows is the third)
        "parity": {
            "bf16_rewards": False,  # AGL stores token_level_scores in bfloat16
            # verl's float32 GRPO statistics (equal-reward groups can get ±0.007, not 0); default:
            # float64 statistics, equal-reward groups exactly 0 (docs/research.md)
            "grpo_float32": False,
            "drop_order": "after_advantage",  # agl: AGL's row-level alignment before advantages
        },
        # batch_invariant: a request's numbers independent of its batch-mates, so a seed is one run
        # on any load (docs/engines.md#one-seed-one-run-on-any-load)
        "engine_options": {
            "batch_invariant": False,
            "batch_window_ms": rules.BATCH_WINDOW_MS,
            "max_batch_size": rules.MAX_BATCH_SIZE,
            # the decode loop's intra-op threads; auto: torch_threads's count (also under overlap,
            # where the decode and the update share the cores: half of them measured slower)
            "decode_threads": "auto",
        },
        # every step's rollouts and results → run_dir/recording/ (agl_lab.replay: replay any step);
        # max_steps: keep the newest N (null: all); events: false leaves the raw events out
        "record": {"enabled": True, "max_steps": None, "events": True},
        # null: offline when trainer.logger has wandb, else off; offline | online | disabled win
        "wandb": {"mode": None},
    }
}

# verl sub-trees whose keys are free-form (anything goes below them).
_OPEN_PREFIXES = (
    "actor_rollout_ref.rollout.engine_kwargs",
    "actor_rollout_ref.rollout.enable_sleep_mode",  # verl's RolloutConfig field (default true), not in its yaml
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision",  # verl's FSDPEngineConfig dict (not in its yaml)
    "actor_rollout_ref.ref.fsdp_config.mixed_precision",
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
    if refused := config_keys.refused_async_keys(bad, source):  # verl's async trainers' keys (#50 item 5)
        raise ConfigError("\n".join(refused))
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
    >>> cfg = load_config("cpu_tiny")  # a shipped preset by name, from any working directory
    """
    from agl_lab.presets import find_config

    cfg = default_config()
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        if isinstance(path, (str, os.PathLike)):
            try:  # a path, or a preset name (agl_lab.presets: from any working directory)
                path = find_config(path)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
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
    defaults, keys = cfg, []
    for source, layer in layers:
        check_unknown_keys(cfg, layer, source)
        cfg = OmegaConf.merge(cfg, layer)
        keys += user_keys(layer)
    keys = list(dict.fromkeys(keys))
    problems = check_values(cfg, defaults, keys)
    if problems:
        raise ConfigError("Config has values of the wrong type or range:\n" + "\n".join(f"  {p}" for p in problems))
    _adopt_model_path(cfg, keys)
    validate(cfg)
    warn_ineffective(cfg, defaults, keys)
    return cfg


def _adopt_model_path(cfg: DictConfig, keys: list[str]) -> None:
    """An AGL config names its model in `actor_rollout_ref.model.path`: the local engine serves
    and trains that model (a local HF directory), never silently the built-in tiny one."""
    if "actor_rollout_ref.model.path" not in keys:
        return
    actor_path, lab_path = cfg.actor_rollout_ref.model.path, cfg.agl_lab.model.path
    if lab_path is None:
        cfg.agl_lab.model.path = actor_path
    elif str(lab_path) != str(actor_path):
        raise ConfigError(
            f"actor_rollout_ref.model.path={actor_path!r} and agl_lab.model.path={lab_path!r} "
            "name different models: set one of them"
        )


# ---------------------------------------------------------------------------------------------
# Validation: contradictions, with the fix
# ---------------------------------------------------------------------------------------------

# Allowed values. The learning rules' tuples and checks live in the pure `agl_lab.rules`; the
# modules that apply a rule (batch, algorithms, rollout, update) and `validate` call the same
# check, so each rule has one message.
ENGINES = ("local", "verl")
WANDB_MODES = (None, "disabled", "offline", "online")
CHOICES = {
    "agl_lab.engine": ENGINES,
    "agl_lab.verl.device": ("auto", "cpu", "cuda"),
    "agl_lab.wandb.mode": WANDB_MODES,
    "agl_lab.algorithm.normalize_by": DIVISORS,
    "agl_lab.algorithm.small_batch": SMALL_BATCH_CHOICES,
    "agl_lab.algorithm.turn_credit": TURN_CREDITS,
    "agl_lab.parity.drop_order": DROP_ORDERS,
    "agentlightning.trace_aggregator.level": LEVELS,
}


def load_saved_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> DictConfig:
    """A run's or checkpoint's saved `config.yaml` (already composed), with `key=value` overrides
    checked against it, then validated. Keys added to agl_lab since the run was saved take their
    current defaults (a recording made before `agl_lab.server.host` existed still replays); every
    key the run saved keeps its saved value."""
    cfg = OmegaConf.merge(default_config(), OmegaConf.load(path))
    unredact(cfg)  # the saved key is "<redacted>": pass agentlightning.agl_key in overrides
    if overrides:
        layer = OmegaConf.from_dotlist(list(overrides))
        check_unknown_keys(cfg, layer, "overrides")
        cfg = OmegaConf.merge(cfg, layer)
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    for key in ("agl_lab.engine", "agl_lab.verl.device", "agl_lab.wandb.mode"):
        value = OmegaConf.select(cfg, key)
        if value not in CHOICES[key]:
            raise ConfigError(f"{key}={value!r} is not one of {list(CHOICES[key])}")
    unknown = [n for n in logger_names(cfg) if n not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"trainer.logger has {unknown}, which agl_lab does not write; accepted values: "
            f"{list(LOGGERS)} (metrics.jsonl is always written)"
        )
    keep = cfg.trainer.get("max_actor_ckpt_to_keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
        raise ConfigError(
            f"trainer.max_actor_ckpt_to_keep={keep!r}: use null or 0 (keep every checkpoint, "
            "verl's rule) or N > 0 (keep the newest N this run saved)"
        )
    if cfg.actor_rollout_ref.rollout.n < 1:
        raise ConfigError("actor_rollout_ref.rollout.n must be >= 1 (the GRPO group size)")
    try:
        _check_learning_rules(cfg)
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None
    agl = cfg.agentlightning
    wait = cfg.agl_lab.rollout.wait_timeout_seconds
    if (
        wait is not None
        and wait != "auto"
        and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait <= 0)
    ):
        raise ConfigError(
            f"agl_lab.rollout.wait_timeout_seconds={wait!r}: use auto, a number of seconds > 0, or null (unbounded)"
        )
    rollout_timeout = float(agl.rollout_timeout_seconds)
    if isinstance(wait, (int, float)) and wait < rollout_timeout:
        import warnings

        warnings.warn(
            f"agl_lab.rollout.wait_timeout_seconds={wait} is shorter than "
            f"agentlightning.rollout_timeout_seconds={rollout_timeout:g}: a step can time out "
            "while its rollouts may still legitimately run; use auto (rollout timeout + 60 s)",
            ConfigWarning,
            stacklevel=3,
        )
    lease = cfg.agl_lab.server.get("lease_seconds")
    if (
        isinstance(lease, (int, float))
        and lease
        and rollout_wait_timeout(cfg) is not None
        and lease >= rollout_wait_timeout(cfg)
    ):
        import warnings

        warnings.warn(
            f"agl_lab.server.lease_seconds={lease:g} is not below the trainer's rollout wait "
            f"({rollout_wait_timeout(cfg):g} s, agl_lab.rollout.wait_timeout_seconds): a dead runner's "
            "rollouts would not run again before the step gives up on them; lower the lease",
            ConfigWarning,
            stacklevel=3,
        )
    model = cfg.agl_lab.model
    if model.get("preset") is not None:
        from agl_lab.models import PRESETS

        if model.preset not in PRESETS:
            raise ConfigError(f"agl_lab.model.preset={model.preset!r} is not one of {sorted(PRESETS)}")
        if model.path is not None:
            raise ConfigError("set agl_lab.model.path or agl_lab.model.preset, not both (the preset is a path)")
    _check_server_overrides(cfg)
    _check_hosts(cfg)
    if rules.uses_bypass(cfg.algorithm.get("rollout_correction")) and not cfg.agl_lab.server.include_log_probs:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true needs sampling logprobs: "
            "set agl_lab.server.include_log_probs=true"
        )


HOST_KEYS = (
    "agl_lab.server.host",
    "agl_lab.server.advertise_host",
    "agl_lab.serving.host",
    "agl_lab.serving.advertise_host",
)


def _check_hosts(cfg: DictConfig) -> None:
    """Bind/advertise hosts are host names or IP literals (agl_lab/addresses.py), not numbers or URLs;
    `agl_lab.server.port` is a TCP port or 0 (a free one)."""
    port = OmegaConf.select(cfg, "agl_lab.server.port", default=0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"agl_lab.server.port={port!r} must be a TCP port 1-65535, or 0 for a free one")
    for key in HOST_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None and key != "agl_lab.server.host":
            continue
        if not isinstance(value, str) or not value or "/" in value or " " in value:
            raise ConfigError(
                f"{key}={value!r} must be a host name or IP address (e.g. 127.0.0.1, 0.0.0.0, "
                "10.0.0.5; no scheme or port)" + ("" if key != "agl_lab.server.host" else "; the default is 127.0.0.1")
            )


def _check_server_overrides(cfg: DictConfig) -> None:
    """The embedded server would refuse these at start-up: refuse them now, naming the key."""
    overrides = server_overrides(cfg)
    if not overrides:
        return
    from pydantic import ValidationError

    from agl_lab.server.config import ServerConfig

    try:
        ServerConfig.model_validate(overrides)
    except ValidationError as err:
        problems = "; ".join(
            f"agl_lab.server.{'.'.join(str(p) for p in e['loc'])}={e.get('input')!r}: {e['msg']}" for e in err.errors()
        )
        raise ConfigError(f"{problems} (docs/robustness.md describes each server limit)") from None


def _check_learning_rules(cfg: DictConfig) -> None:
    """The rules of `agl_lab.rules`, which the modules that apply them call too (their ValueError
    names the config key)."""
    import warnings

    check_level(cfg.agentlightning.trace_aggregator.level)
    check_drop_order(cfg.agl_lab.parity.drop_order)
    check_divisor(cfg.agl_lab.algorithm.normalize_by)
    check_turn_credit(
        str(cfg.agl_lab.algorithm.turn_credit),
        float(cfg.agl_lab.algorithm.turn_gamma),
        str(cfg.agentlightning.trace_aggregator.level),
        bool(cfg.algorithm.enable_rollout_level_advantage),
    )
    check_estimator(cfg.algorithm.adv_estimator, rollout_level=bool(cfg.algorithm.enable_rollout_level_advantage))
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    max_updates = cfg.agentlightning.max_ppo_update_times
    check_selection_args(
        rules.mini_batch_rows(mini or 0, n),
        None if max_updates is None else int(max_updates),
        small_batch=str(cfg.agl_lab.algorithm.small_batch),
    )
    staleness = rules.check_overlap(
        cfg.agl_lab.rollout.max_staleness,
        str(cfg.agl_lab.rollout.stale_groups),
        engine=str(cfg.agl_lab.engine),
        async_enabled=bool(cfg.agentlightning.async_rollout.enabled),
    )
    if cfg.agentlightning.async_rollout.enabled:
        buffer = cfg.agentlightning.async_rollout.async_train_batch_size
        check_async_sizes(cfg.data.train_batch_size, buffer, staleness)
        if excess := rules.overlap_buffer_excess(int(cfg.data.train_batch_size), int(buffer), staleness):
            warnings.warn(excess, ConfigWarning, stacklevel=2)
    rc = OmegaConf.select(cfg, "algorithm.rollout_correction", default=None)
    if staleness and not rules.uses_bypass(rc) and not (rc or {}).get("rollout_is"):
        warnings.warn(
            f"agl_lab.rollout.max_staleness={staleness}: stale tokens train against old logprobs recomputed "
            "under the current weights, with no correction for the policy that sampled them; set "
            "algorithm.rollout_correction.bypass_mode=true (the sampling logprobs are the behaviour policy) "
            "or algorithm.rollout_correction.rollout_is=token (decoupled PPO)",
            ConfigWarning,
            stacklevel=2,
        )


def check_validation_tasks(cfg: DictConfig, n_val_tasks: int) -> None:
    """`config_keys.check_validation_tasks` (the Trainer knows the tasks), failing as ConfigError."""
    try:
        config_keys.check_validation_tasks(cfg, n_val_tasks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def rollout_wait_timeout(cfg: DictConfig) -> float | None:
    """Seconds a rollout phase waits for its rollouts (None = unbounded); see the agl_lab defaults."""
    wait = cfg.agl_lab.rollout.wait_timeout_seconds
    if wait == "auto":
        return float(cfg.agentlightning.rollout_timeout_seconds) + 60.0
    return None if wait is None else float(wait)


#: `trainer.logger` entries agl_lab writes (verl's names; `metrics.jsonl` is always written)
LOGGERS = ("console", "wandb", "tensorboard")


def logger_names(cfg: DictConfig) -> list[str]:
    """`trainer.logger` as a list (verl accepts one name or a list)."""
    names = cfg.trainer.logger
    return [str(names)] if isinstance(names, str) else [str(n) for n in (names or [])]


def loggers(cfg: DictConfig) -> tuple[bool, str, bool]:
    """(console on?, W&B mode, tensorboard on?) from `trainer.logger` (verl) and `agl_lab.wandb.mode`."""
    names = logger_names(cfg)
    mode = cfg.agl_lab.wandb.mode
    if mode is None:
        mode = "offline" if "wandb" in names else "disabled"
    return "console" in names, str(mode), "tensorboard" in names


def task_files(cfg: DictConfig) -> tuple[Any, Any]:
    """(`data.train_files`, `data.val_files`), each None while it is verl's placeholder default
    (`~/data/rlhf/gsm8k/*.parquet`) or null: then the Trainer uses its built-in task."""
    placeholder = OmegaConf.load(verl_defaults_path()).data
    out = []
    for key in ("train_files", "val_files"):
        value = cfg.data.get(key)
        out.append(None if value is None or value == placeholder.get(key) else as_listconfig_free(value))
    return out[0], out[1]


def env_map_columns(cfg: DictConfig) -> list[str]:
    """Task fields an AGL env_map reads (`input.question` → `question`): every task needs them."""
    env_map = as_listconfig_free(cfg.agentlightning.local.env_map) or {}
    return sorted({str(v).split(".")[1] for v in env_map.values() if str(v).startswith("input.")})


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python, secrets redacted (`redact_secrets`): what W&B gets."""
    return redact_secrets(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[return-value]


# Config keys whose values are secrets: never written (config.yaml of a run or a checkpoint, W&B).
SECRET_KEYS = ("agentlightning.agl_key",)
REDACTED = "<redacted>"


def redact_secrets(cfg: Any) -> Any:
    """A copy of `cfg` (DictConfig or dict) with each set SECRET_KEYS value replaced by REDACTED.
    An interpolation (`${oc.env:AGL_KEY}`) is kept: it names where the secret is, not the secret."""
    is_config = isinstance(cfg, DictConfig)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)) if is_config else copy.deepcopy(cfg)
    for path in SECRET_KEYS:
        parent_path, _, leaf = path.rpartition(".")
        parent = OmegaConf.select(out, parent_path) if is_config else _dict_at(out, parent_path)
        if parent is None or leaf not in parent:
            continue
        raw = parent._get_node(leaf)._value() if is_config else parent[leaf]  # type: ignore[union-attr]
        if raw and not (isinstance(raw, str) and raw.startswith("${")):
            parent[leaf] = REDACTED
    return out


def _dict_at(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def unredact(cfg: DictConfig) -> list[str]:
    """Blank the redacted secrets of a config read back from a run or checkpoint (an embedded
    server then gets a fresh key); returns their keys, so the caller can say to pass them again."""
    blanked = []
    for path in SECRET_KEYS:
        if OmegaConf.select(cfg, path, default=None) == REDACTED:
            OmegaConf.update(cfg, path, "")
            blanked.append(path)
    return blanked


def trace_limits(cfg: DictConfig, level: str | None = None) -> tuple[int, int]:
    """(max_prompt_length, max_response_length) for the batch builder at `level` (default: the
    configured level), as AGL picks them: trajectory limits for trajectory, `data.*` otherwise."""
    ta = cfg.agentlightning.trace_aggregator
    if str(level or ta.level).startswith("trajectory"):
        return int(ta.trajectory_max_prompt_length), int(ta.trajectory_max_response_length)
    return int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)


# ---------------------------------------------------------------------------------------------
# What each stage reads from the config (one owner: the Trainer, replay and what-if call these)
# ---------------------------------------------------------------------------------------------


def batch_options(cfg: DictConfig, level: str | None = None) -> dict[str, Any]:
    """`agl_lab.batch.build_batch` keyword arguments from the composed config, for `level`
    (default: `agentlightning.trace_aggregator.level`). The caller adds what the run has, not
    the config: `tokenizer` and `pad_token_id`."""
    agl = cfg.agentlightning
    level = str(level or agl.trace_aggregator.level)
    max_prompt, max_response = trace_limits(cfg, level)
    return dict(
        level=level,
        max_prompt_length=max_prompt,
        max_response_length=max_response,
        reward_fillna_value=float(agl.reward_fillna_value),
        multi_segment=bool(agl.trace_aggregator.multi_segment),
        exclude_failed=bool(cfg.agl_lab.algorithm.exclude_failed_rollouts),
        turn_credit=str(cfg.agl_lab.algorithm.turn_credit),
        turn_gamma=float(cfg.agl_lab.algorithm.turn_gamma),
    )


def update_options(cfg: DictConfig) -> dict[str, Any]:
    """`agl_lab.algorithms.prepare_update_batch` keyword arguments from the composed config."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    n = int(cfg.actor_rollout_ref.rollout.n)
    max_updates = cfg.agentlightning.max_ppo_update_times
    return dict(
        mini_batch_rows=rules.mini_batch_rows(actor.ppo_mini_batch_size, n),
        adv_estimator=str(algo.adv_estimator),
        gamma=float(algo.gamma),
        lam=float(algo.lam),
        num_repeat=n,
        norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo),
        rollout_level_advantage=bool(algo.enable_rollout_level_advantage),
        algo_config=algo,
        max_ppo_update_times=None if max_updates is None else int(max_updates),
        small_batch=str(cfg.agl_lab.algorithm.small_batch),
        loss_mode=str(actor.policy_loss.loss_mode),
        divisor=str(cfg.agl_lab.algorithm.normalize_by),
        drop_order=str(cfg.agl_lab.parity.drop_order),
        bf16_rewards=bool(cfg.agl_lab.parity.bf16_rewards),
        grpo_float32=bool(cfg.agl_lab.parity.grpo_float32),
    )


def as_listconfig_free(value: Any) -> Any:
    """Plain Python value of a config node (lists and dicts resolved)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
