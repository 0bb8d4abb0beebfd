"""`agl-lab train` errors found after the config loads (issue 41, finding 6) are one line naming
what to fix, exit 2, no traceback: val_only without validation tasks, an agent module that does
not exist, an unknown task, a bad trainer.resume_mode (found in fit(), after the engine is built),
a YAML syntax error, an external server that does not match the engine.

Real `train_main` (the tiny model, the real embedded/external server), in process.
"""

from __future__ import annotations

import pytest

from agl_lab.cli import train_main
from tests.trainer_runs import SMALL


def _train(tmp_path, capsys, *overrides: str, config: str = "configs/cpu_tiny.yaml") -> tuple[int, str]:
    rc = train_main(
        [
            config,
            "--run-dir",
            str(tmp_path / "run"),
            *SMALL,
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'ck'}",
            *overrides,
        ]
    )
    out = capsys.readouterr().out
    return rc, [
        line
        for line in out.splitlines()
        if line.startswith("agl-lab train: ")
        and "run dir" not in line
        and not line.startswith(("agl-lab train: server ", "agl-lab train: checkpoints "))
    ]


CASES = {
    "val_only without validation tasks": (
        ["trainer.val_only=true", "agl_lab.task.n_val=0"],
        "trainer.val_only=true but there are no validation tasks",
    ),
    "an agent module that does not exist": (
        ["agl_lab.agent=no_such_agents_module:solve"],
        "no module named 'no_such_agents_module': agl_lab.agent",
    ),
    "an unknown task": (["agl_lab.task.name=no-such-task"], "unknown task 'no-such-task'; known tasks are"),
    "a bad trainer.resume_mode": (
        ["trainer.resume_mode=sometimes"],
        "trainer.resume_mode='sometimes' is not one of auto, resume_path, disable",
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_an_error_found_after_the_config_loads_is_one_line_and_exit_2(tmp_path, capsys, case):
    overrides, message = CASES[case]
    rc, lines = _train(tmp_path, capsys, *overrides)
    assert rc == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_training_steps: [1\n")
    rc, lines = _train(tmp_path, capsys, config=str(bad))
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"agl-lab train: {bad} (or an override) is not valid YAML: ") and "line 2" in lines[0]


@pytest.mark.timeout(600)
def test_an_external_server_that_does_not_match_the_engine_is_one_line(tmp_path, capsys):
    from agl_lab.server.embedded import EmbeddedServer

    with EmbeddedServer(key="k", default_proxy={"model_name": "served-elsewhere"}) as server:
        rc, lines = _train(
            tmp_path,
            capsys,
            "agl_lab.server.embedded=false",
            f"agentlightning.agl_base_url={server.url}",
            "agentlightning.agl_key=k",
            "agl_lab.runner.enabled=false",
        )
    assert rc == 2 and len(lines) == 1, lines
    assert "does not match this engine: its default_proxy.model_name is 'served-elsewhere'" in lines[0]


@pytest.mark.timeout(600)
def test_a_checkpoint_that_fills_the_disk_is_one_line_naming_the_disk(tmp_path, capsys):
    """Finding 11 through `agl-lab train`: checkpoints on a 256 KiB tmpfs (mounted where this
    process may mount one): one line saying the disk is full, exit 1, no `.global_step_N.tmp` left."""
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:200]}")
    try:
        rc, lines = _train(tmp_path, capsys, f"trainer.default_local_dir={small}", "trainer.save_freq=1")
        left = sorted(p.name for p in small.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
    assert rc == 1 and len(lines) == 1, lines
    assert f"checkpoint of step 1 not written: no space left on the disk holding {small}" in lines[0], lines
    assert left == [], left
