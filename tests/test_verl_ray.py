"""A real local Ray cluster started through `agl_lab.engines.verl.engine.init_ray` (CPU, one worker).

What it proves: a Ray worker (a task; verl's actors start the same way) that never imports
agl_lab itself finds `per_rollout_mean` in verl's policy-loss registry (the
`worker_process_setup_hook` did the import), env vars of `ray_kwargs.ray_init.runtime_env`
reach workers on top of verl's default PPO env, `RAY_TMPDIR` becomes Ray's temp dir, and a
second `init_ray` is a no-op. Wall time is ray.init (~5 s) plus one worker importing torch +
verl (~5-10 s) on an idle 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray")
from omegaconf import OmegaConf  # noqa: E402


def _make_worker_view():
    # A nested function is cloudpickled by value: the worker runs exactly this code and
    # imports nothing from agl_lab or from this test module by itself.
    def worker_view() -> dict:
        import os as _os
        import sys as _sys

        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

        return {
            "losses": sorted(POLICY_LOSS_REGISTRY),
            "algorithms_imported": "agl_lab.algorithms" in _sys.modules,
            "probe": _os.environ.get("AGL_LAB_RAY_PROBE"),
            "tokenizers_parallelism": _os.environ.get("TOKENIZERS_PARALLELISM"),
            "niceness": _os.nice(0),
        }

    return worker_view


@pytest.fixture
def ray_tmpdir(monkeypatch):
    # Ray's socket paths must stay under ~107 chars: a short dir directly under /tmp.
    path = tempfile.mkdtemp(prefix="aglr", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", path)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # let verl's default env apply
    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # init_ray's default applies
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(600)  # Ray's node start-up beside busy jobs took over 120 s (× AGL_LAB_TEST_TIME_SCALE)
def test_init_ray_registers_the_loss_in_every_worker(ray_tmpdir):
    from agl_lab.engines.verl.engine import WORKER_SETUP_HOOK, init_ray

    if ray.is_initialized():
        ray.shutdown()
    config = OmegaConf.create(
        {
            "ray_kwargs": {
                "ray_init": {
                    "num_cpus": 1,
                    "object_store_memory": 80 * 1024 * 1024,
                    "include_dashboard": False,
                    "runtime_env": {"env_vars": {"AGL_LAB_RAY_PROBE": "overlay-ok"}, "py_executable": None},
                }
            }
        }
    )
    try:
        assert init_ray(config) is True
        assert init_ray(config) is False  # already initialised: nothing happens
        assert ray.get_runtime_context().runtime_env.get("worker_process_setup_hook") == WORKER_SETUP_HOOK
        assert os.listdir(ray_tmpdir), "RAY_TMPDIR was not used as Ray's _temp_dir"

        # One worker process only (num_cpus=1): each one imports torch + verl in its setup hook.
        view = ray.get(ray.remote(num_cpus=1)(_make_worker_view()).remote(), timeout=90)
    finally:
        ray.shutdown()

    assert "per_rollout_mean" in view["losses"]
    assert "vanilla" in view["losses"]  # verl's own losses are still there
    assert view["algorithms_imported"] is True
    assert view["probe"] == "overlay-ok"  # ray_kwargs.ray_init.runtime_env overlay
    assert view["tokenizers_parallelism"] == "true"  # verl's default PPO runtime env
    assert view["niceness"] == 0  # not Ray's 15: beside a busy process a niced worker starves


def test_joining_a_cluster_drops_the_keys_ray_init_refuses_and_says_so_once(monkeypatch):
    """ray.init(address=…) raises "When connecting to an existing cluster, num_cpus and num_gpus
    must not be provided" (and the same for resources, object_store_memory, …)."""
    import warnings

    from agl_lab.engines.verl import cluster

    kwargs = {"num_cpus": 4, "num_gpus": 1, "object_store_memory": 1 << 27, "include_dashboard": False}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster.ray_init_kwargs(kwargs) == kwargs  # starting a cluster: unchanged
    assert cluster.ray_init_kwargs({**kwargs, "address": "local"}) == {**kwargs, "address": "local"}
    monkeypatch.setattr(cluster, "_said_dropped", set())
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.warns(
        RuntimeWarning,
        match=r"joining the existing Ray cluster at '10\.0\.0\.1:6379': ignoring "
        r"ray_kwargs\.ray_init\.num_cpus, ray_kwargs\.ray_init\.num_gpus, "
        r"ray_kwargs\.ray_init\.object_store_memory",
    ):
        assert cluster.ray_init_kwargs(kwargs) == {"include_dashboard": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second call is silent
        assert cluster.ray_init_kwargs(kwargs) == {"include_dashboard": False}
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.ray_init_kwargs({**kwargs, "address": "auto"}) == {"include_dashboard": False, "address": "auto"}


def test_agl_lab_ships_as_a_py_module_once():
    from pathlib import Path

    import agl_lab
    from agl_lab.engines.verl.cluster import agl_lab_py_modules

    package = str(Path(agl_lab.__file__).parent)
    assert agl_lab_py_modules({}) == [package]
    assert agl_lab_py_modules({"py_modules": ["/x/other", package]}) == ["/x/other", package]


def test_replicas_bind_loopback_on_one_machine_and_the_node_ip_across_machines(monkeypatch):
    """`agl_lab.serving.host` unset: loopback while every Ray node has one address (one machine),
    the worker's node IP once the nodes are on several machines; `node_ip` and explicit hosts win;
    a wildcard bind advertises the node IP. (Ray's node table is replaced: one process, no cluster.)"""
    from agl_lab.engines.verl.cpu_rollout import SERVING_ADVERTISE_ENV, SERVING_HOST_ENV, serving_address

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1"}, {"Alive": True, "NodeManagerAddress": "10.0.0.1"}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert serving_address({}) == ("127.0.0.1", "127.0.0.1")  # one machine, two nodes
    nodes[1]["NodeManagerAddress"] = "10.0.0.2"
    assert serving_address({}) == ("10.0.0.2", "10.0.0.2")  # two machines: reachable from the driver's
    assert serving_address({SERVING_HOST_ENV: "node_ip"}) == ("10.0.0.2", "10.0.0.2")
    assert serving_address({SERVING_HOST_ENV: "0.0.0.0"}) == ("0.0.0.0", "10.0.0.2")
    assert serving_address({SERVING_HOST_ENV: "0.0.0.0", SERVING_ADVERTISE_ENV: "gpu-7.lan"}) == (
        "0.0.0.0",
        "gpu-7.lan",
    )
    assert serving_address({SERVING_HOST_ENV: "127.0.0.1"}) == ("127.0.0.1", "127.0.0.1")
