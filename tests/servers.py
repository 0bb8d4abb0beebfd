"""Servers a test starts as processes, and reading a server's rollouts over HTTP.

    server = Serve(store_url, "--lease-seconds", "0")    # one `agl-lab serve` process, admin key KEY
    with server.client() as api:
        create_rollouts(api, ["r0", "r1"])               # POST /api/rollouts, queued
        wait_terminal(api, ["r0", "r1"])                 # {rollout_id: status} once each has ended
    server.stop()

(An in-process server is conftest.py's `embedded_server` fixture.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

KEY = "pg-key"  # the admin key of every `Serve` process


class Serve:
    """One `agl-lab serve --store <url>` process on a free loopback port."""

    def __init__(self, store_url: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
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
                store_url,
                "--log-level",
                "warning",
                *flags,
            ],
            env={**os.environ, "AGL_KEY": KEY},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stdout.read().decode()
            time.sleep(0.05)

    def client(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"x-api-key": KEY}, trust_env=False, timeout=timeout)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()


def create_rollouts(client: httpx.Client, ids: list[str]) -> None:
    """Queue one rollout per id (its input's `data_id` is the id)."""
    r = client.post("/api/rollouts", json=[{"rollout_id": rid, "input": {"data_id": rid}} for rid in ids])
    assert r.status_code == 201, r.text


def status(api: httpx.Client, rid: str) -> dict[str, Any]:
    resp = api.get(f"/api/rollouts/{rid}")
    resp.raise_for_status()
    return resp.json()["rollout"]["status"]


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_terminal(api: httpx.Client, ids: list[str], timeout: float = 30.0) -> dict[str, dict]:
    """{rollout_id: status} of `ids` once every one has succeeded or failed."""
    done: dict[str, dict] = {}

    def all_terminal() -> bool:
        for rid in ids:
            if rid not in done:
                st = status(api, rid)
                if st["state"] in ("succeeded", "failed"):
                    done[rid] = st
        return len(done) == len(ids)

    wait_until(all_terminal, timeout, f"{len(ids)} rollouts to end")
    return done
