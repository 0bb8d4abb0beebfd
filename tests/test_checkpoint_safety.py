"""Resume loads a checkpoint with `torch.load(..., weights_only=True)` (issue 41, finding 13): a
checkpoint from elsewhere cannot run code; tensors and plain data (the RNG state included) load,
and a checkpoint written before (its numpy RNG key an array) still loads.

Real Trainer (tiny model) saving and restoring real checkpoints.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest
import torch

from agl_lab import checkpoints
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    with Trainer.from_config("configs/cpu_tiny.yaml", SMALL, run_dir=root / "run", console=False) as tr:
        tr.step()
        path = tr.save(root / "global_step_1")
        numpy_after = np.random.random()
    return path, numpy_after


def test_the_trainer_state_loads_with_weights_only_and_restores_the_rng(saved, tmp_path):
    path, numpy_after = saved
    state = torch.load(path / checkpoints.STATE_FILE, weights_only=True)  # plain data: no allow-list needed
    assert state["global_step"] == 1
    torch.load(path / "engine" / "engine_state.pt", weights_only=True)  # the optimiser state too
    with Trainer.from_config("configs/cpu_tiny.yaml", SMALL, run_dir=tmp_path / "run", console=False) as tr:
        tr.restore(path)
        assert tr.global_step == 1
        assert np.random.random() == numpy_after  # the numpy RNG came back from the saved key list


def test_a_checkpoint_that_would_run_code_is_refused_naming_the_file(saved, tmp_path):
    path, _ = saved
    marker = tmp_path / "pwned"
    bad = tmp_path / "global_step_1"
    bad.mkdir()
    torch.save({"global_step": 1, "x": _RunsCode(str(marker))}, bad / checkpoints.STATE_FILE)
    with pytest.raises(ValueError, match=r"trainer_state\.pt holds more than tensors and plain data"):
        checkpoints.load_state(bad / checkpoints.STATE_FILE)
    assert not marker.exists()  # nothing ran


def test_a_checkpoint_written_before_with_a_numpy_array_still_loads(tmp_path):
    old = {
        "global_step": 3,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }
    torch.save(old, tmp_path / checkpoints.STATE_FILE)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / checkpoints.STATE_FILE, weights_only=True)  # torch alone refuses it
    state = checkpoints.load_state(tmp_path / checkpoints.STATE_FILE)
    assert state["global_step"] == 3 and (state["rng"]["numpy"][1] == old["rng"]["numpy"][1]).all()
    checkpoints.set_rng_state(state["rng"])
