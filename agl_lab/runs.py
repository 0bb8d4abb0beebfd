"""A run directory on disk: new, unfinished or finished — and a metrics log whose steps never repeat.

    RUN_DIR/metrics.jsonl   one record per step (agl_lab.logger.MetricsLogger)
    RUN_DIR/finished.json   written last by `agl-lab train`, after its last step ended normally

A run is finished exactly when `finished.json` is there: `agl-lab train` removes it before it
trains into the directory again (`--resume`) and writes it after everything else, so a run
stopped at any point — SIGTERM, SIGKILL, a crash — reads as unfinished. `agl-lab sweep` decides
"done" from it and nothing else. No torch here: the sweep reads it in a light process. The
marker names the command (`argv`) with secret overrides redacted (`public_argv`).

A step *repeats* when two records of one step share a metric (a second run appended to the
first: steps `[1, 2, 3, 1, 2, 3]`); a validation logged before training beside that step's
training record shares none, so it is no repeat. `read_records` refuses a log whose steps
repeat, or with `repeated="keep_last"` keeps the last copy of each step and warns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

FINISHED = "finished.json"
METRICS = "metrics.jsonl"


def finished(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The finished marker's record (`step`, `argv`, `wall_s`), None while the run is not finished."""
    path = Path(run_dir) / FINISHED
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # written atomically, so only a hand edit breaks it: still a finished run
        return {}


def mark_finished(run_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write the finished marker (atomically: a kill leaves none or the whole one)."""
    path = Path(run_dir) / FINISHED
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def public_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of each secret override (`agl_lab.config.SECRET_KEYS`) replaced by
    `<redacted>`: what a run directory may keep of its command."""
    from agl_lab.config import REDACTED, SECRET_KEYS

    def secret(arg: str) -> bool:
        return "=" in arg and arg.split("=", 1)[0].lstrip("+~") in SECRET_KEYS

    return [f"{arg.split('=', 1)[0]}={REDACTED}" if secret(arg) else arg for arg in argv]


def clear_finished(run_dir: str | os.PathLike) -> None:
    """The run is about to train again: it is unfinished until its new last step ends."""
    Path(run_dir, FINISHED).unlink(missing_ok=True)


def logged_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps of `metrics.jsonl`'s records in order (a line a kill cut short is skipped)."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return steps


def run_state(run_dir: str | os.PathLike) -> str:
    """`finished` (the marker is there), `unfinished` (steps logged, no marker) or `new`."""
    if finished(run_dir) is not None:
        return "finished"
    return "unfinished" if logged_steps(run_dir) else "new"


def repeated_steps(records: Sequence[dict[str, Any]]) -> list[int]:
    """The steps that repeat (two records of the step share a metric), in order of first repeat."""
    seen: dict[int, set[str]] = {}
    repeats: list[int] = []
    for record in records:
        step, keys = record.get("step"), set(record) - {"step"}
        if step in seen and seen[step] & keys and step not in repeats:
            repeats.append(step)
        seen.setdefault(step, set()).update(keys)
    return repeats


def keep_last(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log as the last run wrote it: a record that repeats step s starts over from s, so the
    earlier copies of steps >= s are dropped (what a resume from step s − 1 would have done)."""
    out: list[dict[str, Any]] = []
    for record in records:
        step, keys = record.get("step"), set(record) - {"step"}
        if any(r.get("step") == step and (set(r) - {"step"}) & keys for r in out):
            out = [r for r in out if r.get("step", 0) < step]
        out.append(record)
    return out


def read_records(path: str | os.PathLike, repeated: str = "error") -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, in order. Steps that repeat raise ValueError naming the
    file, the steps and the fix (`repeated="error"`), or keep each step's last copy with a
    warning (`repeated="keep_last"`)."""
    if repeated not in ("error", "keep_last"):
        raise ValueError(f"repeated={repeated!r} is not one of 'error', 'keep_last'")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    repeats = repeated_steps(records)
    if not repeats:
        return records
    shown = ", ".join(map(str, repeats[:10])) + (" …" if len(repeats) > 10 else "")
    what = f"{path} logs step(s) {shown} more than once (a run appended to another)"
    if repeated == "error":
        raise ValueError(
            f"{what}: read one run's directory, or keep each step's last copy "
            "(read_metrics(..., repeated='keep_last'); compare(..., repeated='keep_last'))"
        )
    warnings.warn(f"{what}: kept each step's last copy", stacklevel=2)
    return keep_last(records)


# ---------------------------------------------------------------------------------------------
# A step's end lands whole: its checkpoint, recording and metrics line
# ---------------------------------------------------------------------------------------------

_depth = 0  # nesting of `step_end()` blocks (the main thread's: signal handlers run there)
_deferred: list[int] = []  # stop signals that arrived inside one


@contextlib.contextmanager
def step_end() -> Iterator[None]:
    """A block that a stop signal does not cut: `agl-lab train`'s SIGTERM handler (which asks
    `defer_stop`) lets it finish, then the signal is raised again at its end.

    The Trainer wraps a step's checkpoint, recording and metrics line in it. Cut between the
    checkpoint of step N and its metrics line, a run resumed from that checkpoint at step N + 1
    and its log lacked step N (a SIGTERMed sweep, relaunched, showed `[1, 3, 4, …]`)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _deferred:
            signum = _deferred[0]
            _deferred.clear()
            signal.raise_signal(signum)  # the handler runs now, outside the block


def defer_stop(signum: int) -> bool:
    """For a stop handler: inside `step_end()`, keep the signal for the block's end and say True."""
    if _depth:
        _deferred.append(signum)
        return True
    return False
