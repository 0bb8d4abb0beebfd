"""Fuzz the HTTP API: no request answers 5xx, and every value stored reads back.

Hypothesis (derandomized, so the examples are the same on every run) sends rollout creates,
event posts, status patches, model upserts and listing queries with JSON values that include
lone surrogates, integers beyond 64 bits, NaN/Infinity, deep nesting and odd types, over real
loopback HTTP, on both store backends. A 2xx write must read back equal; a refused one must
answer 4xx and leave every listing readable.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

EXAMPLES_PER_STORE = 150
ALL_STATES = ["queuing", "running", "succeeded", "failed"]


def _nest(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


_texts = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "é", "\x00", "/?#", ""])
_scalars = (
    st.none()
    | st.booleans()
    | _texts
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
)
json_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_texts, children, max_size=4),
    max_leaves=16,
) | st.integers(min_value=0, max_value=300).map(_nest)
big_ints = st.integers(min_value=-(2**80), max_value=2**80) | st.sampled_from([2**63, 2**63 - 1, -(2**63)])

operations = st.one_of(
    st.tuples(st.just("create"), json_values, st.none() | _texts),
    st.tuples(st.just("event"), json_values, _texts),
    st.tuples(st.just("patch"), _texts, st.none()),
    st.tuples(st.just("model"), big_ints | st.booleans(), _texts),
    st.tuples(st.just("list"), big_ints, big_ints),
)


def _send(client: httpx.Client, method: str, path: str, body) -> httpx.Response:
    text = json.dumps(body, allow_nan=True)  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    return client.request(method, path, content=text.encode(), headers={"content-type": "application/json"})


def _same(a, b) -> bool:
    """Equal as JSON values (a float that is integral may come back as either)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=0, abs_tol=0)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _check_readable(client: httpx.Client, rid: str) -> None:
    for path, params in (
        ("/api/rollouts", {"state_in": ALL_STATES}),
        ("/api/rollouts/terminal", {}),
        (f"/api/rollouts/{rid}", {}),
        (f"/api/rollouts/{rid}/events", {}),
        (f"/api/rollouts/{rid}/events", {"format": "triplet"}),
    ):
        r = client.get(path, params=params)
        assert r.status_code == 200, (path, r.status_code, r.text)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_fuzz_api_never_5xx_and_reads_back(embedded_server, tmp_path, store_kind):
    store = "memory" if store_kind == "memory" else f"sqlite:///{tmp_path}/fuzz.db"
    server = embedded_server({"default_proxy": {"model_name": "m"}}, store=store)
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as client:
        anchor = client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "anchor"}]).json()[0]["rollout_id"]
        counts = {"ok": 0, "refused": 0}

        @settings(
            max_examples=EXAMPLES_PER_STORE,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(op=operations)
        def run(op):
            kind, a, b = op
            if kind == "create":
                body = [{"input": a} | ({"rollout_id": b} if b is not None else {})]
                r = _send(client, "POST", "/api/rollouts", body)
            elif kind == "event":
                r = _send(
                    client, "POST", f"/api/rollouts/{anchor}/attempt/0/events", {"event_type": b, "data": {"v": a}}
                )
            elif kind == "patch":
                r = _send(client, "PATCH", f"/api/rollouts/{anchor}", {"status": {"error_message": a}})
            elif kind == "model":
                r = _send(client, "POST", "/api/models", [{"model": b, "endpoint": "http://127.0.0.1:9", "version": a}])
            else:
                r = client.get("/api/rollouts/terminal", params={"after": a, "limit": b})
            assert r.status_code < 500, (op, r.status_code, r.text)
            counts["ok" if r.status_code < 400 else "refused"] += 1
            if r.status_code >= 400:
                assert r.status_code in (400, 404, 409, 422), (op, r.status_code, r.text)
                _check_readable(client, anchor)
                return
            if kind == "create":
                rid = r.json()[0]["rollout_id"]
                got = client.get(f"/api/rollouts/{rid}")
                assert got.status_code == 200, got.text
                if b is None:  # a client id may name an existing rollout (idempotent create)
                    assert _same(a, got.json()["rollout"]["input"]), (a, got.json())
                _check_readable(client, rid)
            elif kind == "event":
                events = client.get(f"/api/rollouts/{anchor}/events").json()
                assert _same({"v": a}, events[-1]["data"]) and events[-1]["event_type"] == b
                _check_readable(client, anchor)
            elif kind == "patch":
                got = client.get(f"/api/rollouts/{anchor}").json()["rollout"]["status"]["error_message"]
                assert got == a
            elif kind == "model":
                assert isinstance(a, int) and not isinstance(a, bool) and -(2**63) <= a < 2**63

        run()
        assert counts["ok"] and counts["refused"], counts  # both branches were exercised


# ---------------------------------------------------------------------------------------------
# The learning side: whatever events agents send, a step of the real Trainer goes on
# ---------------------------------------------------------------------------------------------

LEARNING_EXAMPLES = 25
VOCAB = 1024  # the built-in tiny model's (tests/trainer_runs.py's SMALL settings)
_id = st.integers(min_value=0, max_value=VOCAB - 1)
_ids = (
    st.lists(_id, min_size=1, max_size=12)  # mostly learnable: the fuzzed rollouts must also train
    | st.lists(
        _id | st.integers(min_value=-3, max_value=VOCAB + 3) | st.sampled_from([2**31, 2**62, -(2**63)]), max_size=12
    )
)
_calls = st.lists(
    st.tuples(_ids, _ids, st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=12)), max_size=3
)
_rewards = (
    st.none()
    | st.floats(min_value=-10, max_value=10)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.sampled_from([3.0e38, -1e7])
)
rollout_events = st.tuples(_calls, _rewards)


def _post_fuzzed(ctx, calls, reward) -> None:
    """The rollout's model calls and reward, posted as the gateway and an agent would post them."""
    headers = {"Authorization": f"Bearer {ctx.api_key}"}
    with httpx.Client(headers=headers, trust_env=False, timeout=30) as c:
        for prompt, response, logprobs in calls:
            data = {
                "model": "m",
                "request": {"messages": []},
                "http_status": 200,
                "status": "ok",
                "response": {
                    "prompt_token_ids": prompt,
                    "choices": [{"token_ids": response, "logprobs": {"content": [{"logprob": lp} for lp in logprobs]}}],
                },
            }
            c.post(ctx.event_url, json={"event_type": "model_request", "data": data}).raise_for_status()
        if reward is not None:
            c.post(ctx.event_url, json={"event_type": "reward", "data": {"value": reward}}).raise_for_status()


def test_fuzz_events_never_crash_a_training_step(tmp_path):
    """Arbitrary token ids (outside the vocabulary, huge, negative), lengths (empty prompts,
    empty responses, logprobs of another length) and rewards (up to 3e38) from three of a
    step's four agents: every step of the real Trainer returns (the fourth agent plays the
    task, so the step has a row to train), and a rollout that cannot be learned from is failed
    with its reason. Not shrunk (a step is seconds): a failure prints the example as found."""
    import itertools
    import threading

    from agl_lab.tasks.lookup import lookup_agent
    from agl_lab.trainer import Trainer
    from tests.trainer_runs import SMALL

    current: dict = {"batch": []}
    counter, lock = itertools.count(), threading.Lock()

    def agent(task, ctx):
        with lock:
            k = next(counter) % 4
        if k == 3:  # one healthy agent per step: a batch with no trainable row fails loudly, by design
            return lookup_agent(task, ctx)
        calls, reward = current["batch"][k]
        _post_fuzzed(ctx, calls, reward)
        return None  # the reward, if any, was posted as an event

    overrides = [
        *SMALL,
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
    ]
    with Trainer.from_config(
        "configs/cpu_tiny.yaml", overrides=overrides, agent=agent, run_dir=tmp_path / "run", console=False
    ) as trainer:
        assert trainer.engine.vocab_size == VOCAB

        @settings(
            max_examples=LEARNING_EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        @given(batch=st.lists(rollout_events, min_size=3, max_size=3))
        def run(batch):
            current["batch"] = batch
            step = trainer.global_step
            metrics = trainer.step()
            assert trainer.global_step == step + 1
            for rollout in trainer._last_rollout.rollouts:
                if "learning_error" in rollout.metadata:
                    assert rollout.state == "failed" and rollout.triplets == []
                for t in rollout.triplets:
                    assert t.prompt_ids and all(0 <= x < VOCAB for x in t.prompt_ids + t.response_ids)
            seen["unlearnable"] += metrics.get("training/n_unlearnable_rollouts", 0)
            seen["trained_fuzzed"] += sum(bool(r.triplets) for r in trainer._last_rollout.rollouts) - 1

        seen = {"unlearnable": 0, "trained_fuzzed": 0}
        run()
        assert seen["unlearnable"] and seen["trained_fuzzed"], seen  # both kinds of fuzzed rollout occurred
