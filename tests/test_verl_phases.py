"""The Trainer's phase logic on the verl engine, end to end on CPU.

What is real: `agl_lab.Trainer.from_config(…, engine="verl")` and the `VerlEngine` it builds,
its embedded store and gateway, the runner running the built-in `lookup` agent (openai SDK,
two calls per episode), the sync and async rollout managers, the batch builder, the
algorithms, and a real `AglRayPPOTrainer` (verl's own DataProto/TensorDict plumbing,
`_balance_batch`, `_update_actor`). What is fake
(tests/verl_fakes.py): only what needs GPUs — the actor worker group, the vLLM replicas'
coroutine methods and the checkpoint-engine manager, installed by `init_workers` — plus
the replicas' OpenAI servers, which are `tests.fakes.FakeOpenAI` on loopback (vLLM-shaped
answers with token ids and logprobs) scripted to play `lookup` ("get c" → "answer red").

Every fake, the replica HTTP servers and the gateway's management routes (seen from the
Trainer's HTTP client) write to one ordered `CallLog`, so the tests assert the order of
phases the issue names:

    register (DELETE then POST /api/models, with the policy version) → resume generation →
    rollouts → abort (sync) | pause + drain the gateway (async) → sleep replicas →
    old logprobs → actor update → push weights (policy version + 1) → resume generation

plus async carry-over across steps, validation, skipped-step accounting, small batches and
closing.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import agl_lab.engines.verl.engine as verl_module
import agl_lab.engines.verl.trainer as verl_trainer_module
from agl_lab.client import AglClient, AglHTTPError
from agl_lab.engines.verl.engine import VerlEngine
from agl_lab.tasks import get_task
from agl_lab.trainer import Trainer
from tests.fakes import FakeOpenAI
from tests.verl_fakes import CallLog, fake_verl_trainer

CPU_TINY = Path(__file__).resolve().parents[1] / "configs" / "cpu_tiny.yaml"
LOOKUP = get_task("lookup")
N, TASKS_PER_STEP, MINI = 2, 2, 2  # rollout.n, data.train_batch_size, ppo_mini_batch_size (tasks)
MINI_ROWS = MINI * N  # 4 rows per PPO mini-batch: one row per rollout (trajectory level)
ABORTED = (1, 2)  # what each fake replica reports from abort_all_requests
BASE = [
    f"data.train_batch_size={TASKS_PER_STEP}",
    f"actor_rollout_ref.rollout.n={N}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
    "actor_rollout_ref.rollout.name=vllm",
    # cpu_tiny.yaml leaves verl's flash_attention_2 default: the start-up check would refuse it here
    "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "data.dataloader_num_workers=0",
    "data.shuffle=false",  # tasks in dataset order: each test decides what every step sees
    "agl_lab.runner.concurrency=16",
    "agl_lab.rollout.wait_timeout_seconds=30",
    "agl_lab.server.val_temperature=0.7",
]
MANAGEMENT = ("/api/models", "/proxy/pause", "/proxy/resume")

# ------------------------------------------------------------------------------------------
# The rig: replicas that serve real HTTP, a VerlEngine over fakes, a Trainer on top
# ------------------------------------------------------------------------------------------


def lookup_policy(log: CallLog) -> Callable[[dict], str]:
    """A scripted replica: `get KEY` for the question, then the observed value every other
    answer (a wrong one otherwise, so groups have reward spread)."""
    answers = itertools.count()

    def reply(body: dict) -> str:
        log.add("replica", "generate")
        last = body["messages"][-1]["content"]
        if m := re.fullmatch(r"Find (\w)\.", last):
            return f"get {m.group(1)}"
        if m := re.fullmatch(r"(\w) is (\w+)", last):
            return f"answer {m.group(2)}" if next(answers) % 2 else "answer nothing"
        return "answer ?"

    return reply


@dataclass
class Rig:
    trainer: Trainer
    engine: VerlEngine
    log: CallLog
    replicas: list[FakeOpenAI]
    marks: list[int] = field(default_factory=list)

    @property
    def actor_calls(self) -> list[tuple]:
        return self.engine.trainer.actor_rollout_wg.calls

    def step(self) -> dict[str, Any]:
        """`trainer.step()`, remembering where this step's part of the log starts."""
        self.marks.append(self.log.mark())
        return self.trainer.step()

    def step_log(self, i: int) -> list[str]:
        end = self.marks[i + 1] if i + 1 < len(self.marks) else None
        return CallLog.compress(self.log.entries()[self.marks[i] : end])

    def temperatures(self) -> list[float]:
        return [r["json"].get("temperature") for f in self.replicas for r in f.requests]

    def metrics_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def _record_management_calls(trainer: Trainer, log: CallLog) -> None:
    """Log the gateway calls the Trainer makes (models, pause, resume) as they go on the wire."""

    def on_request(request) -> None:
        path = request.url.path
        if path not in MANAGEMENT:
            return
        detail = None
        if request.method == "POST" and path == "/api/models":
            versions = {m["version"] for m in json.loads(request.content)}
            detail = "v" + ",".join(str(v) for v in sorted(versions))
        log.add("gateway", f"{request.method} {path}", detail)

    trainer.client.http.event_hooks["request"].append(on_request)


@pytest.fixture
def make_rig(tmp_path, monkeypatch):
    """`make(overrides, train=…, val=…, agent=…) -> Rig`: `Trainer.from_config(…, engine="verl")`
    whose `VerlEngine.__init__` runs for real (API check, build, `init_workers`, first weight
    push) on the fake stack; only the Ray cluster start is skipped (tests/test_verl_ray.py)."""
    made: list[Rig] = []
    servers: list[FakeOpenAI] = []

    def make(
        overrides: Sequence[str] = (), *, train: Sequence[dict], val: Sequence[dict] = (), agent: Callable | None = None
    ) -> Rig:
        log = CallLog()
        replicas = [FakeOpenAI(reply=lookup_policy(log)) for _ in ABORTED]
        for fake in replicas:
            fake.serve()
            servers.append(fake)
        addresses = [f.url.removeprefix("http://") for f in replicas]

        def build_fake_stack(config, train_dataset, val_dataset=None):
            # like build_trainer: a copy of the config (verl edits it), workers not spawned yet
            stack = fake_verl_trainer(
                copy.deepcopy(config), train_dataset, log=log, aborted=ABORTED, addresses=addresses, spawn=False
            )
            return stack, "fake-model"

        monkeypatch.setattr(verl_trainer_module, "build_trainer", build_fake_stack)
        monkeypatch.setattr(verl_module, "init_ray", lambda config, env_vars=None: False)
        monkeypatch.setattr(verl_module, "_select_device", lambda config: {})  # fake vLLM replicas on CPU
        trainer = Trainer.from_config(
            CPU_TINY,
            [*BASE, *overrides],
            engine="verl",
            agent=agent or LOOKUP.agent,
            train_dataset=list(train),
            val_dataset=list(val),
            run_dir=tmp_path / f"run{len(made)}",
            console=False,
        )
        assert isinstance(trainer.engine, VerlEngine)
        assert log.compressed() == ["update_weights 0"]  # VerlEngine.__init__ served the initial weights
        rig = Rig(trainer, trainer.engine, log, replicas)
        made.append(rig)
        _record_management_calls(trainer, log)
        log.clear()
        return rig

    yield make
    for rig in made:
        rig.trainer.close()
        rig.engine.close()  # idempotent: the Trainer has closed it already
    for fake in servers:
        fake.stop()


def train_tasks(n: int) -> list[dict]:
    return LOOKUP.train_tasks(n, seed=0)


def sync_step(version: int) -> list[str]:
    """The compressed log of one sync training step served by `version`."""
    return [
        "DELETE /api/models",
        f"POST /api/models v{version}",
        "resume_generation",
        "generate",
        "abort_all_requests",
        "sleep_replicas",
        f"compute_log_prob {MINI_ROWS}",
        f"update_actor {MINI_ROWS}",
        f"update_weights {version + 1}",
        "resume_generation",
    ]


# ------------------------------------------------------------------------------------------
# Sync: phase order per step, versions, validation
# ------------------------------------------------------------------------------------------


def test_sync_steps_run_the_phases_in_order_and_validate_on_the_new_weights(make_rig):
    val = LOOKUP.val_tasks(3, seed=1)
    rig = make_rig(["trainer.test_freq=2"], train=train_tasks(8), val=val)

    m0 = rig.step()
    ro0 = rig.trainer._last_rollout  # the step's RolloutResult (step() returns metrics only)
    m1 = rig.step()

    assert rig.step_log(0) == sync_step(0)
    validation = ["DELETE /api/models", "POST /api/models v2", "resume_generation", "generate", "abort_all_requests"]
    assert rig.step_log(1) == sync_step(1) + validation  # test_freq=2: validate after the second update
    assert (ro0.triplets["server_version"] == 0).all()  # the gateway stamped the served version on every call
    assert (rig.trainer._last_rollout.triplets["server_version"] == 1).all()
    assert [m0["training/policy_version"], m1["training/policy_version"]] == [1, 2]
    assert rig.engine.policy_version == 2 == rig.engine.trainer.global_steps
    assert m0["training/n_aborted_generations"] == sum(ABORTED)  # summed over the replicas
    assert m0["training/n_rollouts"] == TASKS_PER_STEP * N and m0["training/n_sample_trained"] == MINI_ROWS

    # validation: one rollout per val task, at the gateway's val temperature, val/* metrics
    assert m1["val/n_rollouts"] == len(val) and 0.0 <= m1["val/reward"] <= 1.0
    temps = rig.temperatures()
    assert temps.count(0.7) == 2 * len(val)  # lookup makes two calls per episode
    assert set(temps) == {1.0, 0.7}
    lines = rig.metrics_lines()
    assert [line["step"] for line in lines] == [1, 2]  # verl's 1-based global_steps
    assert "val/reward" not in lines[0] and lines[1]["val/n_rollouts"] == len(val)


# ------------------------------------------------------------------------------------------
# Async: a slow group finishes a step later and is trained in that step
# ------------------------------------------------------------------------------------------


class CarryOverAgents:
    """`lookup` with two kinds of tasks held back on purpose.

    slow   waits until the gateway is resumed for step 1, then plays: its group is
           enqueued in step 0 and can only complete in step 1.
    after  (step 1's new tasks) waits until both slow rollouts are terminal, so the slow
           group is complete before any group of step 1: the oldest complete groups are
           trained first, so it must be in step 1's batch.
    """

    def __init__(self, rig_ref: list[Rig]):
        self.rig_ref, self.slow_ids = rig_ref, []
        self.step1_open = threading.Event()
        self._resumes = 0

    def on_response(self, response) -> None:
        if response.request.url.path == "/proxy/resume":
            self._resumes += 1
            if self._resumes == 2:  # the gateway opens for step 1
                self.step1_open.set()

    def _slow_rollouts_terminal(self, client: AglClient) -> bool:
        if len(self.slow_ids) < N:
            return False
        for rid in self.slow_ids:
            try:
                if not client.get_rollout(rid)[0].is_terminal:
                    return False
            except AglHTTPError as exc:  # collected (and deleted) by the rollout manager
                if exc.status_code != 404:
                    raise
        return True

    def __call__(self, task: dict, ctx) -> float | None:
        if task["kind"] == "slow":
            self.slow_ids.append(ctx.rollout_id)
            assert self.step1_open.wait(20), "step 1 never resumed the gateway"
        elif task["kind"] == "after":
            trainer = self.rig_ref[0].trainer  # the agent's own token only opens its proxy and event routes
            with AglClient(trainer.base_url, key=trainer.key) as client:
                deadline = time.monotonic() + 20
                while not self._slow_rollouts_terminal(client):
                    assert time.monotonic() < deadline, "the slow rollouts never finished"
                    time.sleep(0.02)
        return LOOKUP.agent(task, ctx)


def test_async_carry_over_trains_a_slow_group_in_the_next_step_with_its_age(make_rig):
    tasks = train_tasks(5)
    kinds = ["fast", "fast", "slow", "after", "after"]  # step 0 takes 3 (async size), step 1 takes 2
    train = [{**t, "kind": k} for t, k in zip(tasks, kinds)]
    rig_ref: list[Rig] = []
    agents = CarryOverAgents(rig_ref)
    rig = make_rig(
        ["agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=3"],
        train=train,
        agent=agents,
    )
    rig_ref.append(rig)
    rig.trainer.client.http.event_hooks["response"].append(agents.on_response)

    m0 = rig.step()
    ro0 = rig.trainer._last_rollout
    m1 = rig.step()
    ro1, b1 = rig.trainer._last_rollout, rig.trainer._last_batch

    # async: the gateway is resumed after the replicas and paused (drained) after the
    # rollouts — no replica abort — before the replicas sleep for the update
    async_step = [
        "DELETE /api/models",
        "POST /api/models v{v}",
        "resume_generation",
        "POST /proxy/resume",
        "generate",
        "POST /proxy/pause",
        "sleep_replicas",
        f"compute_log_prob {MINI_ROWS}",
        f"update_actor {MINI_ROWS}",
        "update_weights {w}",
        "resume_generation",
    ]
    for i in (0, 1):
        assert rig.step_log(i) == [s.format(v=i, w=i + 1) for s in async_step]

    # step 0 trains the two fast groups and carries the slow one over
    assert {r.input["kind"] for r in ro0.rollouts} == {"fast"}
    assert m0["training/async/n_completed_rollouts"] == 4 and m0["training/async/n_new_carry_over_rollouts"] == N
    assert ro0.carry_over == [
        {"data_id": ro0.carry_over[0]["data_id"], "step": 0, "policy_version": 0, "n_finished": 0, "n": N}
    ]
    # step 1 trains the slow group (enqueued in step 0) with one of step 1's groups
    slow = [r for r in ro1.rollouts if r.input["kind"] == "slow"]
    assert sorted(r.rollout_id for r in slow) == sorted(agents.slow_ids)
    assert [(r.step, r.enqueue_policy_version, r.policy_version) for r in slow] == [(0, 0, 1)] * N
    ages = ro1.step - ro1.lifecycle.set_index("rollout_id")["step"]
    assert sorted(ages.tolist()) == [0] * N + [1] * N  # the age in steps of every trained rollout
    assert set(agents.slow_ids) <= set(b1.rows["rollout_id"])
    assert m1["training/async/n_prev_carry_over_rollouts"] == N
    assert m1["training/async/n_completed_rollouts"] == 4 and m1["training/n_sample_trained"] == MINI_ROWS
    assert m1["training/policy_version"] == 2


# ------------------------------------------------------------------------------------------
# Small batches: skipped (small_batch=skip) or padded (small_batch=train)
# ------------------------------------------------------------------------------------------


def silent_or_lookup(task: dict, ctx) -> float | None:
    """`silent` tasks end without a model call: their rollouts give no training row."""
    return 0.0 if task.get("silent") else LOOKUP.agent(task, ctx)


def half_silent(n: int) -> list[dict]:
    """Step 0: one playing task and one silent one (2 rows < one mini-batch); then playing tasks."""
    return [{**t, "silent": i == 1} for i, t in enumerate(train_tasks(n))]


def test_a_step_without_a_whole_mini_batch_is_skipped_logged_and_not_trained(make_rig):
    rig = make_rig(["agl_lab.algorithm.small_batch=skip"], train=half_silent(4), agent=silent_or_lookup)
    m0 = rig.step()
    u0, version_after_skip = rig.trainer._last_update, rig.engine.policy_version
    m1 = rig.step()

    assert u0.skipped and m0["training/skipped_steps"] == 1 and m0["training/n_sample_trained"] == 0
    assert set(u0.dropped["reason"]) == {"small_batch_skip"}
    step0 = rig.step_log(0)
    assert not any(s.startswith("update_actor") for s in step0)  # no policy update
    # whatever the replicas are given back carries the unchanged version: no new weights
    assert [d for who, what, d in rig.log.entries()[: rig.marks[1]] if what == "update_weights"] in ([], [0])
    assert "training/policy_version" not in m0 and version_after_skip == 0
    assert rig.step_log(1) == sync_step(0)  # the next step is served by, and trains from, version 0
    lines = rig.metrics_lines()
    assert [(line["step"], line["training/skipped_steps"]) for line in lines] == [(1, 1), (2, 0)]
    assert m1["training/policy_version"] == 1


def test_a_skipped_step_leaves_the_replicas_serving(make_rig):
    rig = make_rig(["agl_lab.algorithm.small_batch=skip"], train=half_silent(4), agent=silent_or_lookup)
    rig.step()
    assert rig.step_log(0) == [
        "DELETE /api/models",
        "POST /api/models v0",
        "resume_generation",
        "generate",
        "abort_all_requests",
        "resume_generation",
    ]


def test_a_batch_smaller_than_a_mini_batch_is_trained_with_zero_weight_padding(make_rig):
    rig = make_rig(train=half_silent(2), agent=silent_or_lookup)  # small_batch=train (the default)
    m0 = rig.step()

    assert m0["training/n_sample_trained"] == N and m0["training/n_sample_padded"] == MINI_ROWS - N
    name, rows, settings, _ = rig.actor_calls[-1]
    assert (name, rows, settings["global_batch_size"]) == ("update_actor", MINI_ROWS, MINI_ROWS)
    loss_tokens = rig.engine.trainer.actor_rollout_wg.loss_tokens
    assert sorted(loss_tokens)[: MINI_ROWS - N] == [0] * (MINI_ROWS - N) and min(sorted(loss_tokens)[-N:]) > 0
    assert m0["training/policy_version"] == 1 == rig.engine.policy_version


# ------------------------------------------------------------------------------------------
# Lifecycle
# ------------------------------------------------------------------------------------------


def test_closing_the_trainer_closes_the_verl_engine_it_built(make_rig):
    rig = make_rig(train=train_tasks(2))
    rig.trainer.close()
    assert ("trainer", "close", None) in rig.log.entries()


def test_rows_go_to_ranks_so_verl_trains_the_planned_mini_batches():
    """verl hands rank r the r-th contiguous chunk and each rank cuts its chunk into mini-batches
    of M/dp rows; after `rows_in_rank_order`, global mini-batch m (rank 0's m-th + rank 1's m-th)
    is rows [m·M, (m+1)·M) again — the ones the zero-advantage-first alignment planned."""
    from types import SimpleNamespace

    import torch
    from verl import DataProto

    from agl_lab.engines.verl.trainer import AglRayPPOTrainer

    data = DataProto.from_dict(tensors={"row": torch.arange(32)}, meta_info={"temperature": 1.0})
    fake = SimpleNamespace(data_parallel_size=lambda: 2, mini_batch_rows=lambda: 16)
    out = AglRayPPOTrainer.rows_in_rank_order(fake, data)
    chunks = out.batch["row"].chunk(2)  # verl's dispatch: one contiguous chunk per rank
    for m in range(2):
        trained = sorted(torch.cat([chunk[8 * m : 8 * (m + 1)] for chunk in chunks]).tolist())
        assert trained == list(range(16 * m, 16 * (m + 1)))
    assert out.meta_info == {"temperature": 1.0}
    one = SimpleNamespace(data_parallel_size=lambda: 1, mini_batch_rows=lambda: 16)
    assert AglRayPPOTrainer.rows_in_rank_order(one, data) is data  # dp 1: verl's order is already the plan


def test_balance_batch_balances_tokens_within_each_planned_mini_batch():
    """`trainer.balance_batch` (verl's default, kept by configs/gpu_verl.yaml): each rank gets M/dp
    rows of every planned mini-batch, the token workloads of the ranks balanced per mini-batch
    with verl's own partitioner; verl's `global_seqlen/*` metrics are reported. verl's
    `_balance_batch` on the same batch moves rows into other mini-batches (the reason it is not used)."""
    from types import SimpleNamespace

    import torch
    from verl import DataProto

    from agl_lab.engines.verl.trainer import AglRayPPOTrainer

    lengths = torch.tensor([30, 1, 1, 1, 1, 1, 1, 30, 5, 9, 20, 2, 2, 20, 9, 5] * 2)  # 32 rows, M = 16
    mask = (torch.arange(40)[None, :] < lengths[:, None]).long()
    data = DataProto.from_dict(tensors={"row": torch.arange(32), "attention_mask": mask}, meta_info={"t": 1})
    fake = SimpleNamespace(data_parallel_size=lambda: 2, mini_batch_rows=lambda: 16)
    metrics: dict = {}
    out = AglRayPPOTrainer.rows_in_rank_order(fake, data, balance=True, metrics=metrics)
    chunks = out.batch["row"].chunk(2)
    for m in range(2):
        parts = [chunk[8 * m : 8 * (m + 1)] for chunk in chunks]  # what each rank trains in mini-batch m
        assert sorted(torch.cat(parts).tolist()) == list(range(16 * m, 16 * (m + 1)))
        tokens = [int(lengths[p].sum()) for p in parts]
        naive = [int(lengths[16 * m + 8 * r : 16 * m + 8 * (r + 1)].sum()) for r in range(2)]
        assert abs(tokens[0] - tokens[1]) < abs(naive[0] - naive[1]), (tokens, naive)
    assert {"global_seqlen/min", "global_seqlen/max", "global_seqlen/balanced_min"} <= set(metrics)
    assert out.meta_info == {"t": 1} and torch.equal(data.batch["row"], torch.arange(32))  # caller's order kept
    one = SimpleNamespace(data_parallel_size=lambda: 1, mini_batch_rows=lambda: 16)
    assert torch.equal(
        AglRayPPOTrainer.rows_in_rank_order(one, data, balance=True, metrics={}).batch["row"], torch.arange(32)
    )  # one rank: the planned order itself

    class VerlBalanced(SimpleNamespace):  # verl's own _balance_batch on the same rows, for contrast
        _balance_batch = AglRayPPOTrainer._balance_batch

    verl_way = copy.deepcopy(data)
    VerlBalanced(_get_dp_size=lambda *a: 2, actor_rollout_wg=None)._balance_batch(verl_way, metrics={})
    rank0 = verl_way.batch["row"].chunk(2)[0]
    assert sorted(rank0[:8].tolist() + verl_way.batch["row"].chunk(2)[1][:8].tolist()) != list(range(16))
