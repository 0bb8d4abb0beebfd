"""What the recipes of docs/many-machines.md and docs/postgresql.md rely on, one by one.

- `DELETE /api/models?model=NAME` forgets that model's endpoints only (a trainer's own on a
  shared schema), on every store backend; without it, every model's (AGL's behaviour);
- `agl_lab.server.port` is the embedded server's port, a bad one fails at load naming the key;
- `agl-lab serve` at its default log level writes no line per request (`--access-log` does).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agl_lab.client import AglClient
from agl_lab.config import ConfigError, load_config
from agl_lab.protocol import Model

ROOT = Path(__file__).resolve().parents[1]


def test_delete_models_of_one_model_keeps_the_others(embedded_server, every_store_url):
    server = embedded_server(key="k", store=every_store_url)
    with AglClient(server.url, key="k") as client:
        client.register_models(
            [Model(model="mine", endpoint="http://a:1/v1"), Model(model="theirs", endpoint="http://b:1/v1")]
        )
        assert client.delete_models("mine") is True
        assert server.store.models_for("mine") == []
        assert [m.endpoint for m in server.store.models_for("theirs")] == ["http://b:1/v1"]
        assert client.delete_models() is True  # no filter: every model's, as Agent Lightning
        assert server.store.models_for("theirs") == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_port_key_is_checked_at_load():
    assert load_config("configs/cpu_tiny.yaml", []).agl_lab.server.port == 0
    for bad in ("70000", "-1", "http"):
        with pytest.raises(ConfigError, match="agl_lab.server.port"):
            load_config("configs/cpu_tiny.yaml", [f"agl_lab.server.port={bad}"])


@pytest.mark.parametrize("access_log", [False, True])
def test_serve_logs_no_line_per_request_unless_asked(access_log, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "agl_lab.cli", "serve", "--port", str(port), *(["--access-log"] * access_log)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "AGL_KEY": "k"}, stdout=out, stderr=out
        )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        for _ in range(3):
            httpx.get(
                url + "/api/rollouts?state_in=queuing", headers={"Authorization": "Bearer k"}, timeout=10
            ).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert "Uvicorn running on" in text or "Application startup complete" in text, text  # info lines stay
    assert ('"GET /api/rollouts?state_in=queuing HTTP/1.1" 200' in text) is access_log, text


def test_the_documented_examples_parse_and_give_runners_the_runner_key_only():
    """docs/examples/ are not run here (no Docker, no Kubernetes): they parse, and keep the scopes."""
    import yaml

    compose = yaml.safe_load((ROOT / "docs/examples/compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "server-1", "server-2", "runner-1", "runner-2", "trainer"} <= set(services)
    assert services["runner-1"]["secrets"] == services["runner-2"]["secrets"] == ["runner_key"]
    assert "admin_key" not in str(services["runner-1"]) and "--key " not in str(compose)
    job = yaml.safe_load((ROOT / "docs/examples/runner-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["agl-lab", "runner"] and "--key-file" in container["command"]
    assert job["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "agl-runner-key"
