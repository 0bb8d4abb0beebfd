"""What the engine-equivalence tests ask of a serving replica and of a built batch.

data, served = sample_fixed(url, prompt)       # one sampled continuation + its served logprobs [R]
give_rollouts_distinct_rewards(batch.data)     # rewards that give every group a gradient
"""

from __future__ import annotations

from typing import Any

import httpx
import torch


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


def give_rollouts_distinct_rewards(data: Any, offset: int = 0) -> None:
    """Reward of rollout k = (k + offset)/n on the last model token of each of its rows (in place):
    the untrained model earns 0 everywhere, which gives no gradient."""
    scores, response_mask = data.batch["token_level_scores"], data.batch["response_mask"]
    rollouts = list(dict.fromkeys(data.non_tensor_batch["rollout_id_list"]))
    last = response_mask.shape[1] - 1 - response_mask.flip(-1).int().argmax(-1)  # last model token
    scores.zero_()
    for row, rid in enumerate(data.non_tensor_batch["rollout_id_list"]):
        scores[row, last[row]] = (rollouts.index(rid) + offset) / len(rollouts)
