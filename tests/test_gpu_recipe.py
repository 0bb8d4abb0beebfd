"""scripts/gpu_recipe.py reads the GPU recipe from the README and substitutes only what a CPU needs.

`./lab test` builds and checks the recipe's venv (scripts/gpu_recipe.py, ~7 min cold, ~30 s warm);
these tests are the cheap half: the commands it runs are the README's, with the CPU torch first and
verl's `vllm` extra dropped, and nothing else changed; docs/gpu.md's install block and the header of
configs/gpu_verl.yaml give the same pip commands as the README, so the one build covers all three.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_recipe  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def _pip_commands(text: str) -> list[str]:
    return [c for c in gpu_recipe.install_commands(text.splitlines()) if c.startswith("pip install")]


def test_the_recipe_is_the_readmes_with_the_cpu_torch_first_and_no_vllm_extra():
    lines = gpu_recipe.readme_block((ROOT / "README.md").read_text())
    commands = gpu_recipe.install_commands(lines)
    assert commands == [
        "python3.11 -m venv .venv-gpu",
        "pip install 'verl[vllm]==0.9.1'",
        "pip install --no-deps -e .",
        "pip install -r requirements-gpu.txt",
    ]
    assert gpu_recipe.cpu_commands(commands, gpu_recipe.torch_pin()) == [
        ["install", "torch==2.13.0"],  # requirements-vllm.txt's CPU wheel, first
        ["install", "verl==0.9.1"],  # the one substitution
        ["install", "--no-deps", "-e", "."],
        ["install", "-r", "requirements-gpu.txt"],
    ]


def test_a_recipe_without_verl_is_refused():
    with pytest.raises(ValueError, match=r"no longer installs 'verl\[vllm\]==0.9.1'"):
        gpu_recipe.cpu_commands(["pip install 'verl==0.9.2'"], "torch==2.13.0")


def test_docs_and_the_config_header_give_the_readmes_pip_commands():
    readme = _pip_commands("\n".join(gpu_recipe.readme_block((ROOT / "README.md").read_text())))
    gpu_md = (ROOT / "docs" / "gpu.md").read_text()
    install = re.search(r"## Install\n.*?```bash\n(.*?)```", gpu_md, re.S).group(1)
    assert _pip_commands(install) == readme
    header = "\n".join(
        line.lstrip("# ")
        for line in (ROOT / "configs" / "gpu_verl.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    assert _pip_commands(header) == readme
