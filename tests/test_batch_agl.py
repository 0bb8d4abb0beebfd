"""Differential test: `agl_lab.batch.build_batch` against Agent Lightning 1.0.2's `RolloutAdapter`.

Runs only where `agentlightning` is importable (a benchmark extra: `pip install --no-deps
--ignore-requires-python agentlightning==1.0.2 httpx-retries structlog`). Random rollouts with
merge breaks, observations, empty responses, over-long prompts and responses; every tensor and
non-tensor both emit must be bit-identical (AGL's bfloat16 scores compared after casting ours).
"""

from __future__ import annotations

import random

import pytest
import torch

from agl_lab.batch import build_batch
from agl_lab.records import CompletedRollout, Triplet

adapter_mod = pytest.importorskip("agentlightning.verl.rollout_adapter")
manager_mod = pytest.importorskip("agentlightning.verl.agl_rollout_manager")


def random_rollouts(seed: int, n: int = 24) -> list[CompletedRollout]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        context = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 12))]
        triplets = []
        for call in range(rng.randrange(1, 6)):
            if call and rng.random() < 0.25:  # a break: the prompt rewrites history
                context = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 12))]
            elif call:
                context = context + [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 5))]
            response = [rng.randrange(1, 1000) for _ in range(rng.randrange(0 if call else 1, 7))]
            logprobs = [-rng.random() for _ in response]
            triplets.append(Triplet(list(context), response, logprobs))
            context = context + response
        out.append(
            CompletedRollout(
                f"r{k}", f"d{k // 4}", 0, k // 4, triplets, None if k % 5 == 0 else float(k % 3), copy_idx=k % 4
            )
        )
    return out


def to_agl(rollouts: list[CompletedRollout]) -> list:
    return [
        manager_mod.CompletedRollout(
            rollout_id=r.rollout_id,
            data_id=r.data_id,
            step=r.step,
            sample_idx_in_step=r.sample_idx,
            enqueue_time=0.0,
            final_reward=r.final_reward,
            triplets=[
                manager_mod.Triplet(
                    prompt={"token_ids": list(t.prompt_ids)},
                    response={"token_ids": list(t.response_ids), "log_probs": list(t.logprobs)},
                )
                for t in r.triplets
            ],
        )
        for r in rollouts
    ]


@pytest.mark.parametrize("level", ["transition", "trajectory"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_tensors_as_agent_lightning(level, seed):
    rollouts = random_rollouts(seed)
    p, r = 10, 14  # small limits: some prompts are cut (is_drop), some responses truncated
    ours = build_batch(
        rollouts, level, max_prompt_length=p, max_response_length=r, pad_token_id=0, reward_fillna_value=-1.0
    ).data
    adapter = adapter_mod.RolloutAdapter(
        max_prompt_length=p,
        max_response_length=r,
        device=torch.device("cpu"),
        pad_token_id=0,
        reward_fillna_value=-1.0,
        trace_aggregator_level=level,
    )
    agl, metrics = adapter.get_train_data_batch(to_agl(rollouts))
    assert set(agl.batch.keys()) <= set(ours.batch.keys())
    for key in agl.batch.keys():
        a, o = agl.batch[key], ours.batch[key]
        if key == "token_level_scores":
            o = o.to(a.dtype)  # deviation: ours stay float32
        assert a.dtype == o.dtype and a.shape == o.shape, key
        assert torch.equal(a, o), key
    for key, values in agl.non_tensor_batch.items():
        assert list(values) == list(ours.non_tensor_batch[key]), key
    assert metrics["training/n_sample"] == len(ours)
