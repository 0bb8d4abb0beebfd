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
from hypothesis import HealthCheck, given, settings
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
    st.none() | st.booleans() | _texts
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
    for path, params in (("/api/rollouts", {"state_in": ALL_STATES}), ("/api/rollouts/terminal", {}),
                         (f"/api/rollouts/{rid}", {}), (f"/api/rollouts/{rid}/events", {}),
                         (f"/api/rollouts/{rid}/events", {"format": "triplet"})):
        r = client.get(path, params=params)
        assert r.status_code == 200, (path, r.status_code, r.text)


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_fuzz_api_never_5xx_and_reads_back(embedded_server, tmp_path, store_kind):
    store = "memory" if store_kind == "memory" else f"sqlite:///{tmp_path}/fuzz.db"
    server = embedded_server({"default_proxy": {"model_name": "m"}}, store=store)
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as client:
        anchor = client.post("/api/rollouts", json=[{"input": {}, "rollout_id": "anchor"}]).json()[0]["rollout_id"]
        counts = {"ok": 0, "refused": 0}

        @settings(max_examples=EXAMPLES_PER_STORE, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op=operations)
        def run(op):
            kind, a, b = op
            if kind == "create":
                body = [{"input": a} | ({"rollout_id": b} if b is not None else {})]
                r = _send(client, "POST", "/api/rollouts", body)
            elif kind == "event":
                r = _send(client, "POST", f"/api/rollouts/{anchor}/attempt/0/events", {"event_type": b, "data": {"v": a}})
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
