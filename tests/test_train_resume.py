"""`agl-lab train` killed with -9 and resumed: the metrics log matches the model that resumed,
`--resume` parses wherever it stands, and no file of the run holds the admin key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agl_lab.cli import _bare_resume, resume_overrides
from agl_lab.config import ConfigError
from agl_lab.logger import read_metrics
from tests.trainer_runs import SMALL

SECRET = "admin-key-that-must-not-be-written"
KILL_AT = "AGL_TEST_KILL_AT_ROLLOUT"


def _train(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agl_lab.cli", "train", *args], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two CLI runs, eight steps: minutes on a loaded 2-core machine
def test_kill_9_then_resume_logs_each_step_once_and_writes_no_secret(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    overrides = [
        *SMALL,
        "trainer.total_training_steps=5",
        "trainer.save_freq=2",
        f"trainer.default_local_dir={ckpt}",
        "agl_lab.agent=tests.agents_for_tests:killed_lookup_agent",
        f"agentlightning.agl_key={SECRET}",
    ]
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        KILL_AT: str(3 * 8 + 1),
    }  # 8 rollouts a step: the first rollout of step 4
    killed = _train(["configs/cpu_tiny.yaml", "--run-dir", str(run), *overrides], env)
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_2"]

    del env[KILL_AT]  # `--resume` followed by an override: a bare --resume, not a checkpoint path
    resumed = _train(["configs/cpu_tiny.yaml", "--run-dir", str(run), "--resume", *overrides], env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'global_step_2'} at step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    written = [run / "config.yaml", *ckpt.glob("global_step_*/config.yaml")]
    assert len(written) == 4  # the run's, global_step_2's, _4's and _5's (the last step saves too)
    for path in written:
        text = path.read_text()
        assert SECRET not in text and "agl_key: <redacted>" in text, path
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


@pytest.mark.parametrize(
    "argv, resume, rest",
    [
        (["c.yaml", "--resume", "a.b=1"], "auto", ["c.yaml", "a.b=1"]),
        (["c.yaml", "a.b=1", "--resume"], "auto", ["c.yaml", "a.b=1"]),
        (["--resume", "c.yaml", "a.b=1"], "auto", ["c.yaml", "a.b=1"]),
        (["c.yaml", "--resume", "--steps", "2"], "auto", ["c.yaml", "--steps", "2"]),
    ],
)
def test_resume_parses_wherever_it_stands(tmp_path, monkeypatch, argv, resume, rest):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("{}\n")
    out = _bare_resume(argv)
    assert [a for a in out if not a.startswith("--resume")] == rest
    assert any(a in ("--resume", "--resume=auto") for a in out)


def test_resume_names_a_path_that_is_no_checkpoint(tmp_path):
    ckpt = tmp_path / "global_step_3"
    ckpt.mkdir()
    with pytest.raises(ConfigError, match="--resume .* is not a checkpoint directory"):
        resume_overrides(str(ckpt))
    (ckpt / "trainer_state.pt").write_bytes(b"")
    assert resume_overrides(str(ckpt)) == ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"]
    assert _bare_resume(["c.yaml", "--resume", str(ckpt)]) == ["c.yaml", "--resume", str(ckpt)]


def test_what_the_trainer_writes_or_uploads_holds_no_key_but_names_where_it_comes_from():
    from omegaconf import OmegaConf

    from agl_lab.config import load_config, redact_secrets, to_container, unredact

    cfg = load_config("configs/cpu_tiny.yaml", [f"agentlightning.agl_key={SECRET}"])
    assert to_container(cfg)["agentlightning"]["agl_key"] == "<redacted>"  # what W&B gets
    saved = redact_secrets(cfg)
    assert saved.agentlightning.agl_key == "<redacted>" and cfg.agentlightning.agl_key == SECRET
    unredact(saved)
    assert saved.agentlightning.agl_key == ""  # read back: an embedded server makes a fresh key
    env = load_config("configs/cpu_tiny.yaml", ["agentlightning.agl_key=${oc.env:AGL_TEST_KEY,x}"])
    assert "${oc.env:AGL_TEST_KEY,x}" in OmegaConf.to_yaml(redact_secrets(env))  # an interpolation names no secret
