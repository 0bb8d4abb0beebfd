"""agl_lab.engines.build: torch's thread count (`agl_lab.torch_threads`) is set where the engine starts.

Real Trainer on the real tiny model; the thread count is read back from torch.
"""

from __future__ import annotations

import pytest
import torch

from agl_lab.config import ConfigError, load_config
from agl_lab.engines.build import decode_threads, torch_threads
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


def test_auto_is_one_thread_on_small_machines_and_half_the_cores_on_big_ones():
    assert torch_threads("auto", cores=2) == 1
    assert torch_threads("auto", cores=4) == 1
    assert torch_threads("auto", cores=16) == 8
    assert torch_threads(3) == 3 and torch_threads(None) is None
    # a real model's compute-bound update wants every core even on a small machine
    assert torch_threads("auto", cores=2, n_params=134_515_008) == 2
    assert torch_threads("auto", cores=2, n_params=1_000_000) == 1
    assert torch_threads("auto", cores=16, n_params=134_515_008) == 8


@pytest.mark.parametrize(
    "value, message",
    [
        ("two", r"agl_lab\.torch_threads must be an integer, got 'two' \(or auto\)"),
        ("0", r"agl_lab\.torch_threads must be > 0, got 0"),
    ],
)
def test_bad_torch_threads_fail_at_load_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"agl_lab.torch_threads={value}"])


@pytest.mark.parametrize("setting, expected", [("auto", torch_threads("auto")), ("1", 1), ("2", 2)])
def test_the_trainer_sets_torch_threads_when_it_builds_its_engine(tmp_path, setting, expected):
    before = torch.get_num_threads()
    torch.set_num_threads(2 if expected == 1 else 1)  # the opposite of what the config asks for
    try:
        with Trainer.from_config(
            "configs/cpu_tiny.yaml",
            overrides=[*SMALL, f"agl_lab.torch_threads={setting}"],
            run_dir=tmp_path,
            console=False,
        ) as trainer:
            assert torch.get_num_threads() == expected
            # the decode loop follows: it runs only while no update does (the weights lock)
            assert trainer.engine.server.scheduler.num_threads == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "lora",
    [
        ["actor_rollout_ref.model.lora_rank=8"],
        ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.model.lora_adapter_path=/a"],
    ],
)
def test_a_lora_engine_loads_the_warm_started_base_from_disk(monkeypatch, lora):
    """Rank > 0 or only an adapter path: the warm start trains the full base before any adapter is
    injected, so the engine must load the warm-started directory, not warm-start in process."""
    from agl_lab.engines import build
    from agl_lab.engines.local import LocalEngine

    cfg = load_config("configs/cpu_tiny.yaml", ["agl_lab.model.warm_start_steps=5", "agl_lab.torch_threads=1", *lora])
    calls = []

    def use_dir(lab, task, steps):  # what the real helper does, without training the tiny model
        calls.append(("dir", steps))
        lab.model.path = "/warm-started"

    monkeypatch.setattr(build, "_use_warm_started_dir", use_dir)
    monkeypatch.setattr(build, "_warm_start", lambda *a: calls.append(("in process",)))
    monkeypatch.setattr(LocalEngine, "from_config", classmethod(lambda cls, c: calls.append(("engine",)) or object()))
    build.build_engine(cfg, task=object())
    assert calls == [("dir", 5), ("engine",)]


def test_decode_threads_auto_is_the_update_threads_and_an_int_is_taken_as_given():
    assert decode_threads("auto", 2) == 2 and decode_threads("auto", 1) == 1
    assert decode_threads(1, 2) == 1 and decode_threads(3, 2) == 3


def test_bad_decode_threads_fail_at_load_naming_the_key():
    with pytest.raises(ConfigError, match=r"agl_lab\.engine_options\.decode_threads must be > 0, got 0"):
        load_config(None, ["agl_lab.engine_options.decode_threads=0"])


@pytest.mark.parametrize("extra, expected", [([], 2), (["agl_lab.engine_options.decode_threads=1"], 1)])
def test_under_overlap_the_decode_loop_takes_the_update_threads_unless_told(tmp_path, extra, expected):
    overlap = [
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "agl_lab.rollout.max_staleness=1",
        "algorithm.rollout_correction.bypass_mode=true",
    ]
    before = torch.get_num_threads()
    try:
        with Trainer.from_config(
            "configs/cpu_tiny.yaml",
            overrides=[*SMALL, "agl_lab.torch_threads=2", *overlap, *extra],
            run_dir=tmp_path,
            console=False,
        ) as trainer:
            assert torch.get_num_threads() == 2  # the update keeps its threads
            assert trainer.engine.overlaps and trainer.engine.server.scheduler.num_threads == expected
    finally:
        torch.set_num_threads(before)
