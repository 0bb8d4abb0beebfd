"""Configs by preset name from any working directory (issue 36): a notebook copied out of the
checkout runs `Trainer.from_config("cpu_tiny")` and `from_config("configs/cpu_tiny.yaml")`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import agl_lab
from agl_lab.config import ConfigError, load_config
from agl_lab.presets import PRESET_DIR, find_config, preset_names

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_ships_every_config_of_configs_dir():
    shipped = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped and {p.name for p in PRESET_DIR.glob("*.yaml")} == shipped
    assert PRESET_DIR == Path(agl_lab.__file__).resolve().parent / "configs"
    # the wheel's package data names that directory
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*.yaml" in package_data["agl_lab"]
    assert "cpu_tiny" in preset_names()


def test_presets_resolve_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a copied notebook's directory: no configs/ beside it
    for given in ("cpu_tiny", "cpu_tiny.yaml", "configs/cpu_tiny.yaml"):
        assert find_config(given) == PRESET_DIR / "cpu_tiny.yaml"
        assert load_config(given).agl_lab.task.name == "lookup"
    own = tmp_path / "configs" / "cpu_tiny.yaml"  # a file of that path here wins over the preset
    own.parent.mkdir()
    own.write_text("agl_lab:\n  task:\n    name: calc\nactor_rollout_ref:\n  rollout:\n    n: 2\n")
    assert load_config("configs/cpu_tiny.yaml").agl_lab.task.name == "calc"
    with pytest.raises(ConfigError, match="config file not found: cpu_tiniest.*preset name: .*cpu_tiny"):
        load_config("cpu_tiniest")


def test_trainer_from_config_by_preset_name_in_a_copied_notebooks_directory(tmp_path, monkeypatch):
    from agl_lab.trainer import Trainer
    from tests.trainer_runs import SMALL

    monkeypatch.chdir(tmp_path)
    for given in ("cpu_tiny", "configs/cpu_tiny.yaml"):
        with Trainer.from_config(
            given, overrides=SMALL, run_dir=tmp_path / given.replace("/", "_"), console=False
        ) as trainer:
            assert trainer.cfg.agl_lab.task.name == "lookup" and trainer.cfg.actor_rollout_ref.rollout.n == 2
