"""The verl engine across two Ray nodes (docs/many-machines.md's multi-node recipe, on one machine).

Two nodes started with `ray start` (own temp dirs, free ports, 4 logical CPUs + 1 fake GPU
each, no PYTHONPATH: workers get agl_lab only through Ray `py_modules`); the Trainer joins
them through `RAY_ADDRESS`, as docs/many-machines.md says. On the same two batches:

- world size 1 (`trainer.nnodes=1 trainer.n_gpus_per_node=1`): two updates;
- world size 2 (`trainer.nnodes=2 trainer.n_gpus_per_node=1`: one FSDP2 rank per node, gloo
  across the nodes, `trainer.balance_batch=true` as on GPUs): the same two updates — equal pg_loss and grad norm, parameter changes
  within 2e-5 relative of world size 1 (measured 6.0e-6 and 7.8e-6 with balance_batch; AdamW's
  1/sqrt(v) amplifies float32 summation-order noise, as in tests/test_verl_cpu.py), the two replicas serve identical weights after each
  sync; then one rollout through both replicas, registered under the node's address
  (`agl_lab.serving.host=node_ip`).

Also, on the live cluster: the placement check refuses `n_gpus_per_node=2` on two 1-GPU nodes
with the numbers (verl would wait for ever), a placement group no node can hold times out
with a clear error, a path missing on the nodes is refused naming them, a checkpoint holds
both ranks' shards, a driver without a GPU joining the cluster takes its device from the nodes,
and every process of both nodes is gone afterwards.

Wall time on the shared 2-core machine: 98-145 s for the module (nodes 20-50 s, then two engines).
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest

import agl_lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # two Ray nodes and FSDP workers: slow on a busy machine

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from agl_lab.addresses import is_loopback  # noqa: E402
from tests.ray_env import isolated_ray_env, ray_nodes  # noqa: E402
from tests.replica_probe import give_rollouts_distinct_rewards  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "cpu_verl.yaml")
OVERRIDES = [
    "agl_lab.model.warm_start_steps=0",
    "agl_lab.task.n_train=16",
    "agl_lab.task.n_val=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.total_training_steps=4",
]


@pytest.fixture(scope="module")
def cluster_address():
    if ray.is_initialized():  # a connection left by another module would be reused, not joined
        ray.shutdown()
    with isolated_ray_env("aglm") as path, ray_nodes(2, num_cpus=4, num_gpus=1) as address:
        old = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = address  # docs/many-machines.md's way of joining
        try:
            yield address, path
        finally:
            if old is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = old


def _served_states(engine):
    """Per worker of the actor group: (Ray node id, agl_lab's file there, the served weights)."""

    def read(_actor):
        import agl_lab
        from agl_lab.engines.verl.cpu_rollout import _ADAPTERS

        (adapter,) = _ADAPTERS.values()
        model = adapter.server.scheduler.model
        return (
            ray.get_runtime_context().get_node_id(),
            agl_lab.__file__,
            {k: v.detach().clone() for k, v in model.state_dict().items()},
        )

    return ray.get([w.__ray_call__.remote(read) for w in engine.trainer.actor_rollout_wg.workers])


def _trainer(run_dir, *overrides):
    from agl_lab.trainer import Trainer

    return Trainer.from_config(CONFIG, [*OVERRIDES, *overrides], console=False, run_dir=run_dir)


def _wait_for_free_gpus(address, n, timeout_s=120.0):
    """After a Trainer closed, Ray frees its placement groups asynchronously: wait (bounded)."""
    import time

    ray.init(address=address)
    try:
        deadline = time.monotonic() + timeout_s
        while ray.available_resources().get("GPU", 0) < n:
            assert time.monotonic() < deadline, f"the cluster did not free its GPUs: {ray.available_resources()}"
            time.sleep(0.5)
    finally:
        ray.shutdown()


def _updates(trainer, batches):
    """trainer.update on copies of `batches`; (metrics, served states after each) per batch."""
    out = []
    for batch in batches:
        result = trainer.update(copy.deepcopy(batch))
        out.append((result.metrics, _served_states(trainer.engine)))
    return out


def test_two_nodes_train_like_one(cluster_address):
    from agl_lab.engines.verl import cluster

    address, tmp = cluster_address
    # --- world size 1 on the two-node cluster: the reference, and the two batches -------------
    with pytest.warns(RuntimeWarning, match=r"joining the existing Ray cluster .*ray_init\.num_cpus"):
        t1 = _trainer(os.path.join(tmp, "run1"), "trainer.nnodes=1", "trainer.n_gpus_per_node=1")
    try:
        start1 = _served_states(t1.engine)[0][2]
        b1 = t1.build_batch(t1.rollout())
        give_rollouts_distinct_rewards(b1.data, offset=1)
        frozen = [copy.deepcopy(b1)]
        ref = _updates(t1, frozen)
        b2 = t1.build_batch(t1.rollout())  # sampled from the weights after update 1
        give_rollouts_distinct_rewards(b2.data, offset=1)
        frozen.append(copy.deepcopy(b2))
        ref += _updates(t1, frozen[1:])
    finally:
        t1.close()
    _wait_for_free_gpus(address, 2)

    # --- world size 2: one rank per node ------------------------------------------------------
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the joining warning was checked above
        # balance_batch as on GPUs (verl's default, configs/gpu_verl.yaml): tokens balanced across the
        # two ranks within each planned mini-batch, so the update still equals world size 1's
        t2 = _trainer(
            os.path.join(tmp, "run2"),
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
            "agl_lab.serving.host=node_ip",
            "trainer.balance_batch=true",
        )
    try:
        engine = t2.engine
        states = _served_states(engine)
        assert len({node for node, _, _ in states}) == 2, "the two ranks are not on two Ray nodes"
        checkout = os.path.dirname(os.path.dirname(os.path.abspath(agl_lab.__file__)))
        for _, agl_lab_file, _ in states:  # the code a worker runs came through py_modules, not the checkout
            assert "runtime_resources" in agl_lab_file and not agl_lab_file.startswith(checkout), agl_lab_file
        for _, _, state in states:
            assert all(torch.equal(state[k], start1[k]) for k in start1)  # same initial weights
        got = _updates(t2, frozen)
        for step, ((m1, s1), (m2, s2)) in enumerate(zip(ref, got), start=1):
            assert "global_seqlen/balanced_max" in m2 and "global_seqlen/balanced_max" not in m1, step
            assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-5, abs=1e-7), step
            assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5), step
            (_, _, w1), ((_, _, a), (_, _, b)) = s1[0], s2
            assert all(torch.equal(a[k], b[k]) for k in a), f"replicas differ after sync {step}"
            before = start1 if step == 1 else ref[step - 2][1][0][2]
            d1 = torch.cat([(w1[k] - before[k]).flatten() for k in before])
            d2 = torch.cat([(a[k] - before[k]).flatten() for k in before])
            rel = ((d1 - d2).norm() / d1.norm()).item()
            print(
                f"step {step}: pg_loss {m1['actor/pg_loss']:.6g} / {m2['actor/pg_loss']:.6g}, grad_norm "
                f"{m1['actor/grad_norm']:.6g} / {m2['actor/grad_norm']:.6g}, parameter change rel. diff {rel:.2e}"
            )
            assert d1.abs().max() > 0 and rel < 2e-5, (step, rel)
        # both replicas registered under their node's address, and both serve a rollout
        endpoints = engine.endpoints()
        node_ip = ray.util.get_node_ip_address()
        assert len(endpoints) == 2 and len(set(endpoints)) == 2, endpoints
        assert all(ep.startswith(f"http://{node_ip}:") for ep in endpoints), (endpoints, node_ip)
        if is_loopback(node_ip):
            print("this machine's Ray node IP is loopback: the node_ip binding was not off loopback")
        rollouts = t2.rollout().rollouts  # the gateway spreads the calls over both replicas
        assert rollouts and all(r.state == "succeeded" and r.triplets for r in rollouts), [
            (r.state, r.error_message) for r in rollouts
        ]

        # --- the checks of cluster.py, on the live cluster --------------------------------------
        nodes = cluster.alive_nodes()
        assert len(nodes) == 2
        with pytest.raises(ValueError, match=r"needs 2 worker processes on ONE node .*--num-gpus=2"):
            cluster.check_placement(
                {"global_pool": [2]},
                3,
                {n: {"ip": i["ip"], "available": {"CPU": 4, "GPU": 1}} for n, i in nodes.items()},
                joined=True,
            )
        with pytest.raises(FileNotFoundError, match=r"agl_lab\.missing=/nonexistent/agl_lab is missing on node"):
            cluster.check_paths_on_nodes({"agl_lab.missing": "/nonexistent/agl_lab"})
        cluster.check_shared_dir(os.path.join(tmp, "shared"))  # one machine: the dir is shared
        # a checkpoint: each rank writes its shard on its own node, into the (shared) directory
        engine.save(os.path.join(tmp, "ckpt"))
        actor_dir = os.path.join(tmp, "ckpt", f"global_step_{engine.policy_version}", "actor")
        shards = sorted(f for f in os.listdir(actor_dir) if "world_size_2_rank" in f)
        assert any("rank_0" in f for f in shards) and any("rank_1" in f for f in shards), os.listdir(actor_dir)
    finally:
        t2.close()


def test_a_placement_group_no_node_holds_times_out_with_the_numbers(cluster_address):
    """verl would wait on it for ever; `place_pools` gives up after the timeout, removing it."""
    from types import SimpleNamespace

    from agl_lab.engines.verl import cluster

    address, _ = cluster_address
    ray.init(address=address, runtime_env={"py_modules": cluster.agl_lab_py_modules({})})
    try:
        pool = SimpleNamespace(
            pgs=None, max_colocate_count=3, use_gpu=True, accelerator_type=None, name_prefix="too_big", store=[2]
        )
        with pytest.raises(TimeoutError, match=r"pool 'too_big' .*not placed within 2 s"):
            cluster.place_pools([pool], timeout_s=2)
        assert pool.pgs is None
    finally:
        ray.shutdown()


def test_a_driver_without_a_gpu_joining_the_cluster_takes_the_device_from_its_nodes(
    cluster_address, tmp_path, monkeypatch
):
    """The notebook case: a login node (no GPU, no CUDA) joins a GPU cluster. The device is decided
    by the nodes: `auto` asks each node that declares Ray GPUs how many GPUs its NVIDIA driver
    lists; `cuda` needs nodes that declare GPUs, not a GPU here. These nodes declare fake GPUs
    (0 NVIDIA: CPU); pointing the probe at a directory with one entry stands for a node with one."""
    from agl_lab.config import load_config
    from agl_lab.engines.verl import cluster
    from agl_lab.engines.verl.cpu import cpu_platform_wanted
    from agl_lab.engines.verl.engine import WORKER_ENV_KEYS, _select_device

    address, _ = cluster_address
    assert not torch.cuda.is_available()
    gpu_config = os.path.join(os.path.dirname(__file__), "..", "configs", "gpu_verl.yaml")
    auto = load_config(gpu_config)  # agl_lab.verl.device: auto
    nodes = cluster.nvidia_gpus_on_cluster(address)
    assert sorted(n["declared"] for n in nodes.values()) == [1.0, 1.0], nodes
    assert all(n["nvidia"] == 0 for n in nodes.values()) and not ray.is_initialized()  # the connection is closed
    assert cpu_platform_wanted(auto, address)  # fake GPUs: verl's workers would find no CUDA there

    (tmp_path / "0000:17:00.0").mkdir()  # what /proc/driver/nvidia/gpus holds on a node with one GPU
    monkeypatch.setattr(cluster, "NVIDIA_GPUS_DIR", str(tmp_path))
    assert all(n["nvidia"] == 1 for n in cluster.nvidia_gpus_on_cluster(address).values())
    assert not cpu_platform_wanted(auto, address)  # GPUs on the nodes: the GPU path, though none is here
    assert cpu_platform_wanted(auto, None)  # not joining: this machine decides
    env = {key: os.environ.get(key) for key in WORKER_ENV_KEYS}
    assert _select_device(auto) == {}  # RAY_ADDRESS (the fixture's) is the cluster joined
    assert {key: os.environ.get(key) for key in WORKER_ENV_KEYS} == env  # no CPU platform loaded, nothing exported
    monkeypatch.undo()

    forced = load_config(gpu_config, ["agl_lab.verl.device=cuda"])
    with pytest.warns(RuntimeWarning, match=r"declare GPU resources but list no NVIDIA GPU .*1 declared, 0 NVIDIA"):
        assert _select_device(forced) == {}
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(RuntimeError, match=r"none is visible here: .*RAY_ADDRESS=<head>:<port>"):
        _select_device(forced)
