"""The gateway forces the trained temperature over the agent's: recorded on every call it
changed (`triplet.metadata["overridden"]`) and said once. Real tiny model, gateway, Trainer.
"""

from __future__ import annotations

import logging

from agl_lab.server.gateway import overridden_params
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL


def cool_agent(task: dict, ctx) -> float:
    client = ctx.openai_client()
    for i, temperature in enumerate((0.2, None)):  # the second call leaves the temperature to the gateway
        kwargs = {} if temperature is None else {"temperature": temperature}
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"get {task['key']} {i}"}], max_tokens=3, **kwargs
        )
    return 0.0


def test_an_overridden_agent_temperature_is_recorded_per_call_and_said_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="agl_lab.server.gateway"):
        with Trainer.from_config(
            "configs/cpu_tiny.yaml",
            overrides=SMALL,
            agent=cool_agent,
            train_dataset=[{"key": k} for k in "abcd"],
            run_dir=tmp_path,
            console=False,
        ) as t:
            ro = t.rollout()
    for rollout in ro.rollouts:
        first, second = rollout.triplets
        assert first.metadata["overridden"] == {"temperature": {"agent": 0.2, "served": 1.0}}
        assert "overridden" not in second.metadata
    said = [r.getMessage() for r in caplog.records if "not the agent's" in r.getMessage()]
    assert len(said) == 1 and "temperature=1.0, not the agent's temperature=0.2 (train mode)" in said[0]


def test_only_a_different_value_counts_as_an_override():
    assert overridden_params({"temperature": 1.0}, {"temperature": 1.0}) == {}
    assert overridden_params({"temperature": None}, {"temperature": 1.0}) == {}
    assert overridden_params({"temperature": 0}, {"temperature": 0.7}) == {"temperature": {"agent": 0, "served": 0.7}}
