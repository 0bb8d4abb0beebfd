"""A CUDA build of torch that sees no device: the driver named before Ray starts (issue #48).

The CUDA-only parts are faked: `torch.version.cuda` set in a `sitecustomize` (the CPU wheel reports
None) and an `nvidia-smi` on PATH that prints an old driver. The rest is the real CLI path:
`agl-lab train configs/gpu_verl.yaml` with `agl_lab.verl.device: auto` must stop with one line and
exit 2, and never fall back to agl_lab's CPU platform.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agl_lab.engines.verl import driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_cuda(tmp_path, driver_line: str | None) -> dict[str, str]:
    """Env of a process whose torch says "CUDA 13.0" and whose nvidia-smi prints `driver_line`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.version.cuda = '13.0'  # a CUDA 13 build\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if driver_line is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {driver_line}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        "HF_HUB_OFFLINE": "1",  # nothing may reach the hub: the check comes before any model load
        "RAY_TMPDIR": str(tmp_path / "ray"),
    }


def test_agl_lab_train_names_an_old_driver_in_one_line_before_ray(tmp_path):
    env = _fake_cuda(tmp_path, "550.54.15")
    cli = os.path.join(os.path.dirname(sys.executable), "agl-lab")
    out = subprocess.run(
        [cli, "train", os.path.join(ROOT, "configs", "gpu_verl.yaml"), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    import torch

    assert [line for line in out.stdout.splitlines() if line.strip()] == [
        f"agl-lab train: NVIDIA driver 550.54.15, this torch ({torch.__version__}, CUDA 13.0) needs >= 580: "
        f"upgrade the driver, or install CUDA 12 builds ({driver.CU12_TORCH}, and vLLM's cu126 wheel); "
        "see docs/gpu.md, 'The NVIDIA driver'"
    ], out.stdout
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "ray").exists()  # Ray never started (it writes its session there)
    assert "agl_lab_cpu" not in out.stdout + out.stderr  # nor did the CPU platform load


def test_the_driver_version_comes_from_nvidia_smi(tmp_path, monkeypatch):
    env = _fake_cuda(tmp_path, "570.133.20")
    monkeypatch.setenv("PATH", env["PATH"])
    assert driver.driver_version() == "570.133.20"


def test_the_driver_version_comes_from_proc_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setattr(driver.shutil, "which", lambda name: None)
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  560.35.03  Fri Aug 16 21:39:15 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    monkeypatch.setattr(driver, "PROC_VERSION", str(proc))
    assert driver.driver_version() == "560.35.03"
    monkeypatch.setattr(driver, "PROC_VERSION", str(tmp_path / "absent"))
    assert driver.driver_version() is None


@pytest.mark.parametrize(
    ("cuda", "found", "expected"),
    [
        (None, "550.54.15", None),  # a CPU build: agl_lab's CPU platform is the right place
        ("13.0", "550.54.15", "NVIDIA driver 550.54.15, this torch (2.11.0, CUDA 13.0) needs >= 580: upgrade"),
        ("13.0", "470.256.02", "needs >= 580: upgrade the driver; see docs/gpu.md"),  # too old for CUDA 12 too
        ("12.6", "470.256.02", "NVIDIA driver 470.256.02, this torch (2.11.0, CUDA 12.6) needs >= 525"),
        ("13.0", "580.65.06", "is recent enough for this torch (2.11.0, CUDA 13.0), yet torch sees no CUDA device"),
        ("13.0", None, "sees no CUDA device and no NVIDIA driver is installed"),
    ],
)
def test_the_problem_line_names_the_driver_and_what_the_build_needs(cuda, found, expected):
    problem = driver.cuda_build_problem("2.11.0", cuda, found)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem and "\n" not in problem
    if found == "550.54.15" and cuda == "13.0":
        assert driver.CU12_TORCH in problem  # 550 runs CUDA 12 builds: the second way out is offered
