"""agl_lab's verl-free batch container: DataProto's subset that the pure core uses, and the
builder's two containers holding the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from agl_lab import batch
from agl_lab.batch_data import BatchData
from tests.hand_built import SpaceTokenizer, mixed_rollouts


def _small() -> BatchData:
    return BatchData.from_dict(
        {"x": torch.arange(8).reshape(4, 2), "m": torch.tensor([True, False, True, True])},
        {"rid": np.array(["a", "b", "c", "d"], dtype=object)},
        {"temperature": 0.7},
    )


@pytest.mark.parametrize("idxs", [[2, 0], np.array([2, 0]), torch.tensor([2, 0])], ids=["list", "numpy", "torch"])
def test_select_idxs_takes_rows_in_order_and_copies(idxs):
    data = _small()
    sub = data.select_idxs(idxs)
    assert len(sub) == 2 and sub.batch["x"].tolist() == [[4, 5], [0, 1]]
    assert sub.non_tensor_batch["rid"].tolist() == ["c", "a"]
    sub.batch["x"][0, 0] = 99
    sub.meta_info["temperature"] = 1.0
    assert data.batch["x"][2, 0] == 4 and data.meta_info["temperature"] == 0.7  # the caller's batch is untouched


def test_a_mask_selects_rows_in_their_order():
    sub = _small().select_idxs(np.array([True, False, True, False]))
    assert sub.batch["x"].tolist() == [[0, 1], [4, 5]] and sub.non_tensor_batch["rid"].tolist() == ["a", "c"]


def test_an_empty_selection_keeps_the_keys():
    sub = _small().select_idxs([])
    assert len(sub) == 0 and set(sub.batch) == {"x", "m"} and sub.batch["x"].shape == (0, 2)


def test_bad_shapes_name_the_key():
    data = _small()
    with pytest.raises(ValueError, match=r"batch\['y'\].*4 rows"):
        data.batch["y"] = torch.zeros(3, 2)
    with pytest.raises(TypeError, match=r"batch\['y'\] must be a torch.Tensor"):
        data.batch["y"] = np.zeros((4, 2))
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        BatchData.from_dict({"x": torch.zeros(3)}, {"rid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(ValueError, match="a mask of 2 entries for a batch of 4 rows"):
        data.select_idxs(np.array([True, False]))


def test_concat_and_dataproto_round_trip():
    data = _small()
    both = BatchData.concat([data, data.select_idxs([3])])
    assert len(both) == 5 and both.non_tensor_batch["rid"].tolist() == ["a", "b", "c", "d", "d"]
    proto = both.to_dataproto()
    assert isinstance(proto, DataProto) and len(proto) == 5 and proto.meta_info == {"temperature": 0.7}
    back = BatchData.from_dataproto(proto)
    assert all(torch.equal(back.batch[k], both.batch[k]) for k in both.batch)
    assert back.non_tensor_batch["rid"].tolist() == both.non_tensor_batch["rid"].tolist()
    with pytest.raises(ValueError, match="same tensor and non-tensor keys"):
        BatchData.concat([data, BatchData.from_dict({"x": torch.zeros(1, 2)})])


@pytest.mark.parametrize("level", ["transition", "trajectory"])
def test_the_builder_emits_the_same_batch_in_either_container(level):
    args = dict(max_prompt_length=6, max_response_length=4, tokenizer=SpaceTokenizer())
    verl_b = batch.build_batch(mixed_rollouts(), level, **args)
    agl_b = batch.build_batch(mixed_rollouts(), level, container="agl", **args)
    assert isinstance(verl_b.data, DataProto) and isinstance(agl_b.data, BatchData)
    assert set(agl_b.data.batch) == set(verl_b.data.batch.keys())
    for key in agl_b.data.batch:
        assert agl_b.data.batch[key].dtype == verl_b.data.batch[key].dtype
        assert torch.equal(agl_b.data.batch[key], verl_b.data.batch[key]), key
    for key, values in verl_b.data.non_tensor_batch.items():
        assert agl_b.data.non_tensor_batch[key].tolist() == values.tolist(), key
    assert agl_b.metrics == verl_b.metrics
    with pytest.raises(ValueError, match="container='numpy' is not one of"):
        batch.build_batch(mixed_rollouts(), level, container="numpy", **args)
