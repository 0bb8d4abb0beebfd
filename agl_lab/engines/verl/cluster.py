"""The Ray cluster under the verl engine: joining one, placing verl's pools, what every node needs.

One machine or several, the engine asks the same four things of Ray, each answered here
before verl would otherwise hang or fail deep inside a worker:

| question                               | answer                                                         |
|----------------------------------------|----------------------------------------------------------------|
| start a cluster, or join one?          | `ray_init_kwargs`: joining (`RAY_ADDRESS`, or                  |
|                                        | `ray_kwargs.ray_init.address`) drops the resource keys ray.init |
|                                        | refuses there (`num_cpus`, `num_gpus`, …), with one warning    |
| do verl's placement groups fit?        | `check_placement`: verl's own rule, per node (below); the      |
|                                        | numbers and the fix at start-up instead of an unending wait    |
| how long may placement take?           | `place_pools`: verl's placement groups made here with a bounded |
|                                        | wait (`agl_lab.verl.placement_timeout_seconds`)                 |
| does every node have the code, the     | `agl_lab_py_modules`: agl_lab ships to every worker as a Ray    |
| model, the checkpoint directory?       | `py_modules` package (no shared checkout needed);               |
|                                        | `check_paths_on_nodes` / `check_shared_dir`: one tiny Ray task  |
|                                        | per node looks at the path and names the nodes that lack it    |

verl 0.9.1's placement rule (`ResourcePoolManager.create_resource_pool` →
`RayResourcePool.get_placement_groups`): a pool spec `{pool: [n_gpus_per_node] * nnodes}`
becomes, per list entry, one placement group of `n_gpus_per_node` bundles
`{CPU: max_colocate_count, GPU: 1}` with strategy **STRICT_PACK** — every bundle of a group on
one node. verl's own check (`_check_resource_available`) only compares cluster-wide GPU
totals, so `n_gpus_per_node=2` on two 1-GPU nodes passes it and then waits for ever.

Imports Ray lazily and verl only through `VERL_API` (rows `RayResourcePool*`,
`sort_placement_group_by_node_ip`, `get_platform`).
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_lab.engines.verl.api import verl_import

# ray.init refuses these when it connects to an existing cluster (ray/_private/worker.py, 2.60)
JOIN_REFUSED = (
    "num_cpus",
    "num_gpus",
    "resources",
    "labels",
    "object_store_memory",
    "_system_config",
    "_enable_object_reconstruction",
    "_node_name",
)
PLACEMENT_TIMEOUT_S = 120.0  # agl_lab.verl.placement_timeout_seconds's default
PATH_CHECK_TIMEOUT_S = 120.0  # one Ray task per node, scheduled with num_cpus=0
_AGL_LAB_PACKAGE = str(Path(__file__).resolve().parents[2])  # …/agl_lab (engines/verl/cluster.py)
_said_dropped: set[tuple[str, ...]] = set()


# ------------------------------------------------------------------------------------------
# Starting or joining
# ------------------------------------------------------------------------------------------


def joining_address(kwargs: Mapping[str, Any]) -> str | None:
    """The address of an existing cluster ray.init will connect to, or None (it starts one).

    `ray_kwargs.ray_init.address`, else `$RAY_ADDRESS` (which ray.init reads itself); `local`
    (and no address) starts a new cluster."""
    address = kwargs.get("address") or os.environ.get("RAY_ADDRESS") or None
    return None if address in (None, "local") else str(address)


def ray_init_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`ray_kwargs.ray_init` (nulls already dropped) made acceptable to ray.init.

    Starting a cluster: unchanged. Joining one: the keys ray.init refuses there (`JOIN_REFUSED`:
    the cluster's nodes declared their resources at `ray start`) are dropped, with one
    warning naming them (once per set of keys and process)."""
    address = joining_address(kwargs)
    if address is None:
        return dict(kwargs)
    dropped = tuple(k for k in JOIN_REFUSED if kwargs.get(k) is not None)
    if dropped and dropped not in _said_dropped:
        _said_dropped.add(dropped)
        warnings.warn(
            f"joining the existing Ray cluster at {address!r}: ignoring ray_kwargs.ray_init."
            f"{', ray_kwargs.ray_init.'.join(dropped)} (ray.init refuses them there; the nodes' resources are what "
            "`ray start --num-cpus/--num-gpus` declared). Unset RAY_ADDRESS (and ray_init.address) to start a cluster "
            "of your own instead",
            RuntimeWarning,
            stacklevel=3,
        )
    return {k: v for k, v in kwargs.items() if k not in dropped}


def agl_lab_py_modules(runtime_env: Mapping[str, Any]) -> list[Any]:
    """`runtime_env["py_modules"]` with the agl_lab package added: Ray uploads it once per job and
    every worker on every node imports it from there (no shared checkout, no install on the
    nodes). The nodes still need agl_lab's dependencies (torch, verl, transformers) installed."""
    modules = list(runtime_env.get("py_modules") or [])
    if not any(str(m).rstrip("/").endswith("agl_lab") for m in modules if isinstance(m, (str, os.PathLike))):
        modules.append(_AGL_LAB_PACKAGE)
    return modules


# ------------------------------------------------------------------------------------------
# Placement: verl's rule, per node
# ------------------------------------------------------------------------------------------


def alive_nodes() -> dict[str, dict[str, Any]]:
    """Ray node id → {"ip", "available": {resource: amount}} for every alive node."""
    import ray
    from ray._private import state  # what verl's ResourcePoolManager reads

    available = state.available_resources_per_node()
    return {
        n["NodeID"]: {"ip": n["NodeManagerAddress"], "available": dict(available.get(n["NodeID"], {}))}
        for n in ray.nodes()
        if n.get("Alive")
    }


def check_placement(
    spec: Mapping[str, Sequence[int]],
    max_colocate_count: int,
    nodes: Mapping[str, Mapping[str, Any]],
    gpu_resource: str = "GPU",
    *,
    joined: bool = False,
) -> None:
    """Fail fast when verl's placement groups cannot all be placed (Ray would wait for ever).

    `spec`: `{pool: [processes per placement group]}` (verl: `[n_gpus_per_node] * nnodes`);
    each entry is one STRICT_PACK group of that many bundles `{CPU: max_colocate_count,
    gpu_resource: 1}`. `nodes`: `alive_nodes()`. Groups are packed largest first onto the node
    with the most free GPUs that holds them (Ray's own packing may differ in corner cases; a
    group no single node can hold never fits). `joined`: the cluster is someone else's (the
    fix is `ray start` flags, not `ray_kwargs.ray_init`). Raises ValueError with the numbers.
    """
    groups = sorted(((int(n), pool) for pool, counts in spec.items() for n in counts if int(n) > 0), reverse=True)
    free = {
        node: [float(info["available"].get("CPU", 0)), float(info["available"].get(gpu_resource, 0))]
        for node, info in nodes.items()
    }
    for processes, pool in groups:
        cpu, gpu = processes * max_colocate_count, processes
        fits = [node for node, (c, g) in free.items() if c >= cpu and g >= gpu]
        if fits:
            best = max(fits, key=lambda node: (free[node][1], free[node][0]))
            free[best][0] -= cpu
            free[best][1] -= gpu
            continue
        raise ValueError(_placement_message(spec, max_colocate_count, nodes, gpu_resource, processes, pool, joined))


def _placement_message(
    spec: Mapping[str, Sequence[int]],
    mcc: int,
    nodes: Mapping[str, Mapping[str, Any]],
    gpu: str,
    processes: int,
    pool: str,
    joined: bool,
) -> str:
    have = (
        "; ".join(
            f"{info['ip']} ({node[:8]}): {float(info['available'].get('CPU', 0)):g} CPUs, "
            f"{float(info['available'].get(gpu, 0)):g} {gpu}s"
            for node, info in nodes.items()
        )
        or "no nodes"
    )
    total = sum(int(n) for counts in spec.values() for n in counts)
    layout = ", ".join(f"{name}: {list(counts)}" for name, counts in spec.items())
    if joined:
        fix = (
            f"start each node with enough: `ray start ... --num-cpus={processes * mcc} --num-gpus={processes}` "
            "(on CPU these are logical CPUs and fake GPUs), or lower trainer.n_gpus_per_node to the GPUs of the "
            "smallest node and raise trainer.nnodes"
        )
    else:
        fix = (
            f"set ray_kwargs.ray_init.num_cpus>={total * mcc} (logical CPUs: they need not match the machine's "
            f"cores) and ray_kwargs.ray_init.num_gpus>={total} (on CPU these are the fake GPUs verl's pools ask "
            "for), or lower trainer.n_gpus_per_node / trainer.nnodes"
        )
    return (
        f"verl's placement groups do not fit the Ray cluster, so Ray would wait for ever: pool {pool!r} needs "
        f"{processes} worker processes on ONE node (verl places each entry of {{{layout}}} as a STRICT_PACK "
        f"group of bundles {{CPU: {mcc}, {gpu}: 1}}), i.e. {processes * mcc} CPUs and {processes} {gpu}s free "
        f"on a single node (in all: need {total * mcc} CPUs and {total} {gpu}s), and the alive nodes have "
        f"{have}: {fix}"
    )


def place_pools(pools: Iterable[Any], timeout_s: float) -> None:
    """Create each verl `RayResourcePool`'s placement groups as verl would, waiting at most
    `timeout_s`; verl's `get_placement_groups` then returns them (it waits without a bound).

    The bundles and names are verl's (`RayResourcePool.get_placement_groups`, a VERL_API row).
    On timeout the groups are removed and TimeoutError names the pool, what it asked and the
    cluster's free resources."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    resource = verl_import("get_platform")().ray_resource_name()
    for pool in pools:
        if getattr(pool, "pgs", None) is not None:
            continue
        bundle: dict[str, float] = {"CPU": pool.max_colocate_count}
        if pool.use_gpu:
            bundle[resource] = 1
            if pool.accelerator_type is not None:
                bundle[pool.accelerator_type] = 1e-4
        prefix = f"{pool.name_prefix}verl_group_{'_'.join(str(c) for c in pool.store)}:"
        pgs = [
            placement_group(bundles=[dict(bundle) for _ in range(count)], strategy="STRICT_PACK", name=prefix + str(i))
            for i, count in enumerate(pool.store)
        ]
        ready, pending = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if pending:
            for pg in pgs:
                remove_placement_group(pg)
            raise TimeoutError(
                f"verl's placement groups for pool {pool.name_prefix!r} ({list(pool.store)} bundles of {bundle}, "
                f"STRICT_PACK per group) were not placed within {timeout_s:g} s ({len(pending)} of {len(pgs)} "
                f"pending); the cluster has {ray.available_resources()} free. Another job may hold the resources "
                "(`ray status`), or raise agl_lab.verl.placement_timeout_seconds"
            )
        pool.pgs = verl_import("sort_placement_group_by_node_ip")(pgs)


# ------------------------------------------------------------------------------------------
# Where the GPUs are: the nodes, not the driver (a login node joining a GPU cluster)
# ------------------------------------------------------------------------------------------

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA kernel driver sees
GPU_PROBE_TIMEOUT_S = 60.0


def nvidia_gpus_on_cluster(address: str) -> dict[str, dict[str, float]]:
    """`ip (node id)` → {"declared": Ray `GPU` resources, "nvidia": GPUs its NVIDIA driver lists}
    for every alive node of the Ray cluster at `address` that declares `GPU` resources.

    The driver may have no GPU (a Jupyter login node joining a GPU cluster): where verl's
    workers run is what decides the device. One num_cpus=0 task per such node, on a temporary
    connection (closed again unless this process was already connected); the task is a local
    function (pickled by value), so the nodes need no agl_lab. CPU test clusters declare fake
    GPUs: they show as declared with 0 NVIDIA GPUs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def count_nvidia_gpus(directory: str) -> int:
        import os as _os

        return len(_os.listdir(directory)) if _os.path.isdir(directory) else 0

    connected = ray.is_initialized()
    if not connected:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
        probe = ray.remote(num_cpus=0, max_retries=0)(count_nvidia_gpus)
        refs = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                NVIDIA_GPUS_DIR
            )
            for n in nodes
        ]
        try:
            counts = ray.get(refs, timeout=GPU_PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"asking the Ray cluster at {address} for its GPUs took more than "
                f"{GPU_PROBE_TIMEOUT_S:g} s: a node may be down (`ray status`)"
            ) from None
        return {
            f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})": {
                "declared": float(n["Resources"]["GPU"]),
                "nvidia": float(c),
            }
            for n, c in zip(nodes, counts)
        }
    finally:
        if not connected:
            ray.shutdown()


def module_on_every_node(name: str) -> bool:
    """`importlib.util.find_spec(name)` is found on every alive Ray node (this process is connected).

    One num_cpus=0 task per node, in the job's runtime env (the Python the workers use); the
    task is a local function (pickled by value)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def has_module(module: str) -> bool:
        import importlib.util as _util

        try:
            return _util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    probe = ray.remote(num_cpus=0, max_retries=0)(has_module)
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(name)
        for node in alive_nodes()
    ]
    try:
        return all(ray.get(refs, timeout=GPU_PROBE_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"asking every Ray node for the {name} package took more than {GPU_PROBE_TIMEOUT_S:g} s: "
            "a node may be down (`ray status`)"
        ) from None


# ------------------------------------------------------------------------------------------
# What every node must see: paths
# ------------------------------------------------------------------------------------------


def _look(_paths: dict[str, str], marker: str | None) -> dict[str, Any]:
    """Runs on one node (a Ray task): which of `_paths` exist there (and the marker, if any)."""
    import os as _os
    import socket as _socket

    missing = [label for label, path in _paths.items() if not _os.path.exists(path)]
    if marker is not None and not _os.path.exists(marker):
        missing.append("marker")
    return {"host": _socket.gethostname(), "missing": missing}


def _on_every_node(paths: Mapping[str, str], marker: str | None = None) -> dict[str, dict[str, Any]]:
    """node ip/id → `_look` there, one task per alive node (num_cpus=0: runs beside placed workers)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    look = ray.remote(num_cpus=0, max_retries=0)(_look)
    nodes = alive_nodes()
    refs = {
        f"{info['ip']} ({node[:8]})": look.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote(dict(paths), marker)
        for node, info in nodes.items()
    }
    try:
        answers = ray.get(list(refs.values()), timeout=PATH_CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"checking {dict(paths)} on every Ray node took more than {PATH_CHECK_TIMEOUT_S:g} s: "
            "a node may be down or out of worker processes (`ray status`)"
        ) from None
    return dict(zip(refs, answers))


def _warm_start_hint(path: str) -> str:
    cache = Path.home() / ".cache" / "agl_lab"
    if str(Path(path).resolve()).startswith(str(cache.resolve())):
        return (
            f" ({path} is agl_lab's cached tiny/warm-started model, built on the driver: copy {cache} to the "
            "same path on every node, or save the model to a shared directory and set agl_lab.model.path to it)"
        )
    return ""


def _n_alive_nodes(ray: Any) -> int:
    """Alive Ray nodes; 0 without a Ray connection (an engine on fake worker groups: nothing to ask)."""
    return len([n for n in ray.nodes() if n.get("Alive")]) if ray.is_initialized() else 0


def check_paths_on_nodes(paths: Mapping[str, str]) -> None:
    """Every path in `paths` (config key → path) exists on every alive Ray node, else
    FileNotFoundError naming the key, the path and the nodes that lack it. One node: nothing
    to ask (the driver checked its own paths)."""
    import ray

    if not paths or _n_alive_nodes(ray) < 2:
        return
    problems = []
    for node, answer in _on_every_node(paths).items():
        for key in answer["missing"]:
            problems.append(f"{key}={paths[key]} is missing on node {node}{_warm_start_hint(paths[key])}")
    if problems:
        raise FileNotFoundError(
            "verl's workers read these paths on their own nodes: "
            + "; ".join(problems)
            + ". Put them on every node at the same path (a shared filesystem, or a copy on each node)"
        )


def check_shared_dir(path: str, what: str = "checkpoint directory") -> None:
    """`path` is one directory every alive Ray node sees (a marker file written here must be
    visible on each node), else OSError naming the nodes: verl's workers write their shards
    under it on their own nodes, the driver writes agl_lab's state beside them."""
    import ray

    if _n_alive_nodes(ray) < 2:
        return
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(os.path.abspath(path), f".agl_lab_shared_{uuid.uuid4().hex}")
    Path(marker).touch()
    try:
        answers = _on_every_node({}, marker)
    finally:
        Path(marker).unlink(missing_ok=True)
    blind = [node for node, answer in answers.items() if "marker" in answer["missing"]]
    if blind:
        raise OSError(
            f"the {what} {os.path.abspath(path)} is not shared with Ray node(s) {', '.join(blind)} (a file "
            "written there by the driver is not visible on them): mount the same directory at that path on "
            "every node (e.g. NFS), or pass a directory that is shared"
        )
