"""`GET /metrics` of `agl-lab serve` (the app) and `agl-lab runner --metrics-port`, parsed.

The exposition is parsed strictly (every sample after its family's HELP and TYPE lines, label
syntax, numbers) and the counters are checked against what was done over real HTTP: claims,
claimed rollouts, lease expiries (no heartbeats: the leases run out), re-runs of the expired
rollouts, releases, queue depth, store latency per store method, in-flight calls; and a real
`agl-lab runner` process's counters after it ran rollouts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agl_lab.server.metrics import FAMILIES
from tests.prometheus import parse, value

ROOT = Path(__file__).resolve().parents[1]
KEY, RUNNER_KEY = "metrics-key", "metrics-runner-key"


def test_server_metrics_count_claims_expiries_reruns_releases_and_store_calls(embedded_server):
    # a 3 s lease: the scrape right after the claim must come before the sweep re-queues it (a loaded host stalls)
    server = embedded_server(key=KEY, runner_key=RUNNER_KEY, lease_seconds=3.0, max_attempts=3)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as api:

        def scrape() -> dict:
            r = api.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            return parse(r.text)

        start = scrape()
        assert value(start, "agl_claims_total") == 0 and value(start, "agl_queue_depth") == 0
        assert value(start, "agl_inflight_calls") == 0
        assert set(FAMILIES) >= {re.sub(r"_(count|sum)$", "", n) for n, _ in start}

        api.post("/api/rollouts", json=[{"rollout_id": f"m{i}", "input": {}} for i in range(3)]).raise_for_status()
        claimed = api.post("/api/rollouts/claim", json={"limit": 2}).json()
        assert len(claimed) == 2
        after_claim = scrape()
        assert value(after_claim, "agl_claims_total") == 1 and value(after_claim, "agl_claimed_rollouts_total") == 2
        assert value(after_claim, "agl_queue_depth") == 1 and value(after_claim, "agl_reruns_total") == 0
        assert value(after_claim, "agl_store_seconds_count", op="claim_rollouts") == 1
        assert value(after_claim, "agl_store_seconds_sum", op="claim_rollouts") > 0

        deadline = time.monotonic() + 120  # no heartbeats: both leases run out (sweeps every 0.25 s)
        while (
            value(samples := scrape(), "agl_queue_depth") < 3
            or ("agl_lease_expiries_total", frozenset({("outcome", "requeued")})) not in samples
        ):
            assert time.monotonic() < deadline, "the leases did not expire"
            time.sleep(0.2)
        assert value(samples, "agl_lease_expiries_total", outcome="requeued") == 2

        again = api.post("/api/rollouts/claim", json={"limit": 3}).json()
        assert sorted(r["status"]["last_attempt_id"] for r in again) == ["0", "1", "1"]
        released = api.post("/api/rollouts/release", json={"attempts": {"m0": "1"}}).json()["released"]
        final = scrape()
        assert value(final, "agl_reruns_total") == 2 and value(final, "agl_claimed_rollouts_total") == 5
        assert value(final, "agl_released_rollouts_total") == len(released) == 1
        assert value(final, "agl_queue_depth") == 1

        assert httpx.get(server.url + "/metrics").status_code == 401  # a key like any route
        scoped = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {RUNNER_KEY}"})
        assert scoped.status_code == 200  # the runner key may read it (monitoring without admin power)


def test_runner_metrics_port_serves_its_counters(embedded_server):
    server = embedded_server(key=KEY)
    ids = [f"rm{i}" for i in range(3)]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as api:
        api.post("/api/rollouts", json=[{"rollout_id": rid, "input": {}} for rid in ids]).raise_for_status()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agl_lab.cli", "runner", "--server", server.url, "--agent",
             "tests.agents_for_tests:remote_agent", "--metrics-port", "0", "--poll-interval", "0.05"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "AGL_KEY": KEY},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            url = None
            while url is None:
                line = proc.stdout.readline()
                assert line, f"the runner exited {proc.wait()} without a metrics line"
                if "metrics at " in line:
                    url = line.split("metrics at ")[1].strip()
            deadline = time.monotonic() + 120
            while True:
                samples = parse(httpx.get(url, timeout=10).text)
                if value(samples, "agl_runner_rollouts_total", outcome="succeeded") == 3:
                    break
                assert time.monotonic() < deadline, samples
                time.sleep(0.2)
            assert value(samples, "agl_runner_rollouts_total", outcome="claimed") == 3
            assert value(samples, "agl_runner_running") == 0
            assert httpx.get(url.replace("/metrics", "/other"), timeout=10).status_code == 404
        finally:
            proc.terminate()
            proc.communicate(timeout=60)


def test_parse_refuses_malformed_text():
    with pytest.raises(AssertionError):
        parse('agl_x{a="1"} 1\n')  # no TYPE line
    with pytest.raises(AssertionError):
        parse("# TYPE agl_x counter\nagl_x{a=1} 1\n")  # unquoted label value
