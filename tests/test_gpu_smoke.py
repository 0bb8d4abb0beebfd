"""scripts/gpu_smoke.* on a machine without a GPU: the dry mode lists every check, tier A carries as one file.

No GPU here, so the checks themselves cannot run: `--dry-run` says what each would check (and
exits 0), a copy of the single script file runs its dry mode in an isolated interpreter (tier A
is carryable: no agl_lab import, no network), without a GPU a real run exits 3 with the reason,
and `--cpu-rehearsal` runs the code of A1 (attention, packed vs padded) and A4 (FSDP2 step with
offload) on CPU — it always exits 1: it is not the GPU check. ~30 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.py")
CHECKS_A = ["A1 attention", "A2 cuda_ipc", "A3 nccl", "A4 fsdp2_offload", "A5 local_engine"]
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
    assert "bf16" in lines[0] and "CPUOffloadPolicy" in lines[3] and "gpu_verl.yaml" in lines[-2]


def test_tier_a_carries_as_one_file_and_needs_a_gpu_to_run(tmp_path):
    copy = tmp_path / "gpu_smoke.py"
    shutil.copy(SCRIPT, copy)
    assert copy.stat().st_size < 60 * 2**20
    out = _run("--tier", "A", "--dry-run", script=str(copy), isolated=True)  # no PYTHONPATH, no checkout
    assert out.returncode == 0 and out.stdout.count("DRY  A") == 5, out.stdout + out.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run scripts/gpu_smoke.sh --tier A itself")
    out = _run("--tier", "A")
    assert out.returncode == 3 and out.stdout.startswith("FAIL gpu_smoke: no CUDA device visible"), out.stdout
    bad = _run("--tier", "C")
    assert bad.returncode == 2 and "use A, B or AB" in bad.stderr


def test_the_cpu_rehearsal_runs_the_attention_and_fsdp2_checks_code():
    out = _run("--cpu-rehearsal", timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr  # never a PASS of the GPU check
    lines = out.stdout.splitlines()
    assert any(line.startswith("PASS A1 attention: sdpa: bf16 vs fp32") for line in lines), out.stdout + out.stderr
    assert any(line.startswith("PASS A4 fsdp2_offload:") and "parameters moved" in line for line in lines), out.stdout
    assert "not the GPU check" in lines[-1]
