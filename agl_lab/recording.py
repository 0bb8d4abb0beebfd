"""Every training step recorded, in files a laptop can replay (`agl_lab.replay`).

Recording (on by default, `agl_lab.record.*`): after each `Trainer.step()` the step's completed
rollouts and what the step made of them are written to `RUN_DIR/recording/step_NNNNNN.json.gz`
(N = the step as logged in metrics.jsonl). The format is gzip-compressed JSON, one document per
step — readable with `zcat | python -m json.tool`, no schema library, floats exact (Python's
float repr round-trips, so token logprobs and rewards come back to the bit), and token-id lists
compress ~5-10× under gzip:

    {"format": "agl_lab.recording", "version": 1,
     "step": N, "batch_step": N - 1,                   # the logged step; the step the batch was built at
     "policy_version": int,                            # weights that served the step's calls
     "seed": int, "rng": {python, numpy, torch},       # RNG states at the start of the step
     "pad_token_id": int,                              # what build_batch padded with
     "rollouts": [CompletedRollout as a dict, ...],    # token ids, logprobs, rewards, events, times
     "metrics": {...},                                 # the step's logged metrics
     "weights": [...], "dropped": [...]}               # UpdateResult.weights / .dropped as records

Each validation (`Trainer.validate`, so also `val_before_train` and `test_freq`) writes its
rollouts to `RUN_DIR/recording/validation_NNNNNN.json.gz` (N = the step it validated; same
rollout dicts, no batch): the same validation tasks before and after training, transcript by
transcript (`load_validation`, `agl_lab.transcript.format_transcript`).

`recording/bytes` (the file's size) is a step metric. A recording that cannot be written (a full
disk, a path in the way) never stops training: a warning names the file and the error, the
partial `.tmp` file is removed, and the step's `recording/failed` metric is 1 (`recording/bytes` 0).
`agl_lab.record.events: false` leaves the
raw events out (the triplets stay); `agl_lab.record.max_steps: K` keeps the newest K files.

Replaying a recorded step is `agl_lab.replay`.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from agl_lab.records import CompletedRollout, completed_rollout_from_dict, completed_rollout_to_dict, sort_rollouts
from agl_lab.results import UpdateResult

logger = logging.getLogger(__name__)

FORMAT, VERSION = "agl_lab.recording", 1
DIRNAME = "recording"


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"step_{step:06d}.json.gz"


def validation_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / DIRNAME / f"validation_{step:06d}.json.gz"


def _numbered(run_dir: str | Path, prefix: str) -> list[int]:
    """The N of the files `PREFIX_NNNNNN.json.gz` under `run_dir/recording`, in order; other
    names (a stray `step_7.json.gz`, a directory) are not recordings and are left out."""
    pattern = re.compile(rf"{prefix}_(\d{{6}})\.json\.gz")
    found = ((pattern.fullmatch(p.name), p) for p in (Path(run_dir) / DIRNAME).glob(f"{prefix}_*.json.gz"))
    return sorted(int(m.group(1)) for m, p in found if m is not None and p.is_file())


def validated_steps(run_dir: str | Path) -> list[int]:
    """The steps whose validation rollouts are recorded under `run_dir`, in order."""
    return _numbered(run_dir, "validation")


def load_validation(run_dir: str | Path, step: int) -> list[CompletedRollout]:
    """The validation rollouts recorded at step `step` (0: before training), in task order."""
    path = validation_path(run_dir, step)
    if not path.exists():
        raise FileNotFoundError(
            f"no validation recorded at step {step} in {path.parent} (recorded: {validated_steps(run_dir) or 'none'})"
        )
    doc = _read_doc(path)
    if "rollouts" not in doc:
        raise RecordingError(f"{path} is damaged: it has no 'rollouts' key")
    return _rollouts(path, doc)


def recorded_steps(run_dir: str | Path) -> list[int]:
    """The steps recorded under `run_dir`, in order."""
    return _numbered(run_dir, "step")


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Writes one recording per step into `run_dir/recording/` (see the module docstring)."""

    def __init__(self, run_dir: str | Path, options: Mapping[str, Any]):
        """`options`: `agl_lab.record` (its types and range are checked when the config loads)."""
        self.enabled = bool(options.get("enabled", True))
        self.events = bool(options.get("events", True))
        max_steps = options.get("max_steps")
        self.max_steps = None if max_steps is None else int(max_steps)
        self.dir = Path(run_dir) / DIRNAME
        self.last_failed = False  # the last write failed (the step's `recording/failed` metric)
        self.failures = 0

    def record(
        self,
        step: int,
        *,
        batch_step: int,
        rollouts: Sequence[CompletedRollout],
        metrics: Mapping[str, Any],
        update: UpdateResult,
        policy_version: int | None,
        seed: int,
        rng: Mapping[str, Any],
        pad_token_id: int,
    ) -> int:
        """Write step `step`'s recording; returns its size in bytes (0 when recording is off or
        the write failed: then `last_failed` is True and a warning was logged)."""
        self.last_failed = False
        if not self.enabled:
            return 0
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "batch_step": batch_step,
            "policy_version": policy_version,
            "seed": seed,
            "rng": _rng_to_json(rng),
            "pad_token_id": pad_token_id,
            "rollouts": self._rollout_docs(rollouts),
            "metrics": jsonable(dict(metrics)),
            "weights": frame_records(update.weights),
            "dropped": frame_records(update.dropped),
        }
        size = self._write(step_path(self.dir.parent, step), doc)
        if self.max_steps is not None and not self.last_failed:
            self._remove(recorded_steps(self.dir.parent)[: -self.max_steps])
        return size

    def record_validation(self, step: int, rollouts: Sequence[CompletedRollout], metrics: Mapping[str, Any]) -> int:
        """Write the validation rollouts of step `step`, in task order; returns the file's size (0 when
        off or the write failed, as `record`)."""
        self.last_failed = False
        if not self.enabled:
            return 0
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "kind": "validation",
            "rollouts": self._rollout_docs(sort_rollouts(rollouts)),
            "metrics": jsonable(dict(metrics)),
        }
        return self._write(validation_path(self.dir.parent, step), doc)

    def _rollout_docs(self, rollouts: Sequence[CompletedRollout]) -> list[dict[str, Any]]:
        docs = [completed_rollout_to_dict(r) for r in rollouts]
        if not self.events:
            for d in docs:
                d["events"] = []
        return docs

    def _write(self, path: Path, doc: Mapping[str, Any]) -> int:
        """Write `doc` to `path` through a `.tmp` file; any failure is a warning (a debugging aid
        must not kill training), the `.tmp` is removed and 0 returned with `last_failed` set."""
        tmp = self.dir / f".{path.name}.tmp"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with gzip.open(tmp, "wt", compresslevel=6) as f:
                json.dump(doc, f, separators=(",", ":"), allow_nan=True)
            tmp.replace(path)  # a killed write never leaves a half recording under the real name
            return path.stat().st_size
        except Exception as e:  # OSError (disk full, a path in the way) above all
            self.last_failed, self.failures = True, self.failures + 1
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            logger.warning(
                "recording %s could not be written (%s: %s); training goes on without it (metric recording/failed)",
                path,
                type(e).__name__,
                e,
            )
            return 0

    def drop_after(self, step: int) -> int:
        """Remove the recordings of steps after `step` (a resume redoes them); returns how many."""
        for s in validated_steps(self.dir.parent):
            if s > step:
                validation_path(self.dir.parent, s).unlink(missing_ok=True)
        return self._remove([s for s in recorded_steps(self.dir.parent) if s > step])

    def _remove(self, steps: Sequence[int]) -> int:
        for s in steps:
            step_path(self.dir.parent, s).unlink(missing_ok=True)
        return len(steps)


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor
        return value.item()
    return value


def frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return jsonable(frame.to_dict(orient="records")) if frame is not None and not frame.empty else []


def _rng_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """`checkpoints.rng_state()` as JSON: python's tuple, numpy's MT19937 state, torch's bytes."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(state["torch"].numpy().tobytes()).decode(),
    }


def rng_from_json(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `_rng_to_json`: a state `checkpoints.set_rng_state` accepts."""
    import torch

    version, internal, gauss = doc["python"]
    name, keys, pos, has_gauss, cached = doc["numpy"]
    raw = np.frombuffer(base64.b64decode(doc["torch"]), dtype=np.uint8).copy()
    return {
        "python": (version, tuple(internal), gauss),
        "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        "torch": torch.from_numpy(raw),
    }


# ---------------------------------------------------------------------------------------------
# Reading a recording
# ---------------------------------------------------------------------------------------------


@dataclass
class Recording:
    """One recorded step, as written by `Recorder.record`."""

    step: int
    batch_step: int
    policy_version: int | None
    seed: int
    rng: dict[str, Any]
    pad_token_id: int
    rollouts: list[CompletedRollout]
    metrics: dict[str, Any]
    weights: pd.DataFrame
    dropped: pd.DataFrame
    path: Path


def load_recording(run_dir: str | Path, step: int) -> Recording:
    """The recording of `step` under `run_dir`; FileNotFoundError naming the recorded steps."""
    path = step_path(run_dir, step)
    if not path.exists():
        steps = recorded_steps(run_dir)
        raise FileNotFoundError(
            f"no recording of step {step} in {Path(run_dir) / DIRNAME}: recorded steps are "
            f"{_span(steps) if steps else 'none'} (recording is agl_lab.record.enabled, on by default)"
        )
    doc = _read_doc(path)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise RecordingError(
            f"{path} is not an agl_lab recording of version {VERSION} "
            f"(format {doc.get('format')!r}, version {doc.get('version')!r})"
        )
    try:
        return Recording(
            step=doc["step"],
            batch_step=doc["batch_step"],
            policy_version=doc["policy_version"],
            seed=doc["seed"],
            rng=doc["rng"],
            pad_token_id=doc["pad_token_id"],
            rollouts=_rollouts(path, doc),
            metrics=doc["metrics"],
            weights=pd.DataFrame(doc["weights"]),
            dropped=pd.DataFrame(doc["dropped"]),
            path=path,
        )
    except RecordingError:
        raise
    except KeyError as e:
        raise RecordingError(f"{path} is damaged: it has no {e.args[0]!r} key") from None
    except (TypeError, ValueError) as e:
        raise RecordingError(f"{path} is damaged: {e}") from None


class RecordingError(ValueError):
    """A recording file that cannot be read (truncated, not gzip, not an agl_lab recording, a
    rollout missing fields); the message names the file and the problem."""


def _read_doc(path: Path) -> dict[str, Any]:
    """The JSON object of a recording file; RecordingError naming the file otherwise."""
    import zlib

    try:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
    except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, unreadable
        raise RecordingError(f"{path} is damaged: not a complete gzip file ({type(e).__name__}: {e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordingError(f"{path} is damaged: its content is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RecordingError(f"{path} is damaged: it holds a JSON {type(doc).__name__}, not a recording's object")
    return doc


def _rollouts(path: Path, doc: Mapping[str, Any]) -> list[CompletedRollout]:
    rollouts = doc["rollouts"]
    if not isinstance(rollouts, list):
        raise RecordingError(f"{path} is damaged: 'rollouts' is a {type(rollouts).__name__}, not a list")
    out = []
    for i, r in enumerate(rollouts):
        try:
            out.append(completed_rollout_from_dict(r))
        except KeyError as e:
            raise RecordingError(f"{path} is damaged: rollout {i} has no {e.args[0]!r} field") from None
        except (TypeError, ValueError, AttributeError) as e:
            if missing := re.findall(r"'(\w+)'", str(e)) if "missing" in str(e) else None:
                raise RecordingError(
                    f"{path} is damaged: rollout {i} has no {', '.join(map(repr, missing))} field"
                ) from None
            raise RecordingError(f"{path} is damaged: rollout {i} cannot be read ({type(e).__name__}: {e})") from None
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 3 else ", ".join(map(str, steps))
