"""Your own agent on the real path: the agent contract (each `ctx` field), failures you can see,
the notebook-safe Trainer (reuse guard, closed message, repr, metrics), custom tasks with a
warm start, `agl_lab.agent=module:function` from the CLI, and the silenced library noise.

One Trainer (real tiny model, real gateway on loopback, real runner) serves most tests: its
agent dispatches on the task's `mode`, so each test chooses behaviour through its tasks.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from agl_lab.cli import train_main
from agl_lab.protocol import rollout_token
from agl_lab.tasks import Task, get_task, register_task, task_names
from agl_lab.trainer import Trainer

SMALL = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "agl_lab.task.n_train=8",
    "agl_lab.task.n_val=2",
    "agl_lab.runner.concurrency=8",
    "agl_lab.model.warm_start_steps=0",
]
SEEN: list[dict] = []  # what the contract agent observed, one dict per run
_LOCK = threading.Lock()


def contract_agent(task, ctx):
    """Records every ctx field, calls the model under an arbitrary name, emits an event."""
    if task.get("mode") == "fail":
        raise ValueError(f"bad task {task['i']}")
    client = ctx.openai_client()
    reply = client.chat.completions.create(
        model="any-name-the-agent-likes", max_tokens=3, messages=[{"role": "user", "content": f"task {task['i']}"}]
    )
    ctx.emit("note", {"i": task["i"], "reply": reply.choices[0].message.content})
    with _LOCK:
        SEEN.append(
            {
                "rollout_id": ctx.rollout_id,
                "is_train": ctx.is_train,
                "base_url": ctx.base_url,
                "api_key": ctx.api_key,
                "event_url": ctx.event_url,
                "model": reply.model,
                "created_at": ctx.rollout.status.created_at,
            }
        )
    return 0.25 * task["i"]


def _tasks(n, mode="ok"):
    return [{"i": i, "mode": mode} for i in range(n)]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tr = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=SMALL,
        agent=contract_agent,
        train_dataset=_tasks(4),
        val_dataset=_tasks(2),
        run_dir=tmp_path_factory.mktemp("run"),
        console=False,
    )
    yield tr
    tr.close()


# =========================================================================== the agent contract


def test_each_ctx_field_reaches_the_agent(trainer):
    SEEN.clear()
    ro = trainer.rollout(_tasks(2))
    by_id = {s["rollout_id"]: s for s in SEEN}
    assert set(by_id) == {r.rollout_id for r in ro.rollouts}  # ctx.rollout_id is the rollout's id
    for r in ro.rollouts:
        seen = by_id[r.rollout_id]
        assert seen["is_train"] is True
        assert seen["base_url"] == f"{trainer.base_url}/proxy/rollout/{r.rollout_id}/attempt/0/mode/train/openai/v1"
        assert seen["event_url"] == f"{trainer.base_url}/api/rollouts/{r.rollout_id}/attempt/0/events"
        # a per-rollout token derived from the embedded server's fresh key, not the admin key
        assert seen["api_key"] == rollout_token(trainer.key, r.rollout_id, seen["created_at"]) != trainer.key
        # ctx.openai_client(): the call went through the gateway and is a triplet of the rollout,
        # although the agent named a model the engine does not call itself
        assert len(r.triplets) == 1 and r.triplets[0].response_ids
        # ctx.emit(): the event is in the store under this rollout
        notes = [e for e in r.events if e.get("event_type") == "note"]
        assert len(notes) == 1 and notes[0]["data"]["i"] == r.input["i"]
        # the returned float is the rollout's reward
        assert r.final_reward == pytest.approx(0.25 * r.input["i"])


def test_validation_rollouts_get_is_train_false_and_the_val_url(trainer):
    SEEN.clear()
    trainer.validate()
    assert len(SEEN) == 2 and all(s["is_train"] is False and "/mode/val/" in s["base_url"] for s in SEEN)


def test_dry_run_prints_the_transcript_with_token_counts_and_reward(trainer, capsys):
    step = trainer.global_step
    rollout = trainer.dry_run({"i": 3, "mode": "ok"})
    out = capsys.readouterr().out
    assert "call 0 · prompt" in out and "tokens · response" in out and "reward 0.750 · succeeded" in out
    assert rollout.final_reward == pytest.approx(0.75) and trainer.global_step == step


# =========================================================================== failures you can see


def test_failed_rollouts_are_counted_warned_once_and_in_the_lifecycle(trainer, caplog):
    tasks = [{"i": 0, "mode": "fail"}, {"i": 1, "mode": "ok"}]
    with caplog.at_level(logging.WARNING, logger="agl_lab.trainer"):
        ro = trainer.rollout(tasks)
    warnings = [r.getMessage() for r in caplog.records if "rollouts failed" in r.getMessage()]
    assert len(warnings) == 1
    assert "2 of 4 training rollouts failed" in warnings[0] and "ValueError: bad task 0" in warnings[0]
    assert ro.metrics["training/n_failed_rollouts"] == 2
    assert "failed=2" in repr(ro) and "mean_reward=0.250" in repr(ro) and "bad task 0" in repr(ro)
    assert "first error" in ro._repr_html_()
    life = ro.lifecycle
    assert {"state", "error_message", "enqueued_at_s", "running_at_s", "finished_at_s"} <= set(life.columns)
    failed = life[life.state == "failed"]
    assert len(failed) == 2 and failed.error_message.str.contains("ValueError: bad task 0").all()
    assert life[life.state == "succeeded"].error_message.isna().all()
    # relative times: seconds since the step started, ordered enqueue ≤ running ≤ finished
    assert (life.enqueued_at_s >= 0).all() and (life.enqueued_at_s < 600).all()
    assert (life.enqueued_at_s <= life.running_at_s).all() and (life.running_at_s <= life.finished_at_s).all()


def test_all_rollouts_failed_says_so_with_the_first_error(trainer):
    ro = trainer.rollout(_tasks(2, mode="fail"))
    with pytest.raises(RuntimeError, match=r"all 4 rollouts failed.*\n.*ValueError: bad task"):
        trainer.build_batch(ro)


def test_alignment_warns_only_when_rows_with_signal_are_dropped(caplog):
    from agl_lab.update import alignment_report

    metrics = {
        "training/n_sample_dropped/same_reward": 2,
        "training/n_sample_dropped/random": 3,
        "training/n_sample_trained": 8,
    }
    with caplog.at_level(logging.WARNING, logger="agl_lab.update"):
        assert alignment_report(metrics, mini_batch_rows=8, n=4, step=5) == {"training/n_sample_dropped/alignment": 5}
    (record,) = caplog.records
    assert "dropped 3 of 11 rows that carry a learning signal (27%; plus 2 zero-advantage rows" in record.getMessage()
    assert "2 × 4 = 8 rows" in record.getMessage() and "ppo_mini_batch_size" in record.getMessage()
    caplog.clear()
    # only zero-advantage rows dropped (8 of 16 rows): nothing was lost, no warning
    with caplog.at_level(logging.WARNING, logger="agl_lab.update"):
        out = alignment_report(
            {
                "training/n_sample_dropped/same_reward": 8,
                "training/n_sample_dropped/random": 0,
                "training/n_sample_trained": 8,
            },
            mini_batch_rows=8,
            n=4,
            step=5,
        )
    assert out == {"training/n_sample_dropped/alignment": 8} and not caplog.records
    with caplog.at_level(logging.WARNING, logger="agl_lab.update"):
        alignment_report({**metrics, "training/n_sample_dropped/random": 1}, mini_batch_rows=8, n=4, step=5)
    assert not caplog.records  # 1 of 9 rows with signal: no warning


def test_console_line_shows_dropped_and_failed():
    from agl_lab.logger import format_console_line

    line = format_console_line(
        3, {"training/reward": 0.5, "training/n_sample_dropped/alignment": 2, "training/n_failed_rollouts": 1}
    )
    assert "dropped_rows 2" in line and "failed 1" in line


# =========================================================================== a notebook-safe Trainer


def test_update_on_a_used_batch_raises_unless_allowed(trainer):
    trainer.rollout(_tasks(2))
    b = trainer.build_batch()
    trainer.update()
    version = trainer.engine.policy_version
    with pytest.raises(RuntimeError, match="already used for an update.*off-policy.*allow_reuse=True"):
        trainer.update()
    with pytest.raises(RuntimeError, match="already used"):
        trainer.update(b)
    assert trainer.engine.policy_version == version
    trainer.update(b, allow_reuse=True)
    assert trainer.engine.policy_version == version + 1


def test_repr_metrics_and_fit_reward_curve(trainer):
    text = repr(trainer)
    for part in (
        "engine=local",
        "model=agl-lab-tiny",
        "task=contract_agent",
        "step=",
        "policy_version=",
        str(trainer.run_dir),
    ):
        assert part in text
    trainer.cfg.trainer.test_freq = 1  # validation after each step: the curve gets val points
    try:
        trainer.fit(2, progress=False)
    finally:
        trainer.cfg.trainer.test_freq = -1
    df = trainer.metrics
    assert list(df.index[-2:]) == [trainer.global_step - 1, trainer.global_step]  # verl's 1-based global_steps
    assert {"training/reward", "val/reward", "training/n_failed_rollouts"} <= set(df.columns)
    assert (Path(trainer.run_dir) / "reward_curve.png").stat().st_size > 1000


def test_a_closed_trainer_says_so(tmp_path):
    tr = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=SMALL,
        agent=contract_agent,
        train_dataset=_tasks(4),
        run_dir=tmp_path,
        console=False,
    )
    tr.close()
    for call in (tr.rollout, tr.update, tr.step, tr.dry_run, lambda: tr.fit(1)):
        with pytest.raises(RuntimeError, match="this Trainer is closed"):
            call()
    assert "closed" in repr(tr)


# =========================================================================== your own task


def echo_agent(task, ctx):
    reply = ctx.openai_client().chat.completions.create(
        model="echo", max_tokens=4, messages=[{"role": "user", "content": task["word"]}]
    )
    return float((reply.choices[0].message.content or "").strip() == task["word"])


WORDS = ["red", "blue", "green", "apple"]
ECHO = Task(
    name="echo-test",
    agent=echo_agent,
    train_tasks=[{"word": w} for w in WORDS],
    val_tasks=[{"word": "red"}],
    demonstrations=[[{"role": "user", "content": w}, {"role": "assistant", "content": w}] for w in WORDS],
)


def make_echo_task():  # for get_task("tests.test_agent_contract:make_echo_task")
    return ECHO


def test_task_api_lists_are_cycled_and_names_are_checked():
    assert ECHO.train_tasks(6, 0) == [{"word": w} for w in WORDS + WORDS[:2]]
    assert ECHO.val_tasks(1, 0) == [{"word": "red"}] and len(ECHO.demonstrations(5, 0)) == 5
    assert register_task(ECHO) is ECHO and "echo-test" in task_names() and get_task("echo-test") is ECHO
    with pytest.raises(ValueError, match="built-in"):
        register_task(Task(name="lookup", agent=echo_agent, train_tasks=[{}]))
    with pytest.raises(ValueError, match="already registered"):
        register_task(ECHO, replace=False)
    with pytest.raises(TypeError, match="agent must be a function"):
        Task(name="x", agent="nope", train_tasks=[{}])
    assert get_task("tests.test_agent_contract:make_echo_task") is ECHO
    with pytest.raises(KeyError, match="register_task"):
        get_task("no-such-task")


def test_a_registered_task_gets_a_warm_start(tmp_path):
    register_task(ECHO)
    overrides = [*SMALL[:-1], "agl_lab.task.name=echo-test", "agl_lab.model.warm_start_steps=3"]
    cold = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=SMALL[:-1] + ["agl_lab.task.name=echo-test"],
        run_dir=tmp_path / "cold",
        console=False,
    )
    with Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=overrides, run_dir=tmp_path / "warm", console=False
    ) as warm:
        cold_state = cold.engine.model.state_dict()
        cold.close()
        assert warm.task is ECHO and warm.agent is echo_agent
        assert any(not torch.equal(v, cold_state[k]) for k, v in warm.engine.model.state_dict().items())
        ro = warm.rollout()
        assert len(ro.rollouts) == 4 and not ro.failed


def test_the_cli_takes_an_agent_as_module_function(tmp_path, capsys):
    SEEN.clear()
    run_dir = tmp_path / "cli"
    rc = train_main(
        [
            "configs/cpu_tiny.yaml",
            "--steps",
            "1",
            "--run-dir",
            str(run_dir),
            *SMALL,
            "agl_lab.agent=tests.test_agent_contract:lookup_contract_agent",
        ]
    )
    assert rc == 0 and len(SEEN) == 4 and all(s["is_train"] for s in SEEN)
    assert (run_dir / "reward_curve.png").exists()
    with pytest.raises(ValueError, match="must be 'module:function'"):
        Trainer.from_config("configs/cpu_tiny.yaml", overrides=[*SMALL, "agl_lab.agent=not_a_spec"])


def lookup_contract_agent(task, ctx):
    """The contract agent on lookup tasks (the CLI test's dataset)."""
    return contract_agent({"i": 1, "mode": "ok"}, ctx)


# =========================================================================== the library is quiet


def test_building_a_trainer_shows_no_verl_or_hf_noise(tmp_path):
    code = textwrap.dedent(f"""
        import logging, warnings
        logging.basicConfig(level=logging.INFO)
        with warnings.catch_warnings(record=True) as caught:
            from agl_lab.trainer import Trainer
            tr = Trainer.from_config("configs/cpu_tiny.yaml", overrides={SMALL!r}, run_dir={str(tmp_path)!r},
                                     console=False)
            tr.step()  # the update imports verl's platform manager
            tr.close()
        for w in caught:
            print("WARNING-CAPTURED", w.category.__name__, w.message)
        warnings.warn("a user warning is still shown", UserWarning)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[1],
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "engine is not available" not in text
    assert "No supported accelerator" not in text and "registered but not available" not in text
    assert "Loading weights" not in text
    assert "a user warning is still shown" in text  # only the library's own noise is filtered


# =========================================================================== an AGL v1 agent class


def test_an_agent_lightning_agent_class_runs_unchanged(tmp_path):
    """AGL v1's agent contract is a class with run() reading AGL_* variables; passed as the
    class object, it runs in a subprocess per rollout exactly as under AGL's local controller."""
    from tests.agents_for_tests import EnvReportAgent

    with Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=SMALL,
        agent=EnvReportAgent,
        train_dataset=_tasks(2),
        run_dir=tmp_path,
        console=False,
    ) as tr:
        assert tr.agent == "tests.agents_for_tests:EnvReportAgent"
        ro = tr.rollout()
    assert len(ro.rollouts) == 4 and not ro.failed and all(r.final_reward == 1.0 for r in ro.rollouts)
    env = [e["data"] for r in ro.rollouts for e in r.events if e.get("event_type") == "env"]
    assert len(env) == 4 and all(v["AGL_OPENAI_BASE_URL"].endswith("/mode/train/openai/v1") for v in env)

    class Local:
        def run(self):
            pass

    with pytest.raises(TypeError, match="define it in a module"):
        Trainer.from_config("configs/cpu_tiny.yaml", overrides=SMALL, agent=Local, train_dataset=_tasks(2))
