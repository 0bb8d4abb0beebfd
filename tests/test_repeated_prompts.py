"""Repeated prompts: AGL v1's triplet reduction keeps the last call per distinct prompt (meant
for retries); agl_lab keeps that behaviour, counts what it drops, and has a switch that keeps
every call. Real tiny model, gateway, runner and Trainer.
"""

from __future__ import annotations

import pytest

from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

ASKS = 4  # the agent sends the very same prompt this many times


def same_prompt_agent(task: dict, ctx) -> float:
    client = ctx.openai_client()
    messages = [{"role": "user", "content": f"get {task['key']}"}]
    for _ in range(ASKS):  # e.g. sampling several answers to one question on purpose
        client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    return 0.5


TASKS = [{"key": k} for k in "abcd"]


def _trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=[*SMALL, *extra],
        agent=same_prompt_agent,
        train_dataset=TASKS,
        run_dir=tmp_path,
        console=False,
    )


def test_repeated_prompts_are_dropped_as_agl_does_and_counted(tmp_path, capsys):
    with _trainer(tmp_path) as trainer:
        ro = trainer.rollout()
        tri = ro.triplets
        assert len(tri) == len(ro.rollouts) == 8  # one call kept per rollout
        assert (tri.repeats_dropped == ASKS - 1).all()
        b = trainer.build_batch(ro)
        assert b.metrics["training/n_repeated_prompt_calls_dropped"] == 8 * (ASKS - 1)
        trainer.dry_run(TASKS[0])
    assert f"{ASKS - 1} call(s) repeated an identical prompt and were dropped" in capsys.readouterr().out


def test_keep_repeated_prompts_keeps_every_call(tmp_path):
    with _trainer(tmp_path, "agl_lab.rollout.keep_repeated_prompts=true") as trainer:
        ro = trainer.rollout()
        assert len(ro.triplets) == 8 * ASKS and (ro.triplets.repeats_dropped == 0).all()
        assert trainer.build_batch(ro).metrics["training/n_repeated_prompt_calls_dropped"] == 0


@pytest.mark.parametrize("value", ["maybe"])
def test_keep_repeated_prompts_is_a_boolean(value):
    from agl_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"agl_lab\.rollout\.keep_repeated_prompts must be true or false"):
        load_config(None, [f"agl_lab.rollout.keep_repeated_prompts={value}"])
