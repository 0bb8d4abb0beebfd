"""The SQLite store survives kill -9: kill the server under concurrent writers, restart it, and find every
acknowledged event and terminal state (and the file lock of the dead server released)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

KEY = "crash-key"
WRITERS = 4
ACKED_EVENTS_BEFORE_KILL = 120


def _start(db: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AGL_KEY": KEY}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl_lab.cli",
            "serve",
            "--port",
            str(port),
            "--model-name",
            "m",
            "--store",
            f"sqlite:///{db}",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.1)


def test_kill_9_loses_no_acknowledged_write(tmp_path):
    db = str(tmp_path / "crash.db")
    proc, url = _start(db)
    acked_events: dict[str, int] = {}
    acked_terminal: set[str] = set()
    lock, stop = threading.Lock(), threading.Event()

    def writer(w: int) -> None:
        # a timeout ends the writer as "server gone", failing the check that all run until the kill:
        # 60 s, not 10, for a write queued behind the others' fsyncs on a loaded disk
        with httpx.Client(base_url=url, headers={"x-api-key": KEY}, trust_env=False, timeout=60) as c:
            for i in range(10**6):
                rid = f"w{w}-{i}"
                try:
                    c.post("/api/rollouts", json=[{"input": {"i": i}, "rollout_id": rid}]).raise_for_status()
                    c.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).raise_for_status()
                    for k in range(3):
                        r = c.post(f"/api/rollouts/{rid}/attempt/0/events", json={"event_type": "e", "data": {"k": k}})
                        r.raise_for_status()
                        with lock:
                            acked_events[rid] = acked_events.get(rid, 0) + 1
                    c.patch(f"/api/rollouts/{rid}", json={"status": {"state": "succeeded"}}).raise_for_status()
                    with lock:
                        acked_terminal.add(rid)
                except httpx.HTTPError:
                    return  # the server is gone
                if stop.is_set():
                    return

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(WRITERS)]
    for t in threads:
        t.start()
    try:
        while sum(acked_events.values()) < ACKED_EVENTS_BEFORE_KILL:
            assert all(t.is_alive() for t in threads) and proc.poll() is None
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the writers are still going
        proc.wait(30)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(30)

    proc, url = _start(db)  # the dead server's file lock is gone with it
    try:
        with httpx.Client(base_url=url, headers={"x-api-key": KEY}, trust_env=False, timeout=30) as c:
            for rid, n in acked_events.items():
                events = c.get(f"/api/rollouts/{rid}/events")
                assert events.status_code == 200, (rid, events.text)
                assert len(events.json()) >= n, (rid, n, events.json())  # one more may have landed unacknowledged
                assert [e["data"]["k"] for e in events.json()][:n] == list(range(n))
            for rid in acked_terminal:
                assert c.get(f"/api/rollouts/{rid}").json()["rollout"]["status"]["state"] == "succeeded"
            page = c.get("/api/rollouts/terminal", params={"after": 0, "limit": 10_000}).json()
            assert acked_terminal <= {i["rollout_id"] for i in page["items"]}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    assert len(acked_terminal) >= 10 and sum(acked_events.values()) >= ACKED_EVENTS_BEFORE_KILL
