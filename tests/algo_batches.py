"""Hand-built DataProto batches for the algorithm tests (advantage, loss, selection, update).

`make_batch(masks, rewards, rollout_ids, data_ids)`: one row per mask; the reward sits on
the row's last mask token. AGL v1's fixture (its tests/verl/test_rollout_level_advantage.py): `upstream_batch()` = rows (r1, r1, r2).
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto


def make_batch(masks, rewards, rollout_ids, data_ids, *, is_drop=None, uid=True) -> DataProto:
    """Rows with the given response masks; the reward sits on each row's last mask token."""
    mask = torch.tensor(masks, dtype=torch.float32)
    scores = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        on = torch.nonzero(mask[i]).flatten()
        scores[i, int(on[-1]) if len(on) else 0] = r
    tensors = {"response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores.clone()}
    if is_drop is not None:
        tensors["is_drop_mask"] = torch.tensor(is_drop, dtype=torch.bool)
    non_tensors = {
        "rollout_id_list": np.array(rollout_ids, dtype=object),
        "data_id_list": np.array(data_ids, dtype=object),
    }
    if uid:
        non_tensors["uid"] = np.array(data_ids, dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def one_row_rollouts(rewards_by_group: dict[str, list[float]], width: int = 3) -> DataProto:
    """Trajectory-level batch: one row per rollout, rollouts named g{group}-r{k}."""
    rids, dids, rewards = [], [], []
    for g, rs in rewards_by_group.items():
        for k, r in enumerate(rs):
            rids.append(f"{g}-r{k}")
            dids.append(g)
            rewards.append(r)
    return make_batch([[1] * width] * len(rids), rewards, rids, dids)


def rows_of(data: DataProto, rollout_id: str) -> int:
    return int((data.non_tensor_batch["rollout_id_list"] == rollout_id).sum())


# AGL v1's test_rollout_level_advantage.py fixture: rows (r1, r1, r2), one group "data-1".
def upstream_batch(rewards=(1.0, 1.0, 3.0)) -> DataProto:
    return make_batch([[1, 1, 0], [1, 0, 0], [1, 1, 1]], list(rewards), ["r1", "r1", "r2"], ["data-1"] * 3)


def three_groups() -> DataProto:
    # z: a zero-advantage group (all 1.0); a, b: mixed rewards. 12 one-row rollouts.
    return one_row_rollouts({"z": [1, 1, 1, 1], "a": [1, 0, 0, 1], "b": [0, 1, 1, 1]})


def multi_row_batch() -> DataProto:
    # transition level: rollouts with 3, 2, 2, 1, 3, 1 rows in two mixed groups
    sizes = {"a0": 3, "a1": 2, "a2": 2, "b0": 1, "b1": 3, "b2": 1}
    reward = {"a0": 1, "a1": 0, "a2": 1, "b0": 0, "b1": 1, "b2": 1}
    rids = [rid for rid, k in sizes.items() for _ in range(k)]
    return make_batch([[1, 1]] * len(rids), [reward[r] for r in rids], rids, [r[0] for r in rids])
