"""Every `agl-lab` entry point turns an error a user can cause into one line naming what to fix,
exit 2, no traceback (issue 41, item 2; finding 8 for `serve --store`).

Each case runs the real `agl-lab` command in a subprocess (the console script beside this
Python, or `python -m agl_lab.cli` where it is not installed) and asserts its exit status, that
no traceback is printed, and that one line, starting `agl-lab` (or argparse's usage), names the
problem (a config with several unknown keys lists them below it, one a line). `train`'s errors found after
the config loads are in tests/test_cli_train_errors.py (in process, with the tiny model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import scaled

_SCRIPT = Path(sys.executable).with_name("agl-lab")
AGL_LAB = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "agl_lab.cli"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Paths a user gets wrong: a text file, a directory, a file where a folder should be."""
    text = tmp_path / "notes.txt"
    text.write_text("these are notes, not a database\n" * 200)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"text": str(text), "folder": str(folder), "tmp": str(tmp_path)}


# (command arguments with {text}, {folder}, {tmp} filled in, a fragment the one line names)
CASES = {
    "serve: --store a file that is not a database": (
        ["serve", "--store", "sqlite:///{text}"],
        "is not a database",
    ),
    "serve: --store a directory": (["serve", "--store", "sqlite:///{folder}"], "is a directory: name a file"),
    "serve: --store under a file": (
        ["serve", "--store", "sqlite:///{text}/sub/store.db"],
        "cannot create the folder",
    ),
    "serve: --store an unknown scheme": (["serve", "--store", "{text}"], "unknown store url"),
    "serve: a limit out of range": (["serve", "--max-body-bytes", "-5"], "max_body_bytes"),
    "serve: a public address without a key": (["serve", "--host", "0.0.0.0"], "refusing to bind 0.0.0.0 without a key"),
    "serve: a missing key file": (["serve", "--key-file", "{tmp}/no-key"], "cannot read --key-file"),
    "serve: --tokenizer-path without --token-preserving": (
        ["serve", "--tokenizer-path", "{folder}"],
        "--tokenizer-path is only used with --token-preserving",
    ),
    "serve: a port that is not a number": (["serve", "--port", "http"], "invalid int value"),
    "engine: --model-path not a model": (["engine", "--model-path", "{folder}"], "not a Hugging Face model directory"),
    "engine: --max-batch-size 0": (["engine", "--max-batch-size", "0"], "--max-batch-size must be ≥ 1"),
    "engine: an unknown device": (["engine", "--device", "tpu"], "use cpu or cuda"),
    "engine: --max-model-len beyond the model": (
        ["engine", "--device", "cpu", "--max-model-len", "999999"],
        "exceeds the model's max_position_embeddings",
    ),
    "engine: beyond loopback without a key": (
        ["engine", "--device", "cpu", "--host", "192.0.2.1"],
        "refusing to bind 192.0.2.1 without a key",
    ),
    "engine: a host that is not this machine's": (
        ["engine", "--device", "cpu", "--host", "192.0.2.1"],
        "cannot listen on 192.0.2.1:8001",
    ),
    "sweep: a config that does not exist": (["sweep", "{tmp}/none.yaml", "a=1,2"], "config file not found"),
    "sweep: an unknown key in an axis": (
        ["sweep", "configs/cpu_tiny.yaml", "trainer.nope=1,2"],
        "setting nope=1: Config has unknown keys",
    ),
    "sweep: --seeds not integers": (["sweep", "configs/cpu_tiny.yaml", "--seeds", "x"], "--seeds 'x'"),
    "sweep: --parallel 0": (["sweep", "configs/cpu_tiny.yaml", "--parallel", "0"], "--parallel must be >= 1"),
    "sweep: --out a file": (["sweep", "configs/cpu_tiny.yaml", "--out", "{text}"], "is a file: name a directory"),
    "sweep: not key=value": (["sweep", "configs/cpu_tiny.yaml", "lr"], "'lr' is not key=value"),
    "train: a config that does not exist": (["train", "{tmp}/none.yaml"], "config file not found"),
    "train: --steps below 0": (["train", "configs/cpu_tiny.yaml", "--steps", "-1"], "--steps must be >= 0"),
    "train: an unknown key": (["train", "configs/cpu_tiny.yaml", "trainer.nope=1"], "Config has unknown keys"),
    "replay: a run dir without a recording": (["replay", "{folder}"], "holds no recording"),
    "runner: no server": (["runner", "--agent", "x:y"], "--server URL is required"),
    "runner: a server that is not a URL": (["runner", "--server", "notaurl", "--agent", "x:y"], "must be an http://"),
    "runner: an agent module that does not exist": (
        ["runner", "--server", "http://127.0.0.1:9", "--agent", "no_such_agents_module:solve"],
        "No module named 'no_such_agents_module'",
    ),
    "agl-lab: an unknown command": (["nosuch"], "unknown command 'nosuch'"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_a_users_error_is_one_line_and_exit_2(files, case):
    args, fragment = CASES[case]
    env = {k: v for k, v in os.environ.items() if k not in ("AGL_KEY", "AGL_SERVER_URL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("AGL_ENGINE_KEY", None)
    if case == "engine: a host that is not this machine's":
        env["AGL_ENGINE_KEY"] = "a-key-for-this-test"  # past the key check, to the bind
    done = subprocess.run(
        [*AGL_LAB, *(a.format(**files) for a in args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    lines = [line for line in output.splitlines() if fragment in line]
    assert len(lines) == 1, output[-2000:]
    assert lines[0].startswith(("agl-lab", "usage:")), lines[0]
    if case == "train: an unknown key":
        assert "unknown key 'trainer.nope'" in output
