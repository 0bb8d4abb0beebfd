"""agl_lab.checkpoints: verl's retention rule for `trainer.max_actor_ckpt_to_keep` on plain directories
(the Trainer-level test, with real training and a resume, is tests/test_fit_outputs.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agl_lab import checkpoints


def _save_steps(root: Path, steps, keep, saved=None):
    saved = [] if saved is None else saved
    for step in steps:
        checkpoints.save_atomically(
            root, step, lambda p: (p.mkdir(parents=True), (p / "w").write_text("x")), saved=saved, keep=keep
        )
    return saved


def _on_disk(root: Path) -> list[str]:
    return sorted((p.name for p in root.glob("global_step_*")), key=lambda n: int(n.rsplit("_", 1)[1]))


@pytest.mark.parametrize(
    "keep, left",
    [
        (2, ["global_step_4", "global_step_5"]),
        (1, ["global_step_5"]),
        (None, [f"global_step_{i}" for i in range(1, 6)]),  # verl: null keeps all
        (0, [f"global_step_{i}" for i in range(1, 6)]),  # verl: 0 keeps all too (max_ckpt_to_keep > 0 is the test)
        (9, [f"global_step_{i}" for i in range(1, 6)]),
    ],
)
def test_keeps_the_newest_n_saved_checkpoints_as_verl(tmp_path, keep, left):
    saved = _save_steps(tmp_path, range(1, 6), keep)
    assert _on_disk(tmp_path) == left
    assert [p.name for p in saved] == left  # the list verl's manager keeps (previous_saved_paths) is trimmed alike
    assert (tmp_path / checkpoints.LATEST).read_text() == "5"


def test_checkpoints_found_on_disk_are_never_pruned(tmp_path):
    """verl's list of saved paths starts empty in each process: what a resumed run found stays."""
    _save_steps(tmp_path, [1, 2], keep=None)  # an earlier run
    _save_steps(tmp_path, [3, 4, 5], keep=1)  # this run, keep 1
    assert _on_disk(tmp_path) == ["global_step_1", "global_step_2", "global_step_5"]


def test_saving_the_same_step_again_counts_it_once(tmp_path):
    saved = _save_steps(tmp_path, [1, 2, 2], keep=2)
    assert _on_disk(tmp_path) == ["global_step_1", "global_step_2"] and len(saved) == 2


def test_prune_matches_verls_register_checkpoint(tmp_path):
    """The rule, side by side with verl 0.9.1's own `BaseCheckpointManager.register_checkpoint`."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    for keep in (None, 0, 1, 2, 3):
        ours, theirs = tmp_path / f"ours{keep}", tmp_path / f"verl{keep}"
        _save_steps(ours, range(1, 6), keep)
        manager = BaseCheckpointManager.__new__(BaseCheckpointManager)  # the retention methods need only the list
        manager.previous_saved_paths = []
        for step in range(1, 6):
            path = theirs / f"global_step_{step}"
            path.mkdir(parents=True)
            manager.register_checkpoint(str(path), keep)
        assert _on_disk(ours) == _on_disk(theirs), keep


@pytest.mark.parametrize(
    "value, error",
    [
        ("-1", "trainer.max_actor_ckpt_to_keep=-1: use null or 0"),
        ("two", "trainer.max_actor_ckpt_to_keep must be an integer, got 'two'"),
    ],
)
def test_a_bad_max_actor_ckpt_to_keep_fails_at_load_naming_the_key(value, error):
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=error):
        load_config("configs/cpu_tiny.yaml", [f"trainer.max_actor_ckpt_to_keep={value}"])


def test_max_actor_ckpt_to_keep_0_says_it_keeps_every_checkpoint_and_2_is_honoured_quietly():
    import warnings

    from agl_lab.config import load_config

    with pytest.warns(UserWarning, match=r"max_actor_ckpt_to_keep=0 keeps every checkpoint"):
        load_config("configs/cpu_tiny.yaml", ["trainer.max_actor_ckpt_to_keep=0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("configs/cpu_tiny.yaml", ["trainer.max_actor_ckpt_to_keep=2"])
    assert not [w for w in caught if "max_actor_ckpt_to_keep" in str(w.message)]  # read on the local engine


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (a disk that fills), mounted where this process may mount (root)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)  # lazy: a failed test may hold a file open


def _save_tensor(numel: int):
    import torch

    def save(path: Path) -> None:
        path.mkdir(parents=True)
        checkpoints.save_state({"global_step": 1, "w": torch.zeros(numel)}, path / checkpoints.STATE_FILE)

    return save


def test_a_checkpoint_that_fills_the_disk_says_so_and_gives_the_space_back(small_disk):
    """torch's writer on a full disk says only `unexpected pos …`: the error names the disk, the
    free space and the fix; the partial checkpoint is removed; the latest one is untouched."""
    checkpoints.save_atomically(small_disk, 1, _save_tensor(1000))
    with pytest.raises(checkpoints.CheckpointDiskFull) as caught:
        checkpoints.save_atomically(small_disk, 2, _save_tensor(1_000_000))  # 4 MB on 256 KiB
    message = caught.value.strerror
    assert f"checkpoint of step 2 not written: no space left on the disk holding {small_disk}" in message
    assert "trainer.default_local_dir" in message and "the latest checkpoint is still global_step_1" in message
    assert sorted(p.name for p in small_disk.iterdir()) == ["global_step_1", checkpoints.LATEST]
    assert (small_disk / checkpoints.LATEST).read_text() == "1"
    checkpoints.save_atomically(small_disk, 3, _save_tensor(1000))  # the space came back


def test_a_save_that_fails_with_enospc_removes_its_partial_checkpoint(tmp_path):
    def save(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "engine.bin").write_bytes(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(checkpoints.CheckpointDiskFull, match="no space left on the disk holding"):
        checkpoints.save_atomically(tmp_path, 4, save)
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_fails_otherwise_keeps_its_error_and_removes_its_partial_checkpoint(tmp_path):
    def save(path: Path) -> None:
        path.mkdir(parents=True)
        raise ValueError("a tensor that cannot be saved")

    with pytest.raises(ValueError, match="cannot be saved"):
        checkpoints.save_atomically(tmp_path, 4, save)
    assert list(tmp_path.iterdir()) == []
