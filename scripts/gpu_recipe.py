"""The README's GPU recipe, built and exercised on CPU (issue #48): `./lab gpu-recipe`, run by `./lab test`.

Nothing tested `requirements-gpu.txt`, and the README's three GPU lines stopped on every GPU machine
(psycopg was missing). This script builds `.venv-gpu-recipe` exactly as README.md's "On GPUs" block
says, with the one substitution a CPU needs, and nothing else:

    README (GPU)                               here (CPU)
    python3.11 -m venv .venv-gpu               python3.11 -m venv .venv-gpu-recipe
    (torch comes with verl[vllm]: 2.11.0)      pip install torch==2.13.0   first: the CPU wheel (requirements-vllm.txt's
                                               pin); no +cpu build of 2.11.0 installs here, an unpinned torch is CUDA
    pip install 'verl[vllm]==0.9.1'            pip install verl==0.9.1     its vllm extra is vLLM 0.24.0, a CUDA-only
                                               wheel that pins torch==2.11.0
    pip install --no-deps -e .                 the same
    pip install -r requirements-gpu.txt        the same

then, in that venv (`--check`): `pip check`; every agl_lab module imports; configs/gpu_verl.yaml composes and
passes the verl engine's start-up check (VERL_API without vLLM's rows, the attention package, the
server's modules, psycopg for a PostgreSQL store) and verl's own config classes; and gpu_smoke's
tier A checks that run on CPU (`--cpu-rehearsal`). The venv is kept between runs, keyed by the
hash of the recipe's lines, requirements-gpu.txt, requirements-vllm.txt (the CPU torch pin) and
pyproject.toml (`--rebuild` forces it). Its cost is in docs/benchmarks.md (linked from docs/gpu.md).

    python scripts/gpu_recipe.py [--venv DIR] [--rebuild]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-gpu-recipe"
STAMP = ".agl_lab_recipe"
GPU_VERL = "verl[vllm]==0.9.1"
CPU_VERL = "verl==0.9.1"  # the substitution: vLLM 0.24.0 (the vllm extra) is CUDA-only


# ------------------------------------------------------------------------------------------
# The recipe, read from the README
# ------------------------------------------------------------------------------------------


def readme_block(text: str) -> list[str]:
    """The command lines of the first ```bash block after README's "**On GPUs**" paragraph."""
    start = text.index("**On GPUs**")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    if block is None:
        raise ValueError("README.md: no ```bash block after '**On GPUs**'")
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def install_commands(lines: list[str]) -> list[str]:
    """The `python -m venv` and `pip install` commands of `lines`, in order (split at `&&`)."""
    commands = [c.strip() for line in lines for c in line.split("#")[0].split("&&")]
    return [c for c in commands if c.startswith("pip install") or re.match(r"python3(\.\d+)? -m venv ", c)]


def cpu_commands(commands: list[str], torch_pin: str) -> list[list[str]]:
    """The recipe's pip commands with the CPU substitution, as argument lists for `python -m pip`."""
    out = [["install", torch_pin]]  # first: verl's requirements then keep the CPU wheel
    found = False
    for command in commands:
        if not command.startswith("pip install"):
            continue
        args = shlex.split(command)[1:]
        if GPU_VERL in args:
            args[args.index(GPU_VERL)] = CPU_VERL
            found = True
        out.append(args)
    if not found:
        raise ValueError(f"the README's GPU recipe no longer installs {GPU_VERL!r}: update scripts/gpu_recipe.py")
    return out


def torch_pin() -> str:
    """requirements-vllm.txt's CPU torch (the wheel on local disk)."""
    lines = (ROOT / "requirements-vllm.txt").read_text().splitlines()
    return next(line.split("#")[0].strip() for line in lines if line.startswith("torch=="))


def recipe_hash(lines: list[str]) -> str:
    digest = hashlib.sha256("\n".join(lines).encode())
    for name in ("requirements-gpu.txt", "pyproject.toml", "requirements-vllm.txt"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# Building the venv
# ------------------------------------------------------------------------------------------


def build(venv: Path, rebuild: bool) -> float:
    """Create `venv` from the recipe unless its stamp matches; seconds spent (0.0: cached)."""
    lines = readme_block((ROOT / "README.md").read_text())
    commands = install_commands(lines)
    key = recipe_hash(lines)
    stamp = venv / STAMP
    if not rebuild and stamp.exists() and stamp.read_text().strip() == key:
        print(f"[gpu-recipe] {venv.name} is current (recipe hash {key})", flush=True)
        return 0.0
    t0 = time.time()
    shutil.rmtree(venv, ignore_errors=True)
    interpreter = next((shlex.split(c)[0] for c in commands if " -m venv " in c), "python3.11")
    python = shutil.which(interpreter) or sys.executable
    _run([python, "-m", "venv", str(venv)])
    for args in cpu_commands(commands, torch_pin()):
        _run([str(venv / "bin" / "python"), "-m", "pip", *args, "--quiet"])
    stamp.write_text(key + "\n")
    spent = time.time() - t0
    print(f"[gpu-recipe] built {venv.name} in {spent:.0f} s", flush=True)
    return spent


def _run(cmd: list[str]) -> None:
    print("[gpu-recipe] $ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


# ------------------------------------------------------------------------------------------
# The checks, run inside the venv
# ------------------------------------------------------------------------------------------


def check_imports() -> list[str]:
    """Every agl_lab module imports (the train path's among them: optional packages load lazily)."""
    import pkgutil

    import agl_lab

    problems = []
    for info in pkgutil.walk_packages(agl_lab.__path__, "agl_lab."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 (listed: a module that fails to import, for any reason)
            problems.append(f"import {info.name}: {type(exc).__name__}: {exc}")
    return problems


def check_config() -> list[str]:
    """configs/gpu_verl.yaml composes, passes the start-up check and builds verl's config classes."""
    from omegaconf import OmegaConf

    from agl_lab.config import load_config
    from agl_lab.engines.verl.api import check_attention, check_dependencies, check_verl_api, verl_import

    cfg = load_config(ROOT / "configs" / "gpu_verl.yaml")
    postgres = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["agl_lab.server.store=postgresql://u:p@db:5432/agl"]))
    problems = check_verl_api(include_vllm=False) + check_attention(cfg) + check_dependencies(postgres)
    to_dataclass = verl_import("omega_conf_to_dataclass")
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.actor"):
        try:
            to_dataclass(OmegaConf.select(cfg, key))
        except Exception as exc:  # noqa: BLE001
            problems.append(f"verl's config class for {key}: {type(exc).__name__}: {exc}")
    return problems


def check_tier_a() -> list[str]:
    """gpu_smoke's tier A checks that run on CPU: every one PASSes (the rehearsal exits 1 by design)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--cpu-rehearsal"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(out.stdout, end="", flush=True)
    checks = [line for line in out.stdout.splitlines() if line[:5] in ("PASS ", "FAIL ", "SKIP ")]
    if not checks or any(not line.startswith("PASS ") for line in checks):
        return [f"gpu_smoke --cpu-rehearsal: {line}" for line in checks if not line.startswith("PASS ")] or [
            "gpu_smoke --cpu-rehearsal ran no check:\n" + out.stdout[-2000:] + out.stderr[-2000:]
        ]
    return []


def run_checks() -> int:
    pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [] if pip.returncode == 0 else [f"pip check: {pip.stdout.strip()}"]
    for name, check in (("imports", check_imports), ("gpu_verl.yaml", check_config), ("tier A", check_tier_a)):
        t0 = time.time()
        try:
            found = check()
        except Exception as exc:  # noqa: BLE001 (a check that cannot even run is a problem of the recipe)
            found = [f"{name}: {type(exc).__name__}: {exc}"]
        print(f"[gpu-recipe] {'FAIL' if found else 'PASS'} {name} ({time.time() - t0:.0f} s)", flush=True)
        problems += found
    for problem in problems:
        print(f"[gpu-recipe] problem: {problem}", flush=True)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(VENV), help=f"the venv to build and check (default {VENV.name})")
    parser.add_argument("--rebuild", action="store_true", help="build the venv again even if its stamp matches")
    parser.add_argument("--check", action="store_true", help="(inside the venv) run the checks only")
    args = parser.parse_args(argv)
    if args.check:
        return run_checks()
    venv = Path(args.venv).resolve()
    t0 = time.time()
    build(venv, args.rebuild)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    rc = subprocess.run([str(venv / "bin" / "python"), __file__, "--check"], cwd=ROOT, env=env).returncode
    print(f"[gpu-recipe] {'PASS' if rc == 0 else 'FAIL'}: the README's GPU recipe on CPU ({time.time() - t0:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
