"""What the store's API accepts can be read back; bad values answer 4xx naming the field.

Real HTTP on loopback, every store backend (`store_url`). Each test sends what once stored an
unreadable value or answered 500, then checks the answer and that every listing still reads.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agl_lab.server.storable import MAX_DEPTH, NotStorable, check_storable, dump_storable

KEY = "k"


@pytest.fixture
def store_url(every_store_url):  # this file runs on every backend: memory, SQLite, PostgreSQL
    return every_store_url


@pytest.fixture
def server(embedded_server, store_url):
    return embedded_server({"key": KEY, "default_proxy": {"model_name": "m"}}, store=store_url)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, trust_env=False) as c:
        yield c


def _raw(client, method, path, text):
    return client.request(method, path, content=text.encode(), headers={"content-type": "application/json"})


def _nest(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def _everything_reads(client, rid=None):
    r = client.get("/api/rollouts", params={"state_in": ["queuing", "running", "succeeded", "failed"]})
    assert r.status_code == 200, r.text
    assert client.get("/api/rollouts/terminal").status_code == 200
    if rid is not None:
        for params in ({}, {"format": "triplet"}):
            r = client.get(f"/api/rollouts/{rid}/events", params=params)
            assert r.status_code == 200, r.text


# -- finding 1: lone surrogates and deep nesting --------------------------------------------------------


@pytest.mark.parametrize(
    "bad_input, field",
    [
        ('{"q": "\\ud800"}', "[0].input.q"),
        (json.dumps(_nest(300)), "[0].input"),
        (json.dumps({"a": _nest(MAX_DEPTH + 1)}), "[0].input.a"),
    ],
)
def test_unreadable_rollout_input_is_refused_and_nothing_stored(client, bad_input, field):
    r = _raw(client, "POST", "/api/rollouts", f'[{{"input": {bad_input}, "rollout_id": "bad"}}]')
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]
    assert client.get("/api/rollouts/bad").status_code == 404
    _everything_reads(client)


def test_a_bad_request_in_a_batch_stores_none_of_the_batch(client):
    r = _raw(
        client,
        "POST",
        "/api/rollouts",
        '[{"input": 1, "rollout_id": "good"}, {"input": "\\udfff", "rollout_id": "bad"}]',
    )
    assert r.status_code == 422 and "[1].input" in r.json()["detail"], r.text
    assert client.get("/api/rollouts/good").status_code == 404


@pytest.mark.parametrize("bad_data", ['{"x": "\\ud800"}', '{"k\\ud800": 1}', json.dumps({"deep": _nest(300)})])
def test_unreadable_event_is_refused_and_events_still_read(client, server, store_url, bad_data):
    rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    r = _raw(client, "POST", f"/api/rollouts/{rid}/attempt/0/events", f'{{"event_type": "x", "data": {bad_data}}}')
    assert r.status_code == 422 and "data" in r.json()["detail"], r.text
    assert client.get(f"/api/rollouts/{rid}/events").json() == []
    _everything_reads(client, rid)


def test_event_type_with_a_surrogate_is_refused(client):
    rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    r = _raw(client, "POST", f"/api/rollouts/{rid}/attempt/0/events", '{"event_type": "\\ud800", "data": {}}')
    assert r.status_code == 422, r.text
    _everything_reads(client, rid)


def test_status_patch_with_a_surrogate_is_refused(client):
    rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    r = _raw(client, "PATCH", f"/api/rollouts/{rid}", '{"status": {"error_message": "\\ud800"}}')
    assert r.status_code == 422 and "status.error_message" in r.json()["detail"], r.text
    assert client.get(f"/api/rollouts/{rid}").status_code == 200
    _everything_reads(client, rid)


def test_sqlite_store_reads_back_after_restart(embedded_server, tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    first = embedded_server({"default_proxy": {"model_name": "m"}}, store=url)
    with httpx.Client(base_url=first.url, trust_env=False) as c:
        rid = c.post("/api/rollouts", json=[{"input": {"deep": _nest(MAX_DEPTH - 2)}}]).json()[0]["rollout_id"]
        assert (
            _raw(
                c, "POST", f"/api/rollouts/{rid}/attempt/0/events", '{"event_type": "x", "data": {"s": "\\ud800"}}'
            ).status_code
            == 422
        )
        assert (
            c.post(
                f"/api/rollouts/{rid}/attempt/0/events",
                json={"event_type": "x", "data": {"deep": _nest(MAX_DEPTH - 2), "s": "é\U0001f600"}},
            ).status_code
            == 200
        )
    first.stop()
    second = embedded_server({"default_proxy": {"model_name": "m"}}, store=url)
    with httpx.Client(base_url=second.url, trust_env=False) as c:
        _everything_reads(c, rid)
        assert c.get(f"/api/rollouts/{rid}/events").json()[0]["data"]["s"] == "é\U0001f600"


# -- finding 2: token ids --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_ids", [[[1, 2]], [{"a": 1}], [-1], [True], "abc", {"a": 1}])
def test_triplet_view_never_500s_on_odd_token_ids(client, prompt_ids):
    rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    data = {"response": {"prompt_token_ids": prompt_ids, "choices": [{"token_ids": [5]}]}, "http_status": 200}
    for _ in range(2):  # two calls with the same (odd) prompt: the dedup must not crash either
        assert (
            client.post(
                f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "model_request", "data": data}
            ).status_code
            == 200
        )
    r = client.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"})
    assert r.status_code == 200, r.text
    (event,) = r.json()
    assert event["data"]["response_token_ids"] == [] and "prompt_token_ids" in event["data"]["skipped"]


def test_token_ids_beyond_int64_are_refused_not_turned_into_floats(client):
    rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    data = {"response": {"prompt_token_ids": [2**63], "choices": [{"token_ids": [5]}]}}
    r = client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "model_request", "data": data})
    assert r.status_code == 422 and "prompt_token_ids[0]" in r.json()["detail"], r.text
    ok = {"response": {"prompt_token_ids": [2**63 - 1], "choices": [{"token_ids": [5]}]}}
    client.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "model_request", "data": ok})
    (event,) = client.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}).json()
    assert event["data"]["prompt_token_ids"] == [2**63 - 1]


# -- finding 3: integer ranges and booleans --------------------------------------------------------------


@pytest.mark.parametrize(
    "path, params",
    [
        ("/api/rollouts", {"state_in": "queuing", "limit": 2**63}),
        ("/api/rollouts/terminal", {"after": 10**30}),
        ("/api/rollouts/terminal", {"limit": 10**30}),
        ("/api/rollouts/terminal", {"after": "false"}),
    ],
)
def test_out_of_range_query_integers_answer_422(client, path, params):
    r = client.get(path, params=params)
    assert r.status_code == 422, r.text


def test_huge_limits_in_range_are_capped_not_500(client):
    assert client.get("/api/rollouts", params={"state_in": "queuing", "limit": 2**63 - 1}).status_code == 200
    assert client.get("/api/rollouts/terminal", params={"limit": 2**63 - 1, "after": -(2**63)}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        [{"model": "m", "endpoint": "http://x", "version": 10**30}],
        [{"model": "m", "endpoint": "http://x", "version": False}],
    ],
)
def test_model_version_out_of_range_or_bool_answers_422(client, body):
    r = client.post("/api/models", json=body)
    assert r.status_code == 422, r.text
    assert "version" in r.text


@pytest.mark.parametrize(
    "body",
    [
        [{"input": {}, "config": {"timeout_seconds": 10**30}}],
        [{"input": {}, "config": {"timeout_seconds": True}}],
        [{"input": {}, "metadata": {"batch_idx": 10**20}}],
        [{"input": {"n": 10**30}}],
    ],
)
def test_rollout_integers_out_of_range_answer_422(client, body):
    r = client.post("/api/rollouts", json=body)
    assert r.status_code == 422, r.text
    _everything_reads(client)


# -- finding 4: NaN / Infinity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '[{"model": "m", "endpoint": "e", "version": NaN}]',
        '[{"model": "m", "endpoint": "e", "version": Infinity}]',
        '[{"model": NaN, "endpoint": "e"}]',
    ],
)
def test_nan_in_an_invalid_body_answers_422(client, text):
    r = _raw(client, "POST", "/api/models", text)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]


@pytest.mark.parametrize(
    "path_kind, text",
    [
        ("rollouts", '[{"input": {"x": NaN}}]'),
        ("rollouts", '[{"input": [Infinity]}]'),
        ("events", '{"event_type": "reward", "data": {"value": NaN}}'),
        ("events", '{"event_type": "reward", "data": {"value": -Infinity}}'),
    ],
)
def test_nan_in_a_valid_body_is_refused_naming_the_field(client, path_kind, text):
    if path_kind == "rollouts":
        r = _raw(client, "POST", "/api/rollouts", text)
    else:
        rid = client.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
        r = _raw(client, "POST", f"/api/rollouts/{rid}/attempt/0/events", text)
    assert r.status_code == 422, r.text
    assert "finite" in r.json()["detail"]
    _everything_reads(client)


# -- the rule itself ---------------------------------------------------------------------------------------


def test_storable_rule_names_the_path():
    with pytest.raises(NotStorable, match=r"input\.a\[1\]\.b: string holds a lone"):
        check_storable({"a": [0, {"b": "\ud800"}]}, "input")
    with pytest.raises(NotStorable, match="nested deeper"):
        dump_storable({"x": _nest(MAX_DEPTH + 5)})
    assert (
        dump_storable({"x": _nest(MAX_DEPTH - 1)})
        == json.dumps({"x": _nest(MAX_DEPTH - 1)}, separators=(",", ":")).encode()
    )
