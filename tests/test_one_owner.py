"""One owner per fact: the config is read in one place, and every default is defined once.

- `agl_lab.config` is light: composing and validating any shipped config imports neither torch
  nor verl (choices and checks live in the pure-Python `agl_lab.rules`).
- The Trainer and replay (and so what-if) build batches with the same options: both take them
  from `config.batch_options`, for every shipped config.
- Mini-batch rows, the serving defaults and the loss name come from `agl_lab.rules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from agl_lab import rules
from agl_lab.config import batch_options, load_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))


def _fresh(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1]


def test_composing_every_shipped_config_imports_neither_torch_nor_verl():
    code = (
        "import glob, json, sys, warnings\nwarnings.simplefilter('ignore')\nimport agl_lab.config as c\n"
        "for f in sorted(glob.glob('configs/*.yaml')):\n    c.load_config(f)\n"
        "print(json.dumps([m for m in ('torch', 'verl', 'ray', 'numpy', 'transformers') if m in sys.modules]))"
    )
    assert json.loads(_fresh(code)) == []


class _Stop(Exception):
    """Raised by the captured build_batch once it has its arguments."""


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_replay_builds_batches_with_the_trainers_options(path, tmp_path, monkeypatch):
    import agl_lab.batch
    from agl_lab import replay
    from agl_lab.trainer import Trainer

    cfg = load_config(path)
    seen: list[dict] = []

    def capture(rollouts, **kwargs):
        seen.append(kwargs)
        raise _Stop

    monkeypatch.setattr(agl_lab.batch, "build_batch", capture)
    tokenizer = SimpleNamespace(pad_token_id=7)

    trainer = Trainer.__new__(Trainer)  # just the stage: no engine, server or runner
    trainer.cfg, trainer.engine, trainer._last_rollout = cfg, SimpleNamespace(tokenizer=tokenizer), None
    with pytest.raises(_Stop):
        trainer.build_batch(SimpleNamespace(rollouts=[], step=1))

    OmegaConf.save(cfg, tmp_path / "config.yaml")
    monkeypatch.setattr(
        replay, "load_recording", lambda run_dir, step: SimpleNamespace(rollouts=[], pad_token_id=7, batch_step=step)
    )
    with pytest.raises(_Stop):
        replay.replay_step(tmp_path, 1, tokenizer=tokenizer)

    # the same options; only the container differs: replay's batch is agl_lab's (no verl, no Ray)
    assert seen[1].pop("container") == "agl" and seen[0].get("container", "verl") == "verl"
    assert seen[0] == seen[1]
    assert {k: v for k, v in seen[0].items() if k not in ("tokenizer", "pad_token_id")} == batch_options(cfg)


def test_batch_options_follow_the_level_asked_for():
    cfg = load_config("configs/cpu_tiny.yaml", ["data.max_prompt_length=100", "data.max_response_length=50"])
    assert batch_options(cfg, "transition")["max_prompt_length"] == 100
    assert batch_options(cfg, "trajectory")["max_prompt_length"] == int(
        cfg.agentlightning.trace_aggregator.trajectory_max_prompt_length
    )


def test_mini_batch_rows_are_counted_in_tasks_times_group_size_everywhere():
    from agl_lab.config import update_options
    from agl_lab.engines.local_ppo import ActorUpdateConfig

    cfg = load_config(
        "configs/cpu_tiny.yaml",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=6"],
    )
    assert rules.mini_batch_rows(3, 4) == 12
    assert update_options(cfg)["mini_batch_rows"] == 12
    actor = ActorUpdateConfig.from_verl_actor_config(cfg.actor_rollout_ref.actor, rollout_n=4)
    assert actor.ppo_mini_batch_size == 12


def test_the_loss_mode_default_is_one_name():
    from agl_lab.engines.local_ppo import ActorUpdateConfig

    assert ActorUpdateConfig().loss_mode == rules.LOSS_NAME
    assert ActorUpdateConfig.from_verl_actor_config({"ppo_mini_batch_size": 1}).loss_mode == rules.LOSS_NAME
    assert load_config("configs/cpu_tiny.yaml").actor_rollout_ref.actor.policy_loss.loss_mode == rules.LOSS_NAME


def test_serving_defaults_are_the_configs():
    import inspect

    from agl_lab.engines.local import LocalEngine
    from agl_lab.engines.serving.openai_server import OpenAIServer
    from agl_lab.engines.serving.scheduler import BatchScheduler

    lab = load_config("configs/cpu_tiny.yaml").agl_lab
    assert lab.engine_options.batch_window_ms == rules.BATCH_WINDOW_MS
    assert lab.engine_options.max_batch_size == rules.MAX_BATCH_SIZE
    assert lab.model.max_model_len == rules.MAX_MODEL_LEN
    for cls in (LocalEngine, OpenAIServer, BatchScheduler):
        params = inspect.signature(cls.__init__).parameters
        assert params["batch_window_ms"].default == rules.BATCH_WINDOW_MS, cls
        assert params["max_batch_size"].default == rules.MAX_BATCH_SIZE, cls
        if "max_model_len" in params:
            assert params["max_model_len"].default == rules.MAX_MODEL_LEN, cls


def test_every_parity_switch_reaches_the_update():
    from agl_lab.config import update_options

    on = ["agl_lab.parity.bf16_rewards=true", "agl_lab.parity.grpo_float32=true", "agl_lab.parity.drop_order=agl"]
    opts = update_options(load_config("configs/cpu_tiny.yaml", on))
    assert (opts["bf16_rewards"], opts["grpo_float32"], opts["drop_order"]) == (True, True, "agl")
    assert set(load_config("configs/cpu_tiny.yaml").agl_lab.parity) == {"bf16_rewards", "grpo_float32", "drop_order"}
