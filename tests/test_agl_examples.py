"""AGL v1's gsm8k example agents' contract, run as a new user would: agents of the same shape as
`examples/gsm8k/gsm8k_agent.py`'s `ChatAgent` and `CompletionAgent` (tests/agents_for_tests.py,
written here), that example's config keys (`agentlightning.local.agent_class` in AGL's dotted
form, `env_map` with `input.question` / `input.answer`, `data.train_files`: a JSONL of 8
questions), one real step of `agl-lab train` on the tiny model: every rollout a subprocess.
"""

from __future__ import annotations

import json

import pytest

from agl_lab.cli import train_main
from agl_lab.engines.tiny import tiny_model_dir
from agl_lab.recording import load_recording
from tests.trainer_runs import write_jsonl

QUESTIONS = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?", "answer": str(a + b)}
    for a, b in [(3, 4), (5, 2), (7, 8), (2, 9), (6, 6), (1, 3), (4, 5), (8, 1)]
]


def _args(tmp_path, agent: str, *extra: str) -> list[str]:
    train = write_jsonl(tmp_path / "gsm8k_train.jsonl", QUESTIONS)
    return [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(tmp_path / "run"),
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1",
        f"data.train_files={train}",
        f"actor_rollout_ref.model.path={tiny_model_dir(seed=0)}",
        f"agentlightning.local.agent_class=tests.agents_for_tests.{agent}",
        "agentlightning.local.env_map.QUESTION=input.question",
        "agentlightning.local.env_map.ANSWER=input.answer",
        *extra,
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("agent", ["GsmChatAgent", "GsmCompletionAgent"])
def test_an_agl_gsm8k_shaped_agent_trains_one_step_and_the_start_line_names_it(tmp_path, capsys, agent):
    extra = [f"agentlightning.local.env_map.GSM8K_MODEL={tiny_model_dir(seed=0)}"] if "Completion" in agent else []
    assert train_main(_args(tmp_path, agent, *extra)) == 0
    out = capsys.readouterr().out
    start = next(line for line in out.splitlines() if "run dir" in line)
    assert f"agent tests.agents_for_tests.{agent}" in start and "gsm8k_train.jsonl" in start
    assert "task " not in start  # the agent class and data files replaced the preset's task
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["training/n_rollouts"] == 8 and line["training/n_failed_rollouts"] == 0
    rec = load_recording(tmp_path / "run", 1)
    assert len(rec.rollouts) == 8
    for rollout in rec.rollouts:
        assert rollout.state == "succeeded" and rollout.final_reward in (0.0, 1.0)
        assert len(rollout.triplets) == 1 and rollout.triplets[0].response_ids  # one call, through the gateway
