"""Bind and advertise addresses (agl_lab/addresses.py) over real HTTP, and the external-server check.

- the rule: a set advertise host wins; a wildcard bind advertises the machine's address;
- the embedded server and the local engine's OpenAI server bound to 0.0.0.0 answer on the
  non-loopback address of this machine they advertise (from `hostname -I`; skipped where the
  machine has none), and a Trainer with `agl_lab.server.host` / `agl_lab.serving.host` set runs
  a rollout through both over that address;
- the defaults stay loopback;
- a Trainer on an external server (`agl_lab.server.embedded=false`) whose model name or train
  temperature differ from the engine's fails naming both and the `agl-lab serve` flags.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from agl_lab.addresses import ENGINE_KEY_ENV, LOOPBACK, advertised_host, is_loopback, machine_address, url_host
from agl_lab.config import ConfigError, load_config


def _non_loopback_ipv4() -> str | None:
    try:
        words = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((w for w in words if "." in w and not is_loopback(w)), None)


HOST_IP = _non_loopback_ipv4()
needs_ip = pytest.mark.skipif(HOST_IP is None, reason="this machine has no non-loopback IPv4 address (hostname -I)")


def test_the_advertise_rule():
    assert advertised_host("127.0.0.1") == "127.0.0.1"  # the default: loopback, unchanged
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") == machine_address()  # a wildcard is not dialable
    assert url_host("fd00::2") == "[fd00::2]" and url_host("10.1.2.3") == "10.1.2.3"


def test_host_keys_are_checked_at_load():
    cfg = load_config("configs/cpu_tiny.yaml")
    assert cfg.agl_lab.server.host == LOOPBACK and cfg.agl_lab.serving.host is None
    with pytest.raises(ConfigError, match=r"agl_lab\.server\.host=123 must be a host name or IP"):
        load_config("configs/cpu_tiny.yaml", ["agl_lab.server.host=123"])
    with pytest.raises(ConfigError, match=r"agl_lab\.serving\.advertise_host='http://x:1' must be a host name"):
        load_config("configs/cpu_tiny.yaml", ["agl_lab.serving.advertise_host=http://x:1"])


@needs_ip
def test_embedded_server_binds_all_and_advertises_the_machine_address():
    from agl_lab.server.embedded import EmbeddedServer

    with EmbeddedServer(key="k", host="0.0.0.0", advertise_host=HOST_IP) as server:
        assert server.url.startswith(f"http://{HOST_IP}:")
        assert httpx.get(server.url + "/healthz", timeout=30).json() == {"status": "ok"}
        port = server.url.rsplit(":", 1)[1]
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200  # bound on all


@pytest.fixture
def no_engine_key(monkeypatch):
    """A process without AGL_ENGINE_KEY; the key an engine makes is removed after the test."""
    monkeypatch.setenv(ENGINE_KEY_ENV, "")
    monkeypatch.delenv(ENGINE_KEY_ENV)


@needs_ip
def test_local_engine_serves_on_the_advertised_address(no_engine_key):
    from agl_lab.engines.local import LocalEngine

    engine = LocalEngine(host="0.0.0.0", advertise_host=HOST_IP)
    try:
        (endpoint,) = engine.endpoints()
        assert endpoint.startswith(f"http://{HOST_IP}:") and endpoint.endswith("/v1")
        body = {"model": engine.model_name, "prompt": "Look up", "max_tokens": 4, "return_token_ids": True}
        assert httpx.post(endpoint + "/completions", json=body, timeout=60).status_code == 401  # beyond loopback
        auth = {"Authorization": f"Bearer {os.environ[ENGINE_KEY_ENV]}"}  # made at start (addresses.engine_key)
        choice = httpx.post(endpoint + "/completions", json=body, headers=auth, timeout=60).json()["choices"][0]
        assert choice["token_ids"]
    finally:
        engine.close()


@needs_ip
def test_a_trainer_rolls_out_over_the_configured_addresses(tmp_path, no_engine_key):
    from agl_lab.trainer import Trainer

    t = Trainer.from_config(
        "configs/cpu_tiny.yaml",
        [
            "agl_lab.task.n_train=4",
            "agl_lab.task.n_val=2",
            "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "agl_lab.model.warm_start_steps=0",
            "agl_lab.server.host=0.0.0.0",
            f"agl_lab.server.advertise_host={HOST_IP}",
            "agl_lab.serving.host=0.0.0.0",
            f"agl_lab.serving.advertise_host={HOST_IP}",
        ],
        console=False,
        run_dir=str(tmp_path / "run"),
    )
    try:
        assert t.base_url.startswith(f"http://{HOST_IP}:")
        assert t.engine.endpoints()[0].startswith(f"http://{HOST_IP}:")
        rollouts = t.rollout().rollouts
        assert rollouts and all(r.state == "succeeded" and r.triplets for r in rollouts)
    finally:
        t.close()


def test_defaults_stay_loopback(tmp_path):
    from agl_lab.server.embedded import EmbeddedServer

    with EmbeddedServer(key="k") as server:
        assert server.url.startswith("http://127.0.0.1:")


def test_an_external_server_must_match_the_engines_model_and_temperature():
    from agl_lab.client import AglClient
    from agl_lab.execution import check_external_server
    from agl_lab.server.embedded import EmbeddedServer

    proxy = {"model_name": "served-elsewhere", "train": {"temperature": 0.5}}
    with EmbeddedServer(key="k", default_proxy=proxy) as server, AglClient(server.url, key="k") as client:
        assert client.proxy_config()["model_name"] == "served-elsewhere"
        check_external_server(client, model_name="served-elsewhere", temperature=0.5)  # matches: nothing raised
        with pytest.raises(
            ConfigError,
            match=r"model_name is 'served-elsewhere' but the engine registers its "
            r"endpoints as 'tiny'.*--model-name tiny.*temperature 0\.5 but "
            r"actor_rollout_ref\.rollout\.temperature=1.*--train-temperature 1",
        ):
            check_external_server(client, model_name="tiny", temperature=1.0)
