"""Where checkpoints live and which one a run resumes from (verl's layout and `resume_mode`).

    trainer.default_local_dir/            (verl: checkpoints/{project}/{experiment})
      global_step_N/                      one `Trainer.save()`: engine/, trainer_state.pt, config.yaml
      latest_checkpointed_iteration.txt   N of the newest complete checkpoint (verl's marker)

`trainer.max_actor_ckpt_to_keep` = N keeps the newest N checkpoints the run saved (`prune`:
verl's rule; null or 0 keeps all).

A checkpoint is written under a temporary name and renamed into place, then marked latest, so
a killed save never leaves a half checkpoint under the real name. The RNG helpers capture every
process-wide generator a step draws from; the Trainer is their one owner.
"""

from __future__ import annotations

import errno
import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agl_lab.config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"


def checkpoint_root(cfg: Any) -> Path:
    """`trainer.default_local_dir`, with `~` expanded."""
    return Path(str(cfg.trainer.default_local_dir)).expanduser()


class CheckpointDiskFull(OSError):
    """A checkpoint could not be written because its disk is full; its partial copy is removed."""

    def __init__(self, step: int, root: Path, free: int | None, cause: BaseException):
        free_text = "" if free is None else f", {free / 2**20:.1f} MiB free"
        latest = root / LATEST
        before = f"global_step_{latest.read_text().strip()}" if latest.exists() else "none"
        super().__init__(
            errno.ENOSPC,
            f"checkpoint of step {step} not written: no space left on the disk holding {root}{free_text} "
            f"({type(cause).__name__}: {' '.join(str(cause).split())[:200]}). Free space there or set "
            f"trainer.default_local_dir to a larger disk; the partial .global_step_{step}.tmp was removed, "
            f"the latest checkpoint is still {before}",
        )


# how writers that keep no errno say it: torch's zip writer (a short write), safetensors (Rust's io error)
_DISK_FULL_SIGNS = ("unexpected pos", "file write failed", "No space left on device", "Disk quota exceeded")


def _disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says the disk is full: ENOSPC/EDQUOT, or one of
    `_DISK_FULL_SIGNS` in its message (torch's and safetensors' writers raise RuntimeErrors)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(exc) for sign in _DISK_FULL_SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Free the frames of `exc` and of what caused it (their locals may hold files open)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def save_atomically(
    root: Path, step: int, save: Callable[[Path], Any], *, saved: list[Path] | None = None, keep: int | None = None
) -> Path:
    """`save(tmp)`, rename tmp → `root/global_step_{step}`, then mark it the latest; with
    `saved` (the checkpoints this run saved, oldest first), register it there and `prune`.
    A save that fails removes tmp; one that fails for lack of disk space raises
    CheckpointDiskFull naming the disk, the free space and the fix."""
    final, tmp = root / f"global_step_{step}", root / f".global_step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp)
    except BaseException as exc:
        full = _disk_full(exc)
        free = _free_bytes(root)  # before the partial checkpoint's space is given back
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint must not keep holding the space
        if full:
            error = CheckpointDiskFull(step, root, free, exc)
            # torch's writer, alive in the failed save's frames, holds the deleted file open: drop
            # them, so its space is given back now and not when the traceback goes
            _drop_tracebacks(exc)
            raise error from None
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # Critical: a killed save never leaves a half checkpoint under the real name
    (root / LATEST).write_text(str(step))
    if saved is not None:
        if final in saved:  # saved again at the same step: it is the newest now
            saved.remove(final)
        saved.append(final)
        prune(saved, keep)
    return final


def prune(saved: list[Path], keep: int | None) -> list[Path]:
    """verl's retention rule for `trainer.max_actor_ckpt_to_keep` (`BaseCheckpointManager.
    register_checkpoint`, verl 0.9.1), on whole `global_step_N` directories: after a save
    completes, keep the newest `keep` of the checkpoints this run saved (`saved`, oldest
    first; the list is trimmed in place) and delete the older ones. `keep` None or 0: keep
    all. As in verl, the list starts empty in each process: checkpoints a run found on disk
    (the one it resumed from, older ones) are never deleted. Returns the deleted paths.

    verl with keep ≥ 2 deletes down to keep − 1 *before* a save; the result after a
    successful save is the same, and here a save that fails deletes nothing."""
    if not keep or keep <= 0 or len(saved) <= keep:
        return []
    old, saved[:] = saved[:-keep], saved[-keep:]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def resume_target(cfg: Any) -> Path | None:
    """The checkpoint `trainer.resume_mode` asks for: `auto` (the latest under
    `default_local_dir`, None when there is none), `resume_path` (`trainer.resume_from_path`,
    which must be a checkpoint), `disable` (None)."""
    mode = str(cfg.trainer.resume_mode)
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = cfg.trainer.resume_from_path
        if not path or not (Path(str(path)) / STATE_FILE).exists():
            raise ConfigError(
                f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a checkpoint "
                f"directory (…/global_step_N), got {path!r}"
            )
        return Path(str(path))
    if mode == "auto":
        latest = checkpoint_root(cfg) / LATEST
        return checkpoint_root(cfg) / f"global_step_{int(latest.read_text().strip())}" if latest.exists() else None
    raise ConfigError(f"trainer.resume_mode={mode!r} is not one of auto, resume_path, disable")


def seed_everything(seed: int) -> None:
    """Seed every process-wide RNG a step draws from (python, numpy, torch)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every process-wide RNG a step draws from (python, numpy, torch, CUDA when this process uses it).

    CUDA's generators are read only once this process has initialised CUDA (the local engine on a
    GPU): `get_rng_state_all()` would otherwise create a CUDA context on every visible GPU — from
    the verl driver, whose GPUs belong to verl's workers, hundreds of MiB each at the first save."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore `rng_state()`; CUDA's generators are set lazily (torch applies them when CUDA first initialises)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(state: Mapping[str, Any], path: Path) -> None:
    """`torch.save` of the trainer state as tensors and plain data (numpy arrays as lists), so
    `load_state` reads it with `weights_only=True`."""
    torch.save(_plain(state), path)


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state `save_state` wrote, loaded with `weights_only=True`: tensors and plain
    data only, so a checkpoint from elsewhere cannot run code. A checkpoint written before
    (the numpy RNG key as an array) loads too; anything else is a ValueError naming the file."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as first:
        core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
        arrays = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
        try:
            with torch.serialization.safe_globals(arrays):
                return torch.load(path, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            raise ValueError(
                f"{path} holds more than tensors and plain data, so it is not loaded (it could run "
                f"code): resume from a checkpoint agl_lab wrote. {str(first).splitlines()[-1]}"
            ) from None


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
