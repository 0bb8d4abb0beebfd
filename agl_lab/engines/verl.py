"""The verl engine: verl 0.9.1's RayPPOTrainer worker groups + vLLM replicas on Ray.

`VerlEngine` implements the `Engine` contract (agl_lab/engines/base.py) on top of
`AglRayPPOTrainer` (agl_lab/engines/verl_trainer.py), a `RayPPOTrainer` whose monolithic
`fit()` is cut into phases that the stepwise `agl_lab.Trainer` calls one by one. verl's own
agent loop never runs: rollouts come from agents through the agl_lab gateway, which calls
the vLLM replicas' OpenAI servers.

Why verl's *legacy* `RayPPOTrainer` and not the V1 trainer that 0.9.1 defaults to
(`trainer.use_v1: true`)? V1 (verl/trainer/ppo/v1) needs the TransferQueue package and
owns the whole loop behind `fit(agent_loop_manager)`; the legacy trainer is a plain
single-controller object whose worker-group calls we can make one at a time from a
notebook. It is marked deprecated (a FutureWarning at construction, silenced) but complete
in 0.9.1; the contract test fails loudly the day it changes or goes away.

## Phase order of one training step: who calls what, and what runs underneath

 1. register endpoints — the Trainer deletes stale models, then registers
    `engine.endpoints()` with `engine.policy_version`
    ← `LLMServerManager.get_addresses()` as `http://addr/v1`
 2. resume generation — `engine.resume()`
    ← weights pushed first if the replicas sleep; `RolloutReplica.resume_generation()` on
      every replica, concurrently
 3. rollout managers — `agl_lab.rollout` (engine-independent)
 4. sync: abort residual requests — `engine.abort() -> int`
    ← `RolloutReplica.abort_all_requests()` concurrently (vLLM `AsyncLLM.pause_generation`)
    async: pause-and-drain the gateway with a bounded wait — the Trainer, not the engine
 5. sleep replicas — `engine.pause()` ← `CheckpointEngineManager.sleep_replicas()`
    (in-flight requests drain, weights and KV cache are freed for FSDP)
 6. old logprobs (or bypass with finite `rollout_log_probs`), ref logprobs, values,
    KL-in-reward, rollout correction — `engine.prepare(batch) -> (batch, metrics)`
    ← `_compute_old_log_prob`, `_compute_ref_log_prob`, `_compute_values` (batch padded to
      the DP size), `apply_kl_penalty`, `compute_rollout_correction_and_add_to_batch`
 7. rollout-level advantage — `agl_lab.algorithms` (pure, in the Trainer)
 8. per-rollout normalisation — `agl_lab.algorithms` (pure, in the Trainer)
 9. critic/actor update — `engine.update(batch) -> metrics`
    ← zero-weight padding to whole mini-batches, `_balance_batch`, `_update_critic`,
      `_update_actor`, `reduce_metrics`
10. push weights — `engine.sync_weights()` ← `CheckpointEngineManager.update_weights(global_steps)`

Step 4 is load-bearing (AGL #589/#590: with verl 0.7 + vLLM 0.8.5 `abort_all_requests`
silently did nothing and orphaned generations ran into the FSDP update → CUDA illegal memory
access). Here `abort()` returns the number of aborted requests summed over replicas, so a
no-op abort is visible, and the contract test checks the vLLM methods verl calls for it.
In sync mode every rollout is terminal when `abort()` runs and the gateway refuses calls of
terminal rollouts (409), so only a call admitted just before its rollout ended can reach a
replica after the abort: verl parks it (`reject_request=False`) until the next resume.

Replica state machine (checkpoint backend `naive`, the default hybrid engine):
`init_workers` leaves replicas asleep → `sync_weights` wakes them with the trained weights
→ `abort`/`resume` gate generation → `pause` sleeps them again. `resume()` on sleeping
replicas pushes weights first (serving weights must equal trained weights), and
`policy_version` is the global step the served weights were trained to.

## The verl symbols the engine uses: `VERL_API` (one table, read by the engine and the test)

Every verl/vLLM class, function, method and instance attribute the engine touches is a row
of `VERL_API`, keyed by its qualified name; engine code imports verl only through
`verl_import(key)` and calls replica coroutines only through `call_replicas(…, key)`, and
tests/test_verl_contract.py checks each row against the installed packages (import,
`inspect.signature` parameter names in order, no new required parameter, instance
attributes, source words) and the engine's source against the table (no verl import
outside it), so a verl upgrade fails loudly in tests, not in the middle of a GPU run.
`VERL_CONFIG_KEYS` lists the keys of verl's generated `ppo_trainer.yaml` the engine reads.

This module imports neither verl, torch, Ray nor vLLM at import time (CPU-safe and cheap);
`VerlEngine(cfg, train_dataset=…)` builds the stack lazily.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl_lab.engines.base import Engine

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

_ROWS: tuple[VerlSymbol, ...] = (
    # --- the trainer we subclass, and the phases we call on it ----------------------------
    _row(_RT + "RayPPOTrainer", "config", "tokenizer", "role_worker_mapping", "resource_pool_manager",
         "ray_worker_group_cls", "processor", "train_dataset", "val_dataset", "collate_fn", "train_sampler",
         attrs=("config", "actor_rollout_wg", "llm_server_manager", "checkpoint_manager", "use_critic",
                "use_reference_policy", "kl_ctrl_in_reward", "global_steps")),
    _row(_RT + "RayPPOTrainer.init_workers"),                      # FSDP workers + vLLM replicas, asleep
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
    _row(_RT + "compute_response_mask", "data"),
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
    _row(_DS + "RLHFDataset._download"),                  # overridden by InMemoryDataset: no file copy
    _row(_DS + "RLHFDataset._read_files_and_tokenize"),   # overridden: rows come from memory
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
    _row("verl.trainer.ppo.rollout_corr_helper:compute_rollout_correction_and_add_to_batch",
         "batch", "rollout_corr_config"),
    _row("verl.utils.debug.metrics:calculate_debug_metrics", "data"),  # training vs rollout logprobs
    _row("verl.trainer.ppo.core_algos:agg_loss", "loss_mat", "loss_mask", "loss_agg_mode", "loss_scale_factor"),
    _row("verl.utils.metric:reduce_metrics", "metrics"),
    _row("verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path", "path"),
    _row("verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY"),  # per_rollout_mean lands here, per worker
    _row("verl.trainer.ppo.core_algos:get_policy_loss_fn", "name"),  # how the actor resolves loss_mode
    # --- vLLM: what verl's replica calls under abort/resume/sleep (AGL #589/#590) -----------
    _row(_VS + ".abort_all_requests", "reject_request", returns="aborted_count", needs_vllm=True),
    _row(_VS + ".resume_generation", needs_vllm=True),
    _row(_VS + ".sleep", needs_vllm=True),
    _row(_LLM + ".pause_generation", "wait_for_inflight_requests", "clear_cache", needs_vllm=True),
    _row(_LLM + ".resume_generation", needs_vllm=True),
    _row(_LLM + ".wait_for_requests_to_drain", needs_vllm=True),
    _row(_LLM + ".sleep", "level", needs_vllm=True),
    _row(_LLM + ".wake_up", "tags", needs_vllm=True),
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

#: Ray runs this in every worker process; importing agl_lab.algorithms registers the loss
WORKER_SETUP_HOOK = "agl_lab.algorithms.register_in_worker"


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
        raise KeyError(f"{key!r} is not in agl_lab.engines.verl.VERL_API: add a row "
                       "(the contract test then checks it against the installed verl)") from None
    return _resolve(symbol)


def method_name(key: str) -> str:
    """The bare method name of a `Class.method` row (used to call it on live objects)."""
    return VERL_API[key].qualname.rsplit(".", 1)[-1]


def check_symbol(symbol: VerlSymbol) -> list[str]:
    """Problems of one row against the installed packages ([] when it is compatible)."""
    try:
        obj = _resolve(symbol)
    except (ImportError, AttributeError) as exc:
        return [f"{symbol.path}: cannot import ({exc})"]
    problems: list[str] = []
    if symbol.params or callable(obj):
        problems += _check_params(symbol, obj)
    if symbol.attrs or symbol.returns:
        source = inspect.getsource(obj)
        problems += [f"{symbol.path}: no `self.{a} =` in its source"
                     for a in symbol.attrs if f"self.{a} =" not in source]
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
    new_required = [n for n, p in sig.parameters.items()
                    if n not in ("self", "cls", *symbol.params)
                    and p.kind not in variadic and p.default is inspect.Parameter.empty]
    if new_required:
        problems.append(f"{symbol.path}: new required parameters {new_required}")
    return problems


def check_verl_api(include_vllm: bool | None = None) -> list[str]:
    """All problems of `VERL_API` (vLLM rows only when vLLM is importable, unless forced)."""
    if include_vllm is None:
        include_vllm = importlib.util.find_spec("vllm") is not None
    problems: list[str] = []
    for symbol in VERL_API.values():
        if symbol.needs_vllm and not include_vllm:
            continue
        problems += check_symbol(symbol)
    return problems


# ------------------------------------------------------------------------------------------
# Ray start-up
# ------------------------------------------------------------------------------------------


def init_ray(config: Any) -> bool:
    """Start Ray so that every worker process registers agl_lab's policy loss.

    runtime_env = verl's default PPO runtime env (`get_ppo_ray_runtime_env`) overlaid with
    `ray_kwargs.ray_init.runtime_env`; `worker_process_setup_hook` defaults to
    `agl_lab.algorithms.register_in_worker` (the import registers `per_rollout_mean` in verl's
    `POLICY_LOSS_REGISTRY`); `_temp_dir=$RAY_TMPDIR` when set; the other `ray_kwargs.ray_init`
    keys are passed through (`null` values dropped). Returns False (and does nothing) when Ray
    is already initialised, True when this call started it.
    """
    import ray
    from omegaconf import DictConfig, OmegaConf

    import agl_lab.algorithms  # noqa: F401  (registers the loss in this driver process too)

    if ray.is_initialized():
        return False
    cfg = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config or {}))
    ray_init = OmegaConf.select(cfg, "ray_kwargs.ray_init", default=None)
    kwargs: dict[str, Any] = OmegaConf.to_container(ray_init, resolve=True) if ray_init is not None else {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"ray_kwargs.ray_init must be a mapping of ray.init kwargs, got {type(kwargs).__name__}")
    user_env = kwargs.pop("runtime_env", None) or {}
    default_env = verl_import("get_ppo_ray_runtime_env")(cfg)
    runtime_env = OmegaConf.to_container(OmegaConf.merge(default_env, user_env), resolve=True)
    runtime_env = {k: v for k, v in runtime_env.items() if v is not None}
    runtime_env.setdefault("worker_process_setup_hook", WORKER_SETUP_HOOK)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if os.environ.get("RAY_TMPDIR") and "_temp_dir" not in kwargs:
        kwargs["_temp_dir"] = os.environ["RAY_TMPDIR"]
    ray.init(runtime_env=runtime_env, **kwargs)
    return True


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


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------


class VerlEngine(Engine):
    """`Engine` over an `AglRayPPOTrainer`: vLLM replicas serve, FSDP workers train.

    `VerlEngine(cfg, train_dataset=rows, val_dataset=rows)` starts Ray, spawns the workers
    and replicas and serves the initial weights (what `agl_lab.Trainer` does for
    `agl_lab.engine: verl`); `VerlEngine.wrap(trainer, model_name)` adopts a prepared trainer
    (tests). Not thread-safe: one Trainer drives it.
    """

    def __init__(self, config: Any, train_dataset: Sequence[Mapping[str, Any]] | None = None,
                 val_dataset: Sequence[Mapping[str, Any]] | None = None):
        from agl_lab.engines.verl_trainer import build_trainer

        problems = check_verl_api()
        if problems:
            raise RuntimeError("installed verl/vLLM do not match agl_lab's VERL_API (pin verl==0.9.1, "
                               "vllm==0.24.0):\n  " + "\n  ".join(problems))
        if not train_dataset:
            raise ValueError("train_dataset must be non-empty: the verl engine's dataloader needs task rows")
        owns_ray = init_ray(config)
        try:
            trainer, model_name = build_trainer(config, train_dataset, val_dataset)
            trainer.init_workers()  # leaves the replicas asleep
            self._adopt(trainer, model_name, owns_ray=owns_ray, replicas_awake=False)
            self.sync_weights()  # serve the initial weights
        except BaseException:
            if owns_ray:  # do not leave a half-built cluster behind a failed start
                import ray

                ray.shutdown()
            raise

    @classmethod
    def wrap(cls, trainer: Any, model_name: str, *, replicas_awake: bool = False) -> VerlEngine:
        """An engine over an already built trainer (workers spawned, or fakes in tests)."""
        engine = cls.__new__(cls)
        engine._adopt(trainer, model_name, owns_ray=False, replicas_awake=replicas_awake)
        return engine

    def _adopt(self, trainer: Any, model_name: str, *, owns_ray: bool, replicas_awake: bool) -> None:
        self.trainer = trainer
        self.model_name = model_name
        self.tokenizer = getattr(trainer, "tokenizer", None)
        self._owns_ray = owns_ray
        self._awake = replicas_awake
        self._version = int(getattr(trainer, "global_steps", 0) or 0)
        self._lock = threading.Lock()
        self._closed = False

    # --- serving ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def endpoints(self) -> list[str]:
        return [f"http://{addr}/v1" for addr in self.trainer.server_addresses()]

    def resume(self) -> None:
        if not self._awake:
            self.sync_weights()  # wakes the replicas with the trained weights
        self.trainer.resume_generation()

    def abort(self) -> int:
        if not self._awake:
            return 0
        return self.trainer.abort_generation()

    def pause(self) -> None:
        """Sleep the replicas: in-flight requests drain, weights and KV cache are freed."""
        if self._awake:
            self.trainer.sleep_rollout_replicas()
            self._awake = False

    def sync_weights(self) -> None:
        if self.trainer.weight_sync_needs_sleep():
            self.pause()
        self.trainer.push_weights()
        self._awake = True
        self._version = int(self.trainer.global_steps)

    # --- learning --------------------------------------------------------------------------

    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> Any:
        """Log-probs of `data.batch["responses"]` under the actor's weights, [N, R]."""
        data.meta_info["temperature"] = temperature
        output, _mfu = self.trainer.compute_old_log_probs(data)
        return output.batch["old_log_probs"]

    @property
    def mini_batch_rows(self) -> int:
        """Rows per PPO mini-batch; `update` pads a batch to a multiple of it with zero-weight rows."""
        return self.trainer.mini_batch_rows()

    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        """Everything the advantage needs: old/ref logprobs, values, token_level_rewards, IS weights."""
        return self.trainer.prepare_for_advantage(data)

    def update(self, data: Any) -> dict[str, float]:
        """One critic/actor update (step `global_steps + 1`) on a batch with advantages.

        Old (and, when a reference policy is used, ref) logprobs missing from the batch are
        computed first; critic values must come from `prepare` (they feed the advantage). A
        partial last mini-batch is completed with zero-weight rows (`training/n_sample_padded`).
        """
        return self.trainer.update_policy(data)

    # --- checkpoints -----------------------------------------------------------------------

    def save(self, path: str, agl_state: Mapping[str, Any] | None = None) -> None:
        """verl checkpoint under `path/global_step_N` plus agl_lab's own state (carry-over…)."""
        self.trainer.save_to(os.fspath(path), agl_state)

    def load(self, path: str) -> dict[str, Any] | None:
        """Restore actor/critic/dataloader state, push the loaded weights; returns agl_lab state."""
        self.pause()
        agl_state = self.trainer.load_from(os.fspath(path))
        self.sync_weights()
        return agl_state

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.trainer.close()
        if self._owns_ray:
            import ray

            ray.shutdown()
