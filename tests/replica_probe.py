"""What the engine tests ask of a serving replica and of a built batch.

data, served = sample_fixed(url, prompt)       # one sampled continuation + its served logprobs [R]
data, served = fixed_sequence(engine)          # the same from an engine's first replica, after FIXED_PROMPT
served_logprobs_of(engine, data)               # what that replica serves for data's response tokens
calls = sample_calls(engine, temperature)      # 4 concurrent chat calls of different lengths
data = calls_to_batch(calls, pad_id)           # those calls in verl's layout, served logprobs included
give_rollouts_distinct_rewards(batch.data)     # rewards that give every group a gradient
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

FIXED_PROMPT = "Look up the capital of"


def sample_fixed(
    url: str, prompt: str, *, max_tokens: int = 12, model: str | None = None, timeout: float = 60
) -> tuple[Any, torch.Tensor]:
    """Sample `max_tokens` after `prompt` from the replica at `url` (temperature 1, seed 7) →
    (a one-row DataProto of prompt + response, the served logprobs [R] float32)."""
    from verl import DataProto

    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "temperature": 1.0,
        "seed": 7,
        "return_token_ids": True,
        **({"model": model} if model else {}),
    }
    answer = httpx.post(url + "/completions", json=body, timeout=timeout)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    prompt_ids, response = choice["prompt_token_ids"], choice["token_ids"]
    served = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
    ids = torch.tensor([prompt_ids + response])
    data = DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.shape[1]).unsqueeze(0),
            "prompts": torch.tensor([prompt_ids]),
            "responses": torch.tensor([response]),
            "response_mask": torch.ones(1, len(response), dtype=torch.long),
        }
    )
    return data, served


def fixed_sequence(engine: Any, max_tokens: int = 12) -> tuple[Any, torch.Tensor]:
    """A sampled continuation of FIXED_PROMPT from the engine's replica: (DataProto, served logprobs [R])."""
    return sample_fixed(
        engine.endpoints()[0], FIXED_PROMPT, max_tokens=max_tokens, model=engine.model_name, timeout=120
    )


def served_logprobs_of(engine: Any, data: Any) -> torch.Tensor:
    """What the replica serves for `data`'s prompt + response (prompt logprobs of the whole sequence)."""
    ids = data.batch["input_ids"][0].tolist()
    n_resp = data.batch["responses"].shape[1]
    body = {"model": engine.model_name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    answer = httpx.post(engine.endpoints()[0] + "/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    per_token = answer.json()["choices"][0]["prompt_logprobs"]
    # prompt_logprobs[i] maps token ids to {"logprob": …}; the sequence's own token is always included
    return torch.tensor([per_token[i][str(ids[i])]["logprob"] for i in range(len(ids) - n_resp, len(ids))])


def give_rollouts_distinct_rewards(data: Any, offset: int = 0) -> None:
    """Reward of rollout k = (k + offset)/n on the last model token of each of its rows (in place):
    the untrained model earns 0 everywhere, which gives no gradient."""
    scores, response_mask = data.batch["token_level_scores"], data.batch["response_mask"]
    rollouts = list(dict.fromkeys(data.non_tensor_batch["rollout_id_list"]))
    last = response_mask.shape[1] - 1 - response_mask.flip(-1).int().argmax(-1)  # last model token
    scores.zero_()
    for row, rid in enumerate(data.non_tensor_batch["rollout_id_list"]):
        scores[row, last[row]] = (rollouts.index(rid) + offset) / len(rollouts)


def chat_call(base_url: str, content: str, seed: int, temperature: float, max_tokens: int) -> dict:
    """One chat call with logprobs and token ids → {"prompt", "response", "logprobs"}."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "seed": seed,
        "temperature": temperature,
        "logprobs": True,
        "return_token_ids": True,
    }
    resp = httpx.post(base_url + "/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    return {
        "prompt": data["prompt_token_ids"],
        "response": choice["token_ids"],
        "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
    }


def sample_calls(engine: Any, temperature: float, n: int = 4) -> list[dict]:
    """`n` concurrent chat calls of different lengths to the engine's first endpoint (the server batches them)."""
    url = engine.endpoints()[0]
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(chat_call, url, "lookup key " * (1 + 3 * i), i, temperature, 6 + 5 * i) for i in range(n)
        ]
        return [f.result() for f in futures]


def calls_to_batch(calls: list[dict], pad_id: int, temperature: float = 1.0) -> Any:
    """Left-padded prompts + right-padded responses, verl layout; `rollout_log_probs` from the server;
    the sampling temperature in `meta_info`, as `run_update` puts it there."""
    from verl import DataProto

    p_len = max(len(c["prompt"]) for c in calls)
    r_len = max(len(c["response"]) for c in calls)
    n = len(calls)
    prompts = torch.full((n, p_len), pad_id)
    responses = torch.full((n, r_len), pad_id)
    p_mask, r_mask = torch.zeros(n, p_len, dtype=torch.long), torch.zeros(n, r_len, dtype=torch.long)
    served = torch.zeros(n, r_len)
    for i, c in enumerate(calls):
        lp, lr = len(c["prompt"]), len(c["response"])
        prompts[i, p_len - lp :], p_mask[i, p_len - lp :] = torch.tensor(c["prompt"]), 1
        responses[i, :lr], r_mask[i, :lr] = torch.tensor(c["response"]), 1
        served[i, :lr] = torch.tensor(c["logprobs"])
    mask = torch.cat([p_mask, r_mask], dim=1)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": r_mask,
            "rollout_log_probs": served,
        },
        meta_info={"temperature": temperature},
    )
