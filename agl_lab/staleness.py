"""How stale each trained token is, and how far its sampling logprob is from the trainer's.

With `agl_lab.rollout.max_staleness > 0` a batch mixes tokens sampled by older weights. The
batch builder writes `rollout_versions` [N, R] int64 beside `response_mask`: the policy
version whose server sampled each token (the gateway's `model_version` of its call; -1 on
observations, padding and calls without a version). The update trains policy version `v`
(the weights `old_log_probs` come from), so a token's age is `v − rollout_versions`.

| metric                            | meaning                                                  |
|-----------------------------------|----------------------------------------------------------|
| staleness/trained_version         | v, the version the update starts from                    |
| staleness/token_age_mean, _max    | over loss tokens with a known version                    |
| staleness/tokens_age_{k}          | loss tokens of age k (sum = trained tokens with a version)|
| staleness/tokens_unknown_version  | loss tokens whose call carried no version                |
| staleness/lp_diff_mean_age_{k}, _max_age_{k} | |old_log_probs − rollout_log_probs| by age   |
| staleness/lp_diff_mean_turn_{t}, _max_turn_{t} | the same by turn (the call's index in its rollout; turns past 7 as `turn_8plus`) |

The Δlogp keys are not logged under `bypass_mode`: there the old logprobs are the sampling ones
and the gap would be 0 by construction.

The Δlogp numbers are the same quantity as `training/rollout_logprobs_diff_*`
(`engines.base.logprob_gap`), split by age, not a second count. The IS weights themselves
stay verl's (`rollout_is_weights`; its `rollout_corr/*` metrics): `staleness_frame` only shows
them per token beside the age.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

STALENESS_COLUMNS = [
    "batch_row",
    "rollout_id",
    "turn",
    "position",
    "version",
    "age",
    "rollout_logprob",
    "old_logprob",
    "lp_diff",
    "is_weight",
    "is_clipped",
]


def _np(b: Any, key: str) -> np.ndarray | None:
    return b[key].float().numpy() if key in b.keys() else None


def token_ages(data: Any, version: int) -> np.ndarray:
    """[N, R] int64: `version − rollout_versions` on loss tokens with a known version, else -1."""
    b = data.batch
    versions = b["rollout_versions"].numpy()
    loss = b["response_mask"].bool().numpy() & (versions >= 0)
    return np.where(loss, int(version) - versions, -1)


def staleness_metrics(data: Any, version: int | None, bypass: bool = False) -> dict[str, float]:
    """The `staleness/*` metrics of a prepared batch trained from policy `version` (module
    table); `{}` without `rollout_versions` or a version.

    `bypass` (`algorithm.rollout_correction.bypass_mode`): the old logprobs *are* the sampling
    ones, so |Δlogp| is 0 by construction, not a measurement, and the `lp_diff_*` keys are left
    out — a stale token's gap is seen where version v is recomputed (bypass off)."""
    b = data.batch
    if version is None or "rollout_versions" not in b.keys():
        return {}
    ages = token_ages(data, version)
    loss = b["response_mask"].bool().numpy()
    known = ages >= 0
    metrics: dict[str, float] = {
        "staleness/trained_version": int(version),
        "staleness/tokens_unknown_version": int((loss & ~known).sum()),
    }
    if not known.any():
        return metrics
    metrics["staleness/token_age_mean"] = float(ages[known].mean())
    metrics["staleness/token_age_max"] = int(ages[known].max())
    old, rollout = _np(b, "old_log_probs"), _np(b, "rollout_log_probs")
    diff = np.abs(old - rollout) if old is not None and rollout is not None and not bypass else None
    for age in range(int(ages[known].max()) + 1):
        at = ages == age
        metrics[f"staleness/tokens_age_{age}"] = int(at.sum())
        if diff is not None and at.any():
            metrics[f"staleness/lp_diff_mean_age_{age}"] = float(diff[at].mean())
            metrics[f"staleness/lp_diff_max_age_{age}"] = float(diff[at].max())
    if diff is not None and "turn_index_list" in data.non_tensor_batch:
        metrics.update(_lp_diff_by_turn(data, diff, loss))
    return metrics


TURN_KEYS = 8  # turns 0..7 get their own keys, later ones share `turn_8plus`


def _lp_diff_by_turn(data: Any, diff: np.ndarray, loss: np.ndarray) -> dict[str, float]:
    """|Δlogp| [N, R] over the loss tokens of each turn (`token_turns`)."""
    turns = token_turns(data)
    names = np.where(turns < TURN_KEYS, turns.astype(str), f"{TURN_KEYS}plus")
    metrics: dict[str, float] = {}
    for name in sorted(set(names[loss]), key=lambda n: (len(n), n)):
        at = loss & (names == name)
        metrics[f"staleness/lp_diff_mean_turn_{name}"] = float(diff[at].mean())
        metrics[f"staleness/lp_diff_max_turn_{name}"] = float(diff[at].max())
    return metrics


def _turns(mask_row: np.ndarray, first_call: int) -> np.ndarray:
    """Turn (call index) of each response position: `first_call` + the index of the run of
    model tokens it lies in (observations between two calls split the runs)."""
    starts = np.diff(np.concatenate([[0], mask_row])) > 0
    return first_call + np.cumsum(starts) - 1


def token_turns(data: Any) -> np.ndarray:
    """[N, R] int64: the turn of each response position of the prepared batch (`_turns` of each row,
    from its `turn_index_list`); meaningful on loss tokens."""
    mask = data.batch["response_mask"].bool().numpy().astype(int)
    first = data.non_tensor_batch["turn_index_list"]
    rows = [_turns(mask[i], int(first[i])) for i in range(mask.shape[0])]
    return np.stack(rows) if rows else np.zeros(mask.shape, dtype=np.int64)


def staleness_frame(data: Any, version: int) -> pd.DataFrame:
    """One line per loss token of the prepared batch `data` (columns `STALENESS_COLUMNS`):
    its row, rollout, turn, position in the response, sampling version and age, both logprobs,
    |Δlogp|, and where verl wrote IS weights the weight and whether it was truncated
    (`is_clipped`: the weight is below exp(old − rollout)); NaN/None where the batch lacks them."""
    b, nt = data.batch, data.non_tensor_batch
    mask = b["response_mask"].bool().numpy()
    rows, cols = np.nonzero(mask)
    versions = b["rollout_versions"].numpy()[rows, cols] if "rollout_versions" in b.keys() else np.full(len(rows), -1)
    turns = token_turns(data)[rows, cols]

    def col(key: str) -> np.ndarray:
        values = _np(b, key)
        return values[rows, cols] if values is not None else np.full(len(rows), np.nan)

    old, rollout, weight = col("old_log_probs"), col("rollout_log_probs"), col("rollout_is_weights")
    frame = pd.DataFrame(
        {
            "batch_row": rows,
            "rollout_id": nt["rollout_id_list"][rows].astype(str),
            "turn": turns,
            "position": cols,
            "version": versions,
            "age": np.where(versions >= 0, int(version) - versions, -1),
            "rollout_logprob": rollout,
            "old_logprob": old,
            "lp_diff": np.abs(old - rollout),
            "is_weight": weight,
            "is_clipped": weight < np.exp(old - rollout) * (1 - 1e-6),
        },
        columns=STALENESS_COLUMNS,
    )
    frame.attrs["trained_version"] = int(version)
    return frame
