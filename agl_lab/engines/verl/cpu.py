"""verl on CPU: a verl platform, two import-time patches, and the env that loads them everywhere.

verl 0.9.1 knows CUDA, NPU and ROCm platforms only; with no accelerator it falls back to CUDA
(device `cuda`, backend `nccl`) and its workers fail. It has extension points instead of a CPU
platform (see shared/design/VERL-CPU-FACTS.md for what was measured):

| verl extension point                  | what agl_lab plugs in                                          |
|---------------------------------------|----------------------------------------------------------------|
| `VERL_USE_EXTERNAL_MODULES=<module>`  | this module: imported at `import verl` in the driver and in    |
|                                       | every Ray worker (the engine puts it in Ray's runtime_env)     |
| `PlatformRegistry.register(name)`     | `CpuPlatform` as `agl_lab_cpu`: device `cpu`, backend `gloo`,  |
| + `VERL_PLATFORM=<name>`              | Ray resource `GPU` (fake GPUs declared by `ray.init(num_gpus)`)|
| `VERL_ENGINE_DEVICE=cuda`             | finds the FSDP engine verl registers for `cuda`                 |
| `RolloutReplicaRegistry`, `_ROLLOUT_REGISTRY` | `agl_lab_cpu` rollout: agl_lab's OpenAI server as the replica |
|                                       | (agl_lab/engines/verl/cpu_rollout.py)                           |

Two places of verl still assume an accelerator and are patched when this module is imported:
1. `initialize_global_process_group_ray` builds `cpu:gloo,<device>:<backend>`, which is
   `cpu:gloo,cpu:gloo` on CPU (torch: "Duplicate device type cpu") → plain `gloo`.
2. FSDP2's forward-only path (the ref worker) builds `CPUOffloadPolicy(pin_memory=True)`;
   pinning needs an accelerator → an unpinned policy.

`cpu_platform_wanted(cfg)` decides (explicit `agl_lab.verl.device: cpu`, or `auto` with no CUDA
device); only then does the engine call `activate()`, so on a GPU nothing of this is loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any

from agl_lab.engines.verl.api import VERL_API, StartupProblem, verl_import, verl_module

PLATFORM_NAME = "agl_lab_cpu"  # VERL_PLATFORM; the rollout has the same name (cpu_rollout.ROLLOUT_NAME)
MODULE = __name__  # "agl_lab.engines.verl.cpu"
_AGL_LAB_ROOT = str(
    Path(__file__).resolve().parents[3]
)  # the directory holding agl_lab/ (…/agl_lab/engines/verl/cpu.py)


# ------------------------------------------------------------------------------------------
# Selection and activation (driver side; imports no verl)
# ------------------------------------------------------------------------------------------


def cpu_platform_wanted(cfg: Any, joining: str | None = None) -> bool:
    """`agl_lab.verl.device`: `cpu` → yes; `cuda` → no; `auto` (default) → no when this process sees
    a CUDA device; else, joining the Ray cluster at `joining`, no when one of its nodes has NVIDIA
    GPUs (`cluster.nvidia_gpus_on_cluster`: a driver without a GPU, e.g. a Jupyter login node);
    else yes — unless this torch is a CUDA build: then `StartupProblem` naming the driver and the
    driver that build needs (agl_lab/engines/verl/driver.py)."""
    from omegaconf import OmegaConf

    device = str(OmegaConf.select(cfg, "agl_lab.verl.device", default="auto") or "auto").lower()
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"agl_lab.verl.device={device!r}: use auto, cpu or cuda")
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return False
        if joining is None:
            from agl_lab.engines.verl.driver import check_cuda_build

            if problem := check_cuda_build():  # a CUDA torch without a device: never the CPU platform silently
                raise StartupProblem(problem)
            return True
        from agl_lab.engines.verl.cluster import nvidia_gpus_on_cluster

        return not any(node["nvidia"] > 0 for node in nvidia_gpus_on_cluster(joining).values())
    return device == "cpu"


def worker_env(modules: tuple[str, ...] = ()) -> dict[str, str]:
    """Env vars every process of a CPU verl run needs (driver and Ray workers alike).

    `modules`: more agl_lab modules for verl to load after this one (the vLLM shim,
    agl_lab/engines/verl/vllm_cpu.py, when the rollout is vLLM)."""
    ours = [MODULE, *modules]
    external = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m and m not in ours]
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _AGL_LAB_ROOT]
    return {
        "VERL_USE_EXTERNAL_MODULES": ",".join([*ours, *external]),
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for "cuda" only
        # this process and its subprocesses import *this* agl_lab (a checkout need not be installed);
        # Ray workers get the same code as a `py_modules` package (engine.init_ray, cluster.py), so
        # init_ray leaves this key out of their runtime_env: nodes need no checkout
        "PYTHONPATH": os.pathsep.join([_AGL_LAB_ROOT, *python_path]),
    }


def activate(modules: tuple[str, ...] = ()) -> dict[str, str]:
    """Load the CPU platform (and `modules`) in this process and return the env for Ray's runtime_env.

    Sets the env vars here (verl imported later picks the modules up itself), imports this
    module's verl side (platform registration, patches, rollout registration) and `modules`,
    and, when verl already resolved a platform in this process, replaces it by the CPU platform.
    """
    import importlib

    env = worker_env(modules)
    os.environ.update(env)
    if _AGL_LAB_ROOT not in sys.path:
        sys.path.insert(0, _AGL_LAB_ROOT)
    install()
    for module in modules:
        loaded = importlib.import_module(module)
        getattr(loaded, "install", lambda: None)()
    current = verl_module("set_platform")._current_platform  # None until verl first resolves one
    if current is not None and not isinstance(current, CpuPlatform):
        verl_import("set_platform")(CpuPlatform())
    return env


# ------------------------------------------------------------------------------------------
# The platform (verl side)
# ------------------------------------------------------------------------------------------


class CpuDeviceModule:
    """Stand-in for `torch.cuda` where verl calls `get_torch_device().<fn>()`: no-ops, or the CPU
    equivalent (RNG state). `is_available()` is False so verl's memory probes skip themselves."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    def set_device(self, *_: Any) -> None: ...
    def synchronize(self, *_: Any) -> None: ...
    def empty_cache(self) -> None: ...
    def ipc_collect(self) -> None: ...
    def reset_peak_memory_stats(self, *_: Any) -> None: ...
    def set_per_process_memory_fraction(self, *_: Any) -> None: ...
    def manual_seed(self, *_: Any) -> None: ...  # torch.manual_seed already seeds the CPU generator
    def manual_seed_all(self, *_: Any) -> None: ...

    @staticmethod
    def get_rng_state(*_: Any) -> Any:
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: Any, *_: Any) -> None:
        import torch

        torch.set_rng_state(state)

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_AVPHYS_PAGES") * page
        return free, pages * page

    def memory_allocated(self, *_: Any) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"agl_lab's CPU platform has no stand-in for torch.cuda.{name}: "
            "add it to agl_lab.engines.verl.cpu.CpuDeviceModule"
        )


def _platform_class() -> type:
    """`CpuPlatform`, defined against verl's `PlatformBase` (imported on first use)."""

    class _CpuPlatform(verl_import("PlatformBase")):
        """verl platform for CPU-only machines: gloo collectives, fake Ray `GPU` resources."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CpuDeviceModule()

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # a `.to()` / `torch.device()` target in verl, not only an index

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None: ...
        def synchronize(self, device_index: Any = None) -> None: ...
        def manual_seed(self, seed: int) -> None: ...
        def manual_seed_all(self, seed: int) -> None: ...
        def set_allocator_settings(self, settings: str) -> None: ...
        def empty_cache(self) -> None: ...

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (fake) GPUs

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None: ...
        def profiler_stop(self) -> None: ...

        def ray_resource_name(self) -> str:
            # verl's ResourcePoolManager forces use_gpu=True: the driver declares fake GPUs
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            # verl's vLLMReplica puts these into its server actor's runtime_env (vLLM's CPU settings)
            from agl_lab.engines.verl.vllm_cpu import server_env

            return {**super().rollout_env_vars(), **server_env()}

        def cudart(self) -> None:
            return None

    _CpuPlatform.__name__ = _CpuPlatform.__qualname__ = "CpuPlatform"
    return _CpuPlatform


# ------------------------------------------------------------------------------------------
# Patches and registration (run once per process, at `import verl` through the env var)
# ------------------------------------------------------------------------------------------


def _patch_process_group() -> None:
    """Patch 1: `cpu:gloo,cpu:gloo` → `gloo` (only when verl would build the duplicate)."""
    key = "initialize_global_process_group_ray"
    dist = verl_module(key)
    original = getattr(dist.initialize_global_process_group_ray, "__wrapped__", verl_import(key))

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    dist.initialize_global_process_group_ray = initialize_global_process_group_ray
    for name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):  # imported by name there
        module = sys.modules.get(name)
        if module is not None:
            module.initialize_global_process_group_ray = initialize_global_process_group_ray


def _patch_offload_policy() -> None:
    """Patch 2: FSDP2's `CPUOffloadPolicy(pin_memory=True)` → unpinned (pinning needs an accelerator)."""
    fsdp_utils = verl_module("CPUOffloadPolicy")
    base = verl_import("CPUOffloadPolicy")
    if base is None or getattr(base, "_agl_lab_unpinned", False):
        return

    @dataclasses.dataclass
    class UnpinnedCPUOffloadPolicy(base):  # a subclass: isinstance checks keep working
        _agl_lab_unpinned = True

        def __post_init__(self) -> None:
            self.pin_memory = False

    fsdp_utils.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
    impl = sys.modules.get(VERL_API["FSDPEngine._build_fsdp_module"].module)  # bound by name at its import
    if impl is not None:
        impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


CpuPlatform: Any = None  # set by install()


def install() -> None:
    """Register the platform and the rollout, apply the patches. Idempotent."""
    global CpuPlatform
    if CpuPlatform is not None:
        return
    CpuPlatform = verl_import("PlatformRegistry.register")(PLATFORM_NAME)(_platform_class())
    _patch_process_group()
    _patch_offload_policy()
    from agl_lab.engines.verl import cpu_rollout

    cpu_rollout.register()


# Imported by verl itself (VERL_USE_EXTERNAL_MODULES) at the end of `import verl`: install now.
if "verl" in sys.modules and os.environ.get("VERL_PLATFORM") == PLATFORM_NAME:
    install()
