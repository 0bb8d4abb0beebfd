"""`agl-lab replay` on damaged recordings (issue 41, finding 7): one line naming the file and the
problem, exit 2, no traceback; a stray `step_7.json.gz` is no recording and breaks nothing.

Real command on a copy of the cassette (tests/fixtures/cassette) with one file damaged.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agl_lab.recording import step_path
from agl_lab.replay import replay_main

CASSETTE = Path(__file__).parent / "fixtures" / "cassette"


def _doc() -> dict:
    with gzip.open(step_path(CASSETTE, 2), "rt") as f:
        return json.load(f)


def _gz(obj) -> bytes:
    return gzip.compress(json.dumps(obj).encode())


def _without(doc: dict, key: str) -> dict:
    return {k: v for k, v in doc.items() if k != key}


def _rollout_without(doc: dict, field: str) -> dict:
    return {**doc, "rollouts": [_without(doc["rollouts"][0], field), *doc["rollouts"][1:]]}


DAMAGE = {
    "truncated gzip": (lambda raw: raw[: len(raw) // 2], "not a complete gzip file"),
    "random bytes": (lambda raw: bytes(range(256)) * 8, "not a complete gzip file"),
    "a JSON list": (lambda raw: _gz([1, 2, 3]), "holds a JSON list"),
    "not JSON": (lambda raw: gzip.compress(b"{oops"), "not JSON"),
    "no rollouts": (lambda raw: _gz(_without(_doc(), "rollouts")), "has no 'rollouts' key"),
    "a rollout missing a field": (
        lambda raw: _gz(_rollout_without(_doc(), "rollout_id")),
        "rollout 0 has no 'rollout_id' field",
    ),
}


@pytest.fixture
def run(tmp_path) -> Path:
    return Path(shutil.copytree(CASSETTE, tmp_path / "run"))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_recording_is_one_line_naming_the_file_and_exit_2(run, case, capsys):
    damage, problem = DAMAGE[case]
    path = step_path(run, 2)
    path.write_bytes(damage(path.read_bytes()))
    assert replay_main([str(run), "--step", "2"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"agl-lab replay: {path} is damaged") and problem in out, out


def test_a_stray_step_7_file_is_no_recording_and_the_cli_prints_no_traceback(run):
    (run / "recording" / "step_7.json.gz").write_bytes(b"junk")  # not step_NNNNNN: not a recording
    step_path(run, 1).write_bytes(b"junk")
    env_root = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-m", "agl_lab.cli", "replay", str(run), "--step"]
    ok = subprocess.run([*cmd, "2"], capture_output=True, text=True, timeout=600, cwd=env_root)
    assert ok.returncode == 0 and "every engine-independent metric and table equal" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([*cmd, "1"], capture_output=True, text=True, timeout=600, cwd=env_root)
    assert bad.returncode == 2 and "Traceback" not in bad.stdout + bad.stderr
    assert bad.stdout.strip() == (
        f"agl-lab replay: {step_path(run, 1)} is damaged: not a complete gzip file "
        "(BadGzipFile: Not a gzipped file (b'ju'))"
    )
