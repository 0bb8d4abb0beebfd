"""The `./lab` script and the repository's ignore rules, run for real on a copy of the script.

The copy sits in a temporary folder with a stamped `.venv` whose `jupyter` only prints its
arguments, so `./lab notebook` runs its own logic (set-up check, PYTHONPATH, root handling)
without installing or starting anything.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fake_checkout(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    for name in ("lab", "pyproject.toml", "requirements-weights.txt", "requirements-envs.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    purelib = tmp_path / ".venv" / "site-packages"
    purelib.mkdir()
    for exe in ("python", "jupyter"):  # `python -c …` answers the purelib folder, anything else echoes
        (bin_dir / exe).write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo "{purelib}"; else echo "ARGS $*"; fi\n')
        (bin_dir / exe).chmod(0o755)
    digest = hashlib.sha256(
        (tmp_path / "pyproject.toml").read_bytes()
        + (tmp_path / "requirements-weights.txt").read_bytes()
        + (tmp_path / "requirements-envs.txt").read_bytes()
    ).hexdigest()[:16]
    (tmp_path / ".venv" / ".agl_lab_installed").write_text(f"{digest} dev\n")
    return tmp_path


def test_lab_notebook_allows_root_exactly_when_run_as_root(tmp_path):
    checkout = _fake_checkout(tmp_path)
    out = subprocess.run(
        ["bash", str(checkout / "lab"), "notebook", "--no-browser"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "installing" not in out.stderr  # the stamp matched: the fake environment was used as it is
    args = out.stdout.strip().splitlines()[-1]
    assert args.startswith("ARGS lab --notebook-dir=notebooks") and args.endswith("--no-browser")
    assert ("--allow-root" in args) == (os.geteuid() == 0)


def test_lab_setup_puts_the_checkout_on_the_path_so_the_folder_holding_the_clone_cannot_shadow_it(tmp_path):
    checkout = _fake_checkout(tmp_path / "agl_lab")  # a clone named like the package
    out = subprocess.run(["bash", str(checkout / "lab"), "notebook"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pth = checkout / ".venv" / "site-packages" / "agl_lab_checkout.pth"
    assert pth.read_text().strip() == str(checkout)
    # what that path entry does, with the real package: run from the folder that holds a clone
    # named agl_lab, the import finds the package, not the clone as an empty namespace
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "agl_lab").symlink_to(ROOT)
    site = tmp_path / "site"
    site.mkdir()
    (site / "agl_lab_checkout.pth").write_text(f"{ROOT}\n")
    code = "import sys, site; {} from agl_lab import Trainer; print('ok')"
    shadowed = subprocess.run(
        [sys.executable, "-c", code.format("")],
        cwd=holder,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    fixed = subprocess.run(
        [sys.executable, "-c", code.format(f"site.addsitedir({str(site)!r});")],
        cwd=holder,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if shadowed.returncode:  # an editable install (setuptools' finder) is shadowed; a plain install is not
        assert "cannot import name 'Trainer' from 'agl_lab' (unknown location)" in shadowed.stderr
    assert fixed.stdout.strip() == "ok", fixed.stderr[-2000:]


def test_checkpoints_and_runs_are_git_ignored():
    for path in ("checkpoints/agl_lab/run/global_step_1/trainer_state.pt", "runs/demo/metrics.jsonl"):
        out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path], timeout=30)
        assert out.returncode == 0, f"{path} is not git-ignored"


def test_a_second_demo_starts_afresh_and_keeps_the_previous_run(tmp_path):
    # agl-lab train refuses a directory that holds a run; ./lab demo moves the last demo aside
    prior = tmp_path / "runs" / "demo"
    prior.mkdir(parents=True)
    (prior / "metrics.jsonl").write_text('{"step": 1}\n')
    (prior / "finished.json").write_text("{}")
    script = f'source <(sed -n "/^fresh_demo_dir() {{/,/^}}/p" {ROOT / "lab"}); fresh_demo_dir; fresh_demo_dir'
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert not prior.exists() and (tmp_path / "runs/demo.previous/metrics.jsonl").read_text() == '{"step": 1}\n'
    assert out.stderr.count("runs/demo.previous") == 1  # the second call has nothing to move
