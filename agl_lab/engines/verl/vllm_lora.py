"""LoRA on verl's vLLM replicas: the agents' calls sample from base + adapter, as verl's own do.

With `actor_rollout_ref.model.lora_rank > 0` and `lora.merge` off (verl's default), verl 0.9.1
starts vLLM with `enable_lora` and, at every weight sync, loads the actor's adapter into the
vLLM workers as one LoRA request of its own (`VLLM_LORA_NAME`, `VLLM_LORA_INT_ID`, the tensors
from the actor; verl/workers/rollout/vllm_rollout/utils.py). Only verl's own
`vLLMHttpServer.generate()` attaches that request. The gateway calls vLLM's OpenAI routes with
the served model name, which vLLM resolves to a LoRA request only when the name is a key of
`OpenAIServingModels.lora_requests` (`OpenAIServing._maybe_get_adapters` looks there first) — and
verl registers nothing there. So without this module the replicas sample from the bare base
model while the actor computes the adapter's logprobs (tests/vllm/test_lora_vllm.py measures it).

| who                    | what it does                                                            |
|------------------------|-------------------------------------------------------------------------|
| verl's weight sync     | `add_lora(TensorLoRARequest(VLLM_LORA_NAME, VLLM_LORA_INT_ID, …))` in   |
|                        | every vLLM worker, replacing the previous adapter                        |
| `route_to_adapter`     | (here, in each replica's server actor, after every sync) puts verl's    |
|                        | request under the served model name in `lora_requests`                  |
| vLLM's OpenAI routes   | a call naming the served model gets verl's LoRA request: the adapter    |
|                        | the workers hold, by its id (no load from `VLLM_LORA_PATH`)             |

The served model name keeps its meaning — "the policy being trained" — so nothing above the
engine changes (the gateway, the store's registered models, agents). Answers name the adapter
in their `model` field (verl's `VLLM_LORA_NAME`, "123"): vLLM reports the LoRA request's name.
The request is verl's own, equal to the one `generate()` builds (vLLM compares LoRA requests by
name), so both paths share the one adapter slot verl configures (`max_loras: 1`).

`lora.merge: true` needs none of this (verl then syncs merged weights and vLLM runs without
LoRA); nor does the agl_lab_cpu replica (it injects the adapter into its own model).
Importing this module imports neither verl, vLLM nor Ray.
"""

from __future__ import annotations

from typing import Any

from agl_lab.engines.verl.api import verl_import


def _serving_models(server: Any) -> Any:
    """The `OpenAIServingModels` of a `vLLMHttpServer` actor: its app's state.

    verl keeps no reference to the FastAPI app it serves; it keeps the task running uvicorn
    (`_server_task`, from `run_uvicorn`), whose coroutine is the `uvicorn.Server.serve` of that app.
    """
    task = server._server_task  # VERL_API: vLLMHttpServer.run_server (attrs)
    frame = task.get_coro().cr_frame if task is not None and not task.done() else None
    uvicorn_server = frame.f_locals.get("self") if frame is not None else None
    state = getattr(getattr(getattr(uvicorn_server, "config", None), "app", None), "state", None)
    models = getattr(state, "openai_serving_models", None)  # set by vLLM's init_app_state
    if models is None:
        raise RuntimeError(
            "LoRA on verl's vLLM replicas: the replica's OpenAI server (vLLMHttpServer._server_task) is not "
            "running uvicorn with vLLM's app state, so its calls cannot be routed to the adapter; set "
            "actor_rollout_ref.model.lora.merge=true to serve merged weights instead"
        )
    return models


def route_to_adapter(server: Any) -> str | None:
    """Runs inside a `vLLMHttpServer` actor (`__ray_call__`), after a weight sync: calls that name
    the served model get verl's LoRA request. Returns that name, or None when verl serves no
    adapter here (no LoRA, or `lora.merge`). Idempotent."""
    if not server.lora_as_adapter:  # VERL_API: vLLMHttpServer.lora_as_adapter.fget
        return None
    models = _serving_models(server)
    served = models.base_model_paths[0].name  # what /v1/models lists and the gateway sends
    lora_request = verl_import("LoRARequest")  # the class verl's generate() builds its request from
    # Critical: verl's name and id — the adapter its sync loaded, not a new one to load from a path
    models.lora_requests[served] = lora_request(
        lora_name=verl_import("VLLM_LORA_NAME"),
        lora_int_id=verl_import("VLLM_LORA_INT_ID"),
        lora_path=verl_import("VLLM_LORA_PATH"),
    )
    return served
