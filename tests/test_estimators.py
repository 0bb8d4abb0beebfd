"""agl_lab's own GRPO / RLOO estimators and data metrics give verl 0.9.1's numbers, to the bit.

`agl_lab.algorithms.estimators` computes them without importing verl (which imports Ray), so
replay starts in seconds; these tests hold them to verl's own functions, called here in the
test process, on random groups (sizes 1..9, ties, float32 and float64, both std settings), on
the batches the builder emits, and through the whole update pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import compute_data_metrics as verl_data_metrics
from verl.trainer.ppo.ray_trainer import compute_advantage as verl_compute_advantage

from agl_lab.algorithms import estimators
from agl_lab.algorithms.pipeline import prepare_update_batch
from agl_lab.batch_data import BatchData
from tests.algo_batches import make_batch


def _random_groups(seed: int, dtype: torch.dtype, width: int = 5, min_size: int = 1):
    """Rewards [N, width] with the reward on each row's last mask token, masks [N, width], uids [N]."""
    rng = np.random.default_rng(seed)
    uids, rewards = [], []
    for g, size in enumerate(rng.integers(min_size, 10, size=12)):
        choices = [0.0, 1.0, 0.1, 1 / 3, 0.7, 1e-3] if g % 2 else rng.normal(size=3).tolist()
        uids += [f"g{g}"] * int(size)
        rewards += rng.choice(choices, size=int(size)).tolist()
    order = rng.permutation(len(uids))  # groups interleaved, as a real batch's rows can be
    uids = np.array(uids, dtype=object)[order]
    lengths = rng.integers(1, width + 1, size=len(uids))
    mask = (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).to(dtype)
    scores = torch.zeros(len(uids), width, dtype=dtype)
    scores[torch.arange(len(uids)), torch.as_tensor(lengths) - 1] = torch.tensor(rewards, dtype=dtype)[order]
    return scores, mask, uids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_grpo_is_verls_to_the_bit(seed, norm, dtype):
    scores, mask, uids = _random_groups(seed, dtype)
    ours, _ = estimators.grpo_advantage(scores, mask, uids, norm_adv_by_std_in_grpo=norm)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(scores.clone(), mask, uids, norm_adv_by_std_in_grpo=norm)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_rloo_is_verls_to_the_bit(seed, dtype):
    scores, mask, uids = _random_groups(seed, dtype)
    ours, _ = estimators.rloo_advantage(scores, mask, uids)
    theirs, _ = core_algos.compute_rloo_outcome_advantage(scores.clone(), mask, uids)
    assert torch.equal(ours, theirs)


def _batch(seed: int, container: str):
    scores, mask, uids = _random_groups(seed, torch.float32, min_size=2)  # pass@k needs 2 per group
    n = len(uids)
    tensors = {"response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores.clone()}
    non_tensors = {"uid": uids, "rollout_id_list": np.array([f"r{i}" for i in range(n)], dtype=object)}
    data = BatchData.from_dict(tensors, non_tensors)
    return data if container == "agl" else data.to_dataproto()


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("container", ["agl", "verl"])
def test_compute_advantage_matches_verls_for_every_outcome_estimator(name, container):
    """GRPO and RLOO computed here, the rest from verl's registry: the same as verl's compute_advantage."""
    from verl.trainer.config import AlgoConfig

    config = AlgoConfig()
    ours = estimators.compute_advantage(_batch(1, container), name, config=config)
    theirs = verl_compute_advantage(_batch(1, "verl"), name, config=config)
    for key in ("advantages", "returns"):
        assert torch.equal(ours.batch[key], theirs.batch[key]), key


def test_compute_advantage_needs_a_response_mask():
    data = BatchData.from_dict({"token_level_rewards": torch.zeros(2, 3)}, {"uid": np.array(["a", "a"], dtype=object)})
    with pytest.raises(ValueError, match="response_mask"):
        estimators.compute_advantage(data, "grpo")


def _built_batch(container: str, *, aborted: bool = False):
    """A builder-shaped batch: prompts [N, 4], responses [N, 6]; one row with no response token
    (aborted) when asked; advantages from GRPO."""
    rng = np.random.default_rng(0)
    n, p, r = 10, 4, 6
    prompt_len = rng.integers(1, p + 1, size=n)
    resp_len = rng.integers(1, r + 1, size=n)
    if aborted:
        resp_len[3] = 0
    resp_len[5] = r  # one clipped response
    prompt_mask = torch.as_tensor(np.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()
    resp_mask = torch.as_tensor(np.arange(r)[None, :] < resp_len[:, None]).long()
    scores = torch.zeros(n, r)
    rewards = torch.tensor(rng.choice([0.0, 0.5, 1.0], size=n), dtype=torch.float32)
    scores[torch.arange(n), torch.as_tensor(np.maximum(resp_len, 1)) - 1] = rewards
    tensors = {
        "prompts": torch.ones(n, p, dtype=torch.long),
        "responses": torch.ones(n, r, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1),
        "response_mask": resp_mask.float(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
    }
    uids = np.array([f"g{i // 4}" for i in range(n)], dtype=object)
    data = BatchData.from_dict(tensors, {"uid": uids, "__num_turns__": rng.integers(1, 4, size=n)})
    data = estimators.compute_advantage(data, "grpo")
    return data if container == "agl" else data.to_dataproto()


@pytest.mark.parametrize("aborted", [False, True])
@pytest.mark.parametrize("container", ["agl", "verl"])
def test_data_metrics_are_verls_to_the_bit(container, aborted):
    ours = estimators.compute_data_metrics(_built_batch(container, aborted=aborted))
    theirs = verl_data_metrics(_built_batch("verl", aborted=aborted), use_critic=False)
    assert ours.keys() == theirs.keys()
    assert {k: float(v) for k, v in ours.items()} == {k: float(v) for k, v in theirs.items()}
    assert ours["response/aborted_ratio"] == pytest.approx(0.1 if aborted else 0.0)


@pytest.mark.parametrize("grpo_float32", [False, True])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_the_pipeline_on_agl_batches_gives_verls_numbers(estimator, grpo_float32):
    """prepare_update_batch with agl_lab's estimator on a BatchData vs verl's compute_advantage
    on a DataProto: the same metrics, advantages and drops."""
    masks = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]]
    rewards = [0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 0.5]
    rids = ["a0", "a0", "a1", "a2", "b0", "b0", "b1", "b2"]
    dids = ["a", "a", "a", "a", "b", "b", "b", "b"]
    verl_batch = make_batch(masks, rewards, rids, dids)
    agl_batch = BatchData.from_dataproto(make_batch(masks, rewards, rids, dids))
    args = dict(mini_batch_rows=4, adv_estimator=estimator, grpo_float32=grpo_float32)
    ours, ours_drops, ours_metrics = prepare_update_batch(agl_batch, **args)
    theirs, their_drops, their_metrics = prepare_update_batch(
        verl_batch, compute_advantage_fn=verl_compute_advantage, **args
    )
    assert isinstance(ours, BatchData)
    assert ours_metrics == their_metrics and ours_drops == their_drops
    for key in ("advantages", "rollout_advantages"):
        if key in theirs.batch.keys():
            assert torch.equal(ours.batch[key], theirs.batch[key]), key
