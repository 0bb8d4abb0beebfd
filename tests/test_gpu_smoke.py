"""scripts/gpu_smoke.* on a machine without a GPU: the dry mode lists every check, tier A carries as one file.

No GPU here, so the checks themselves cannot run: `--dry-run` says what each would check (and
exits 0), a copy of the single script file runs its dry mode in an isolated interpreter (tier A
is carryable: no agl_lab import, no network), without a GPU a real run exits 3 with the reason —
with a CUDA build of torch (faked) naming the driver and the one the build needs — and
`--cpu-rehearsal` runs the code of A1 (attention, packed vs padded), A4 (FSDP2 step with
offload), A5's dependency gate (psycopg among requirements-gpu.txt's modules) and A6 (one
torch.compile'd op) on CPU — it always exits 1: it is not the GPU check. Each tier's checks'
timeouts add up to less than the wrapper's, tier A's under 10 minutes. ~2 min.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.py")
CHECKS_A = ["A0 driver", "A1 attention", "A2 cuda_ipc", "A3 nccl", "A4 fsdp2_offload", "A5 local_engine"]
CHECKS_A += ["A6 torch_compile", "A7 batch_invariant", "A8 overlap"]
CHECKS_B = ["B1 startup_check", "B2 model_load", "B3 config_tests", "B4 two_steps"]


def _run(*args, script=SCRIPT, isolated=False, timeout=300):
    cmd = [sys.executable, *(["-I"] if isolated else []), script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(script))


def test_the_dry_mode_says_what_each_check_of_both_tiers_would_check():
    out = _run("--tier", "AB", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [f"DRY  {c}" for c in CHECKS_A + CHECKS_B]
    assert all("would check" in line for line in lines[:-1]) and "none run" in lines[-1]
    assert "580" in lines[0] and "bf16" in lines[1] and "CPUOffloadPolicy" in lines[4] and "gpu_verl.yaml" in lines[-2]
    assert "one rank" in lines[3] and "psycopg" in lines[5] and "torch.compile" in lines[6]
    assert "invariance_gap" in lines[7] and "max_staleness=1" in lines[8]


def test_tier_a_carries_as_one_file_and_needs_a_gpu_to_run(tmp_path):
    copy = tmp_path / "gpu_smoke.py"
    shutil.copy(SCRIPT, copy)
    assert copy.stat().st_size < 60 * 2**20
    out = _run("--tier", "A", "--dry-run", script=str(copy), isolated=True)  # no PYTHONPATH, no checkout
    assert out.returncode == 0 and out.stdout.count("DRY  A") == len(CHECKS_A), out.stdout + out.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run scripts/gpu_smoke.sh --tier A itself")
    out = _run("--tier", "A")
    assert out.returncode == 3 and out.stdout.startswith("FAIL gpu_smoke: no CUDA device visible"), out.stdout
    bad = _run("--tier", "C")
    assert bad.returncode == 2 and "use A, B or AB" in bad.stderr


def test_the_cpu_rehearsal_runs_the_checks_a_cpu_can_run():
    out = _run("--cpu-rehearsal", timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr  # never a PASS of the GPU check
    lines = out.stdout.splitlines()
    assert any(line.startswith("PASS A1 attention: sdpa: bf16 vs fp32") for line in lines), out.stdout + out.stderr
    assert any(line.startswith("PASS A4 fsdp2_offload:") and "parameters moved" in line for line in lines), out.stdout
    assert any(line.startswith("PASS A5 local_engine:") and "psycopg_pool" in line for line in lines), out.stdout
    assert any(line.startswith("PASS A6 torch_compile: torch.compile (inductor") for line in lines), out.stdout
    assert any(line.startswith("PASS A7 batch_invariant: batch_invariant on cpu") for line in lines), out.stdout
    assert any(line.startswith("PASS A8 overlap: the 3 overlapped bf16 steps need a GPU") for line in lines), out.stdout
    assert "not the GPU check" in lines[-1]


def test_a_cuda_build_without_a_device_names_the_driver(tmp_path):
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.version.cuda = '13.0'  # a CUDA 13 build\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 570.133.20\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(site), "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])}
    out = subprocess.run(
        [sys.executable, SCRIPT, "--tier", "A"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert (
        out.stdout.startswith("FAIL gpu_smoke: NVIDIA driver 570.133.20, this torch (") and "needs >= 580" in out.stdout
    )


def test_each_tiers_timeouts_add_up_to_less_than_its_wrappers():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    for tier, checks in gpu_smoke.TIERS.items():
        ids = [name.split()[0] for name, _, _ in checks]
        budget = sum(gpu_smoke.TIMEOUTS[i] for i in ids) + gpu_smoke.STARTUP_SECONDS
        assert budget < gpu_smoke.wrapper_timeout(tier), (tier, budget)
    assert gpu_smoke.wrapper_timeout("A") < 600  # tier A fits a 10-minute call
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_smoke.sh"), "--tier", "B", "--wrapper-timeout"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.stdout.strip() == str(gpu_smoke.wrapper_timeout("B")), out.stdout + out.stderr


@pytest.mark.parametrize(
    ("found", "expected"), [("580.65.06", ">= 580, what torch"), ("550.54.15", "forward compatibility")]
)
def test_a0_compares_the_driver_with_the_cuda_build(tmp_path, monkeypatch, found, expected):
    import torch

    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho {found}\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path), os.environ["PATH"]]))
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a GPU machine's build; the device itself is not needed
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    line = gpu_smoke.check_driver()
    assert line.startswith(f"driver {found}") and expected in line, line


def test_the_gpu_site_pins_this_environment_and_covers_what_a5_gates_on():
    """scripts/gpu_site.py --list: what a bare GPU image is given to run A5 and the demo on `cuda`,
    pinned to the versions installed here (CI's), covering A5's dependency gate (less httpx: the image has it)."""
    from importlib.metadata import version

    out = _run("--list", script=os.path.join(ROOT, "scripts", "gpu_site.py"), timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line)
    assert all(pins[name] == version(name) for name in pins)
    gate = {"verl", "ray", "tensordict", "omegaconf", "fastapi", "uvicorn", "httptools", "orjson", "openai"}
    assert gate | {"psycopg", "psycopg-binary", "psycopg-pool", "transformers"} <= set(pins)
    assert lines[-1] == "antlr4-python3-runtime (copied)"  # omegaconf's parser: an sdist, no wheel to fetch
