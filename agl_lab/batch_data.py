"""agl_lab's batch container: the part of verl's `DataProto` the pure core uses, without verl.

`import verl` imports Ray (verl/__init__ → verl/protocol.py), several seconds on a laptop. The pure
core (`agl_lab.algorithms`, `agl_lab.batch`'s metrics and views, `agl_lab.replay`) reads and writes a
batch only through this subset of DataProto's interface, so a `BatchData` serves it without verl;
`to_dataproto()` converts at the verl engine boundary (`agl_lab.batch.build_batch(...,
container="verl")`, the Trainer's default).

    BatchData
      .batch            TensorMap: str → torch.Tensor, every tensor [N, ...] (dim 0 = rows)
      .non_tensor_batch dict: str → np.ndarray [N] (dtype=object for ids)
      .meta_info        dict (temperature, ...)
      len(b) = N;  b.select_idxs(idx) → BatchData of rows idx (ints or a bool mask [N])
      BatchData.from_dict(tensors, non_tensors, meta_info);  BatchData.concat([b1, b2, ...])
      b.to_dataproto() → verl.DataProto;  BatchData.from_dataproto(dp)

Pure: torch and numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


class TensorMap(dict):
    """The `.batch` of a `BatchData`: a dict of tensors whose first dimension is the batch's rows.

    Setting a tensor with another first dimension raises (as TensorDict does), naming the key."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], rows: int):
        super().__init__()
        self.rows = int(rows)
        for key, value in tensors.items():
            self[key] = value

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0 or int(value.shape[0]) != self.rows:
            raise ValueError(
                f"batch[{key!r}] has shape {list(value.shape)}: its first dimension must be the batch's "
                f"{self.rows} rows"
            )
        super().__setitem__(key, value)


class BatchData:
    """Tensors [N, ...], non-tensors [N] and meta_info: a verl-free stand-in for `DataProto`."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        *,
        rows: int | None = None,
    ):
        tensors, non_tensors = dict(tensors or {}), dict(non_tensors or {})
        sizes = {int(v.shape[0]) for v in tensors.values() if v.dim()} | {len(v) for v in non_tensors.values()}
        if rows is None:
            if len(sizes) > 1:
                raise ValueError(
                    f"BatchData: the tensors and non-tensors disagree on the number of rows: {sorted(sizes)}"
                )
            rows = sizes.pop() if sizes else 0
        self.batch = TensorMap(tensors, rows)
        self.non_tensor_batch: dict[str, np.ndarray] = {}
        for key, value in non_tensors.items():
            value = np.asarray(value, dtype=object) if not isinstance(value, np.ndarray) else value
            if len(value) != rows:
                raise ValueError(f"non_tensor_batch[{key!r}] has {len(value)} entries: the batch has {rows} rows")
            self.non_tensor_batch[key] = value
        self.meta_info: dict[str, Any] = dict(meta_info or {})

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        non_tensors: Mapping[str, np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> BatchData:
        """As `DataProto.from_dict`: tensors [N, ...] and non-tensors [N] of one N."""
        return cls(tensors, non_tensors, meta_info)

    def __len__(self) -> int:
        return self.batch.rows

    def __repr__(self) -> str:
        keys = ", ".join(f"{k}{list(v.shape)}" for k, v in self.batch.items())
        return f"BatchData(rows={len(self)}, batch=[{keys}], non_tensor_batch={list(self.non_tensor_batch)})"

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> BatchData:
        """The rows `idxs` (ints, in that order, or a bool mask [N]) as a new BatchData (copies);
        meta_info is copied shallowly."""
        if isinstance(idxs, torch.Tensor):
            idx_np = idxs.detach().cpu().numpy()
        else:
            idx_np = np.asarray(idxs)
        if idx_np.dtype == bool:
            if len(idx_np) != len(self):
                raise ValueError(f"select_idxs: a mask of {len(idx_np)} entries for a batch of {len(self)} rows")
            idx_np = np.flatnonzero(idx_np)
        idx_np = idx_np.astype(np.int64, copy=False).reshape(-1)
        idx_t = torch.from_numpy(idx_np)
        return BatchData(
            {k: v[idx_t] for k, v in self.batch.items()},
            {k: v[idx_np] for k, v in self.non_tensor_batch.items()},
            self.meta_info,
            rows=len(idx_np),
        )

    @classmethod
    def concat(cls, parts: Sequence[BatchData]) -> BatchData:
        """Rows of `parts` one after another (same keys in every part); meta_info of the first."""
        if not parts:
            raise ValueError("BatchData.concat needs at least one batch")
        keys, nt_keys = set(parts[0].batch), set(parts[0].non_tensor_batch)
        for p in parts[1:]:
            if set(p.batch) != keys or set(p.non_tensor_batch) != nt_keys:
                raise ValueError("BatchData.concat: every batch must have the same tensor and non-tensor keys")
        return cls(
            {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch},
            {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch},
            parts[0].meta_info,
            rows=sum(len(p) for p in parts),
        )

    def to_dataproto(self) -> Any:
        """The same rows as a verl `DataProto` (imports verl, hence Ray): the verl engine boundary."""
        from verl import DataProto

        return DataProto.from_dict(dict(self.batch), dict(self.non_tensor_batch), meta_info=dict(self.meta_info))

    @classmethod
    def from_dataproto(cls, data: Any) -> BatchData:
        """A DataProto's tensors, non-tensors and meta_info as a BatchData (shares the tensors)."""
        tensors = {k: data.batch[k] for k in data.batch.keys()} if data.batch is not None else {}
        return cls(tensors, dict(data.non_tensor_batch), dict(data.meta_info), rows=len(data))
