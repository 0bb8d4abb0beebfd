"""reasoning-gym with calc's calculator tool (`agl_lab.task.tools: [calculator]`, agl_lab/tasks/rgym.py).

The agent's tool loop driven by a scripted SDK-shaped model (tool calls as the OpenAI SDK returns
them), and one training step of the tiny model through the real gateway and runner.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from agl_lab.cli import train_main
from agl_lab.recording import load_recording
from agl_lab.tasks import calc, get_task, rgym
from tests.fakes import ScriptedToolModel
from tests.trainer_runs import SMALL

if importlib.util.find_spec("reasoning_gym") is None:
    pytest.skip("the envs extra (requirements-envs.txt) is not installed", allow_module_level=True)

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"]}
OPTIONS = {"tools": ["calculator"], "size": 16, "seed": 5, "config": {**CONFIG, "allow_parentheses": False}}


def _task():
    return get_task("reasoning_gym:basic_arithmetic", OPTIONS).train_tasks(4, seed=0)[1]


def _expression(task):
    return rgym.entry_for(task)["metadata"]["expression"]


def test_the_tool_option_picks_the_tool_agent_and_unknown_tools_or_keys_fail_naming_the_key():
    assert get_task("reasoning_gym:basic_arithmetic", OPTIONS).agent is rgym.tool_agent
    assert get_task("reasoning_gym:basic_arithmetic", {**OPTIONS, "tools": []}).agent is rgym.reasoning_gym_agent
    with pytest.raises(ValueError, match=r"agl_lab.task.tools must be a list of tool names from \['calculator'\]"):
        get_task("reasoning_gym:basic_arithmetic", {**OPTIONS, "tools": ["abacus"]})
    with pytest.raises(ValueError, match="agl_lab.task.tools"):
        get_task("reasoning_gym:basic_arithmetic", {**OPTIONS, "tools": "calculator"})


def test_a_tool_call_runs_its_result_reaches_the_next_call_and_the_reward_is_the_verifiers():
    task = _task()
    result = calc.calculator(json.dumps({"expression": _expression(task)}))
    assert result == task["answer"]  # the calculator gets this dataset's 2-term questions right
    model = ScriptedToolModel([(None, [_expression(task)]), (result, [])])
    assert rgym.tool_agent(task, model) == 1.0
    first, second = model.seen
    assert first[0] == {"role": "system", "content": calc.SYSTEM_PROMPT}
    assert first[-1] == {"role": "user", "content": task["question"]}
    assert sum(1 for m in first if m.get("tool_calls")) == 2  # the two worked examples
    assert second[-1] == {"role": "tool", "tool_call_id": "c1_0", "content": result}
    assert second[-2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert all(o["tools"] == calc.TOOLS and o["stop"] == calc.TOOL_CALL_STOP for o in model.options)
    assert [o["max_tokens"] for o in model.options] == [calc.MAX_TOKENS, calc.ANSWER_MAX_TOKENS]
    (kind, data), *_ = model.events
    assert kind == "task_result" and data["tool_called"] and data["answer_is_tool_result"]
    assert data["reward"] == 1.0 and data["answer"] == result


def test_no_credit_for_calling_the_tool_the_verifier_decides():
    task = _task()
    wrong = str(int(task["answer"]) + 1000)
    model = ScriptedToolModel([(None, [_expression(task)]), (f"Answer: {wrong}", [])])
    value = rgym.tool_agent(task, model)
    verdict = rgym.dataset_for(task).score_answer(wrong, rgym.entry_for(task))
    assert value == pytest.approx(verdict) and value < 1.0
    data = model.events[0][1]
    assert data["tool_called"] and not data["answer_is_tool_result"] and data["answer"] == wrong
    # right without the tool: full reward, the calculator not called
    model = ScriptedToolModel([(task["answer"], [])])
    assert rgym.tool_agent(task, model) == 1.0
    assert model.events[0][1]["tool_called"] is False and model.events[0][1]["answer_is_tool_result"] is False


def test_the_loop_stops_after_calcs_max_turns_without_an_answer():
    task = _task()
    model = ScriptedToolModel([(None, ["1 + 1"])] * calc.MAX_TURNS)
    assert rgym.tool_agent(task, model) == 0.0
    assert len(model.seen) == calc.MAX_TURNS and model.events[0][1]["answer"] is None


@pytest.mark.timeout(900)
def test_agl_lab_train_runs_reasoning_gym_with_the_calculator_through_the_gateway(tmp_path):
    run = tmp_path / "run"
    args = [
        "configs/cpu_tiny.yaml",
        "--run-dir",
        str(run),
        *SMALL,
        "agl_lab.task.name=reasoning_gym:basic_arithmetic",
        "agl_lab.task.size=32",
        "agl_lab.task.tools=[calculator]",
        "agentlightning.trace_aggregator.trajectory_max_prompt_length=1024",
        "trainer.total_training_steps=1",
    ]
    assert train_main(args) == 0
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["training/n_rollouts"] == 8 and line["training/n_failed_rollouts"] == 0
    rollouts = load_recording(run, 1).rollouts
    results = [e["data"] for r in rollouts for e in r.events if e["event_type"] == "task_result"]
    assert len(results) == 8 and all({"tool_called", "answer_is_tool_result"} <= set(d) for d in results)
