"""The `agl_lab_cpu` rollout: agl_lab's OpenAI server as a verl rollout replica (CPU runs).

On GPUs verl serves through vLLM replicas; on CPU, where vLLM cannot share verl's environment,
the replica is agl_lab's own OpenAI server (`openai_server.py`: `return_token_ids`, true
logprobs, continuous batching) — the gateway, the runner and the agents see the same HTTP
dialect. Two halves, one per side of Ray, each registered where verl looks it up:

    driver  CpuRolloutReplica  RolloutReplicaRegistry["agl_lab_cpu"]   ← LLMServerManager
    worker  CpuServerAdapter   _ROLLOUT_REGISTRY[("agl_lab_cpu","async")] ← ActorRolloutRefWorker

The adapter lives in the hybrid actor worker (`ActorRolloutRefWorker.rollout`): it loads the
model from `actor_rollout_ref.model.path` and runs the server on a thread of the worker
process. verl's naive checkpoint-engine sync (`ActorRolloutRefWorker.update_weights`, the
default colocated backend) hands it the trained weights tensor by tensor — the FSDP shards
gathered into full tensors — and the adapter copies them into the served model under the
server's weights lock. The replica drives the adapter through Ray's `__ray_call__` on that
worker:

| verl calls (replica)        | the server does                                                  |
|-----------------------------|------------------------------------------------------------------|
| `sleep()`                   | `pause(wait=True)`: admit nothing, let running generations end   |
| adapter `resume(kv_cache)`  | `resume()` (verl's naive sync, after the weights are loaded)     |
| `wake_up()`                 | `resume()`                                                       |
| `abort_all_requests()`      | `pause(wait=False)` + `abort()`: in-flight requests fail (503),  |
|                             | new ones wait for `resume_generation()`; returns `aborted_count` |
| `resume_generation()`       | `resume()`                                                       |
| kv-cache release/clear      | nothing: the server keeps no cache between requests              |

Hybrid mode only (training and serving share the worker), one replica per worker
(`rollout.tensor_model_parallel_size: 1`). Each server binds `agl_lab.serving.host` and
registers `agl_lab.serving.advertise_host` (`serving_address`; they reach the worker through
its env, `serving_env`): by default loopback on a cluster whose nodes share one address (one
machine), and the worker's Ray node IP when the nodes are on several machines, so the
gateway on the driver's node can reach every replica.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import sys
from typing import Any

import torch

from agl_lab.engines.verl.api import verl_import
from agl_lab.rules import MAX_BATCH_SIZE

#: actor_rollout_ref.rollout.name of this rollout (agl_lab.engines.verl.cpu registers it)
ROLLOUT_NAME = "agl_lab_cpu"

#: replica_rank → the adapter living in this worker process
_ADAPTERS: dict[int, Any] = {}
DRAIN_TIMEOUT_S = 300.0  # sleep() waits at most this long for running generations


def register() -> None:
    """Add the rollout to verl's two registries (worker adapter by path, replica by loader)."""
    verl_import("_ROLLOUT_REGISTRY")[(ROLLOUT_NAME, "async")] = f"{__name__}.CpuServerAdapter"
    verl_import("RolloutReplicaRegistry.register")(ROLLOUT_NAME, lambda: sys.modules[__name__].CpuRolloutReplica)


SERVING_HOST_ENV = "AGL_LAB_SERVING_HOST"  # agl_lab.serving.host ("" → auto)
SERVING_ADVERTISE_ENV = "AGL_LAB_SERVING_ADVERTISE_HOST"  # agl_lab.serving.advertise_host
NODE_IP = "node_ip"  # the word for "this worker's Ray node IP" in either setting


def serving_env(cfg: Any) -> dict[str, str]:
    """The worker env that carries `agl_lab.serving.host` / `advertise_host` and the engine's key
    (`AGL_ENGINE_KEY`, made here when unset: the replicas may bind a node IP) to the replicas."""
    from omegaconf import OmegaConf

    from agl_lab.addresses import ENGINE_KEY_ENV, engine_key

    host = OmegaConf.select(cfg, "agl_lab.serving.host", default=None)
    advertise = OmegaConf.select(cfg, "agl_lab.serving.advertise_host", default=None)
    return {
        SERVING_HOST_ENV: "" if host is None else str(host),
        SERVING_ADVERTISE_ENV: "" if advertise is None else str(advertise),
        ENGINE_KEY_ENV: engine_key("0.0.0.0" if host is None else str(host)),
    }


def serving_address(environ: Any = os.environ) -> tuple[str, str]:
    """(bind host, advertised host) of this worker's replica server.

    Bind: `agl_lab.serving.host`; unset → loopback when every alive Ray node has the same
    address (one machine), else `node_ip`. `node_ip` is this worker's Ray node IP. Advertised:
    `agl_lab.serving.advertise_host`, else the bind host (a wildcard advertises the node IP)."""
    import ray

    from agl_lab.addresses import LOOPBACK, is_wildcard

    node_ip = ray.util.get_node_ip_address()
    bind = environ.get(SERVING_HOST_ENV) or ""
    if not bind:
        ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        bind = LOOPBACK if len(ips) <= 1 else NODE_IP
    bind = node_ip if bind == NODE_IP else bind
    advertise = environ.get(SERVING_ADVERTISE_ENV) or ""
    advertise = node_ip if advertise == NODE_IP or (not advertise and is_wildcard(bind)) else (advertise or bind)
    return bind, advertise


def _rollout_world_size(config: Any) -> int:
    return int(config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size)


# ------------------------------------------------------------------------------------------
# Worker side: the adapter verl builds in ActorRolloutRefWorker.init_model
# ------------------------------------------------------------------------------------------


def _adapter_class() -> type:
    """verl's rollout adapter for the CPU replicas: the policy served by agl_lab's OpenAI server.

    One piece: the class is defined inside a function only so that verl's `BaseRollout` is imported
    when verl builds the adapter, not when this module is; its methods are short, one per verl call.
    """

    class CpuServerAdapter(verl_import("BaseRollout")):
        """Serves the worker's copy of the policy through agl_lab's OpenAI server."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            from agl_lab.engines.serving.openai_server import OpenAIServer
            from agl_lab.engines.tiny import load_model_and_tokenizer

            world = _rollout_world_size(self.config)
            if world != 1:
                raise ValueError(
                    f"the {ROLLOUT_NAME} rollout serves one replica per worker: set "
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (and data/pipeline "
                    f"parallel sizes 1), got a rollout world size of {world}"
                )
            rank = int(os.environ.get("RANK", 0))
            self.replica_rank = rank if replica_rank == -1 else replica_rank
            self.is_leader_rank = True
            path = self.model_config.local_path
            # float32: served logprobs must equal the actor's recomputed ones (a bf16 copy would not)
            model, tokenizer = load_model_and_tokenizer(path, device="cpu", dtype="float32")
            bind, self.advertise_host = serving_address()
            self.server = OpenAIServer(
                model,
                tokenizer,
                model_name=str(path),
                host=bind,
                max_model_len=int(self.config.max_model_len or self.config.prompt_length + self.config.response_length),
                max_batch_size=int(self.config.max_num_seqs or MAX_BATCH_SIZE),
            )
            self.server.pause(wait=False)  # asleep until verl's first weight sync wakes it
            self.global_steps: int | None = None
            self.n_weight_syncs = 0
            #: what verl asked of this replica, in order ("sleep", "update_weights:3", "resume:kv_cache", …)
            self.events: collections.deque[str] = collections.deque(maxlen=256)
            _ADAPTERS[self.replica_rank] = self

        async def resume(self, tags: list[str]) -> None:
            self.events.append("resume:" + ",".join(tags))
            if "kv_cache" in tags:  # the last step of verl's naive sync: serve again
                self.server.resume()

        async def release(self) -> None:
            self.events.append("release")
            self.server.pause(wait=True, timeout=DRAIN_TIMEOUT_S)

        async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
            """Copy verl's `(name, full tensor)` stream into the served model (HF parameter names)."""
            if wire_format != "named_tensors":
                raise ValueError(
                    f"the {ROLLOUT_NAME} rollout takes full tensors (wire_format "
                    f"'named_tensors'), got {wire_format!r}: use checkpoint_engine.backend=naive"
                )
            model = self.server.scheduler.model
            peft_config = kwargs.get("peft_config")
            seen = 0
            with self.server.weights_lock:  # no decode step sees half-loaded weights
                if peft_config is not None:  # LoRA without lora.merge: verl sends the adapter alone
                    self._adopt_adapter(model, peft_config)
                params = model.state_dict(keep_vars=True)  # tied weights (lm_head = embed_tokens) listed twice
                async for name, tensor in _aiter(weights):
                    target = params.get(_served_name(name, params))
                    if target is None:
                        raise KeyError(
                            f"weight {name!r} from the actor has no counterpart in the served model "
                            f"({type(model).__name__} from {self.model_config.local_path})"
                        )
                    with torch.no_grad():
                        # Critical: copy into the parameter itself, not `.data` — that bumps its
                        # version counter, which is how the decode step's packed weights and the
                        # prefix cache learn that the weights changed
                        target.copy_(tensor.detach().to(device="cpu", dtype=target.dtype))
                    seen += 1
            self.global_steps = kwargs.get("global_steps")
            self.events.append(f"update_weights:{self.global_steps}")
            self.n_weight_syncs += 1
            self.n_tensors_last_sync = seen

        def _adopt_adapter(self, model: Any, peft_config: Any) -> None:
            """Inject verl's adapter into the served model once (the base stays as loaded: LoRA
            never changes it); the adapter's tensors then arrive like any weight. The served
            function is base + scale·B@A exactly as the actor computes it, in float32 —
            `lora.merge=true` would instead send merged weights, in bfloat16 (verl's GPU choice)."""
            from agl_lab.engines.lora import add_lora, is_lora, spec_of_peft_config

            if not is_lora(model):
                add_lora(model, spec_of_peft_config(peft_config))
                self.events.append("adapter:injected")

        def control(self, method: str, **kwargs: Any) -> Any:
            """The replica's remote control (see the module docstring's table)."""
            if method == "address":  # what the gateway dials: the advertised host
                from agl_lab.addresses import url_host

                return f"{url_host(self.advertise_host)}:{self.server.port}"
            if method == "bind":
                return {"host": self.server.host, "port": self.server.port, "advertise": self.advertise_host}
            if method == "events":
                return list(self.events)
            if method != "status":
                self.events.append(method)
            if method == "sleep":
                self.server.pause(wait=True, timeout=DRAIN_TIMEOUT_S)
            elif method in ("wake_up", "resume_generation"):
                self.server.resume()
            elif method == "abort_all_requests":
                self.server.pause(wait=False)  # arrivals wait for resume_generation (vLLM's parking)
                return {"aborted_count": self.server.abort()}
            elif method == "status":
                return {
                    "paused": self.server.scheduler.paused,
                    "global_steps": self.global_steps,
                    "n_weight_syncs": self.n_weight_syncs,
                }
            elif method not in ("clear_kv_cache", "release_kv_cache", "resume_kv_cache"):
                raise ValueError(f"unknown control method {method!r}")
            return None

    return CpuServerAdapter


def _served_name(name: str, params: dict) -> str:
    """The served model's parameter for a weight verl sends: as named, or its LoRA-injected name
    (`…lora_A.weight` → `…lora_A.default.weight`; a base weight `…q_proj.weight` → `…q_proj.base_layer.weight`)."""
    if name in params:
        return name
    from agl_lab.engines.lora import injected_name

    injected = injected_name(name)
    if injected in params:
        return injected
    head, _, leaf = name.rpartition(".")
    return f"{head}.base_layer.{leaf}"


async def _aiter(weights: Any):
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _control(_actor: Any, replica_rank: int, method: str, kwargs: dict[str, Any]) -> Any:
    """Runs inside the worker through `__ray_call__`: forward to that worker's adapter."""
    adapter = _ADAPTERS.get(replica_rank)
    if adapter is None:
        raise RuntimeError(
            f"no {ROLLOUT_NAME} rollout adapter for replica {replica_rank} in worker pid "
            f"{os.getpid()}: was the worker built with actor_rollout_ref.rollout.name={ROLLOUT_NAME}?"
        )
    return adapter.control(method, **kwargs)


# ------------------------------------------------------------------------------------------
# Driver side: the replica LLMServerManager builds
# ------------------------------------------------------------------------------------------


def _replica_class() -> type:
    RolloutMode = verl_import("RolloutMode")

    class CpuRolloutReplica(verl_import("RolloutReplica")):
        """A replica whose server is the `CpuServerAdapter` in its hybrid worker."""

        async def launch_servers(self) -> None:
            if self.rollout_mode != RolloutMode.HYBRID:
                raise NotImplementedError(
                    f"the {ROLLOUT_NAME} rollout runs in hybrid mode only (actor_rollout_ref.hybrid_engine=true)"
                )
            self.servers = list(self.workers)
            self._server_handle = self.workers[0]
            self._server_address = await self._call_one(self.workers[0], "address")

        async def _call_one(self, worker: Any, method: str, **kwargs: Any) -> Any:
            return await worker.__ray_call__.remote(_control, self.replica_rank, method, kwargs)

        async def _call(self, method: str, **kwargs: Any) -> list[Any]:
            return list(await asyncio.gather(*(self._call_one(w, method, **kwargs) for w in self.servers)))

        async def wake_up(self) -> None:
            await self._call("wake_up")

        async def sleep(self) -> None:
            await self._call("sleep")

        async def abort_all_requests(self, reject_request: bool = False) -> dict[str, int]:
            results = await self._call("abort_all_requests")
            return {"aborted_count": sum(int(r["aborted_count"]) for r in results)}

        async def resume_generation(self) -> None:
            await self._call("resume_generation")

        async def clear_kv_cache(self) -> None: ...
        async def release_kv_cache(self) -> None: ...
        async def resume_kv_cache(self) -> None: ...

        async def status(self) -> list[dict[str, Any]]:
            return await self._call("status")

        async def events(self) -> list[list[str]]:
            """Per server: what verl asked of it, in order (the adapter's `events`)."""
            return await self._call("events")

    return CpuRolloutReplica


def __getattr__(name: str) -> Any:
    # verl resolves "agl_lab.engines.verl.cpu_rollout.CpuServerAdapter" by getattr: build the
    # classes on first use so importing this module does not import verl's rollout stack.
    if name == "CpuServerAdapter":
        globals()[name] = _adapter_class()
        return globals()[name]
    if name == "CpuRolloutReplica":
        globals()[name] = _replica_class()
        return globals()[name]
    raise AttributeError(name)
