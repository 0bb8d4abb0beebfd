"""The NVIDIA driver against the installed torch's CUDA build, named before Ray starts (issue #48).

torch 2.11.0 from PyPI — what `verl[vllm]==0.9.1` resolves — is a CUDA 13 build. On a driver older
than R580 (the 550/560/570 drivers common on clusters) `torch.cuda.is_available()` is False, and
`agl_lab.verl.device: auto` would quietly load agl_lab's CPU platform for a GPU config, to fail
later with a message about vLLM's CPU build. `cuda_build_problem()` says instead, in one line, which
driver this machine has and which one the torch build needs:

    NVIDIA driver 550.54.15, this torch (2.11.0, CUDA 13.0) needs >= 580: upgrade the driver, or …

The minimum drivers (Linux, x86_64) are those of NVIDIA's minor-version compatibility: any build
of CUDA major M runs on a driver at least `MIN_DRIVER[M]` (docs/gpu.md, "The NVIDIA driver"):

    CUDA build   driver   example
    13.x         >= 580   torch 2.11.0 from PyPI (cu130)
    12.x         >= 525   torch from download.pytorch.org/whl/cu126 or cu128

The driver version comes from `nvidia-smi` (on PATH) or, failing that, `/proc/driver/nvidia/version`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

#: CUDA major version -> the oldest Linux driver branch that runs its builds
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
PROC_VERSION = "/proc/driver/nvidia/version"
CU12_TORCH = "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu126"


def driver_version() -> str | None:
    """This machine's NVIDIA driver version ("550.54.15"), or None when no driver is found."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        if match := re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", out):
            return match.group(1)
    try:
        with open(PROC_VERSION, encoding="utf-8") as f:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d{3,}\.\d+(?:\.\d+)?)", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def cuda_build_problem(torch_version: str, cuda: str | None, driver: str | None) -> str | None:
    """One line saying why a CUDA build of torch sees no device, or None for a CPU build.

    `cuda`: `torch.version.cuda` ("13.0"; None for a CPU build); `driver`: `driver_version()`."""
    if not cuda:
        return None
    major = int(cuda.split(".")[0])
    needed = MIN_DRIVER.get(major)
    this = f"this torch ({torch_version}, CUDA {cuda})"
    if driver is None:
        return (
            f"{this} sees no CUDA device and no NVIDIA driver is installed (no nvidia-smi, no {PROC_VERSION}): "
            "run on a GPU machine, join a Ray cluster whose nodes have GPUs (RAY_ADDRESS=<head>:<port>), "
            "or set agl_lab.verl.device=cpu to train on CPU (configs/cpu_verl.yaml)"
        )
    branch = int(driver.split(".")[0])
    if needed is not None and branch < needed:
        ways = "upgrade the driver"
        if major > 12 and branch >= MIN_DRIVER[12]:
            ways += f", or install CUDA 12 builds ({CU12_TORCH}, and vLLM's cu126 wheel)"
        return f"NVIDIA driver {driver}, {this} needs >= {needed}: {ways}; see docs/gpu.md, 'The NVIDIA driver'"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"NVIDIA driver {driver} is recent enough for {this}, yet torch sees no CUDA device: check "
        f"CUDA_VISIBLE_DEVICES ({'unset' if visible is None else repr(visible)}), the container's GPU access "
        "(docker run --gpus all) and `nvidia-smi`; or set agl_lab.verl.device=cpu to train on CPU"
    )


def check_cuda_build() -> str | None:
    """`cuda_build_problem` for this process's torch (call it when `torch.cuda.is_available()` is False)."""
    import torch

    return cuda_build_problem(torch.__version__, torch.version.cuda, driver_version())
