"""One training row, token by token: what the sampler, the old policy and the updated policy
said about each response token, and what the loss did with it.

    u = trainer.update()
    u.tokens(3)                    # row 3 of the batch (b.rows.batch_index == 3, b.data[3])
    u.tokens(b.rows.iloc[5])       # a line of b.rows
    b.tokens(3, trainer.engine)    # before an update: the current policy only

One line per response token of the row (padding cut off):

| column            | meaning                                                                            |
|-------------------|------------------------------------------------------------------------------------|
| position          | index in the row's response, 0 = first response token                              |
| token_id, token   | the id and its decoded text (special tokens kept)                                  |
| loss_mask         | 1 on model-sampled tokens, 0 on observations (tool results, user turns): no loss   |
| rollout_logprob   | log π_sampler(token): the logprob the engine returned when it sampled (NaN off the mask: not sampled) |
| old_logprob       | log π_old: recomputed by the trainer before the update (the PPO ratio's denominator); off the mask the model's logprob of a token it did not write, outside the loss |
| new_logprob       | log π_θ: the engine's weights *when `tokens` is called* — right after `update()`, the updated policy (version `u.policy_version`) |
| ratio             | exp(new − old), the PPO ratio the next epoch would see; 1 on-policy                 |
| entropy           | entropy of π_θ's next-token distribution at that position, at the sampling temperature |
| advantage         | the row's raw advantage (`rollout_advantages`; constant over its loss tokens; the rows of one rollout differ under `turn_credit: return`) |
| loss_advantage    | what the loss multiplies: advantage / (loss tokens of the rollout × D), 0 off the mask |
| version           | the policy version that sampled it (`rollout_versions`; -1 off the loss mask or unknown) |
| is_weight         | its rollout-correction IS weight (`rollout_is_weights`, NaN without `rollout_is`)     |
| is_clipped        | the IS weight is below exp(old − rollout): truncated at the threshold                 |

`new_logprob` and `entropy` are computed on request with one forward of the engine's model
(`Engine.compute_log_probs_and_entropy`; the local engine has it). An engine without it (verl's,
a replay's: `replay_step(...).update.tokens(i)`) leaves them and `ratio` NaN, its reason in
`attrs["note"]`; every other column needs no engine. If the engine
trained again after this update, they are of that later policy: `attrs["policy_version"]`
says which, and a warning says so. Everything else comes from the batch the update trained.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd

TOKEN_COLUMNS = [
    "position",
    "token_id",
    "token",
    "loss_mask",
    "rollout_logprob",
    "old_logprob",
    "new_logprob",
    "ratio",
    "entropy",
    "advantage",
    "loss_advantage",
    "version",
    "is_weight",
    "is_clipped",
]


def find_row(data: Any, rollout_id: str, first_call: int) -> int | None:
    """Index in `data` (a DataProto) of the row of `rollout_id` that starts at call `first_call`."""
    ids, calls = data.non_tensor_batch["rollout_id_list"], data.non_tensor_batch["turn_index_list"]
    hits = np.flatnonzero((ids == rollout_id) & (calls.astype(int) == int(first_call)))
    return int(hits[0]) if len(hits) else None


def row_key(row: Any, built_data: Any) -> tuple[str, int]:
    """(rollout_id, first call) of `row`: a `b.rows` line (Series) or an int index of the built batch."""
    if isinstance(row, pd.Series):
        if int(row["batch_index"]) < 0:
            raise ValueError(
                f"row of rollout {row['rollout_id']} (calls {row['first_call']}–{row['last_call']}) "
                "is not in the batch (batch_index -1: skipped at build time, see b.rows)"
            )
        return str(row["rollout_id"]), int(row["first_call"])
    i = int(row)
    if not 0 <= i < len(built_data):
        raise IndexError(f"row {i}: the batch has rows 0–{len(built_data) - 1} (b.rows.batch_index)")
    nt = built_data.non_tensor_batch
    return str(nt["rollout_id_list"][i]), int(nt["turn_index_list"][i])


def tokens_frame(
    data: Any, i: int, engine: Any, tokenizer: Any = None, *, temperature: float, policy_version: int | None = None
) -> pd.DataFrame:
    """The per-token table of row `i` of `data` (module docstring). `data`: the trained batch
    (old_log_probs, advantages, rollout_advantages present) or a built one (those columns NaN)."""
    one = data.select_idxs([i])
    b = one.batch
    prompt_width = b["prompts"].shape[-1]
    attended = b["attention_mask"][0, prompt_width:].bool().numpy()  # [R]: the row's response, padding cut
    n = int(attended.sum())
    mask = b["response_mask"][0].float().numpy()[:n]
    ids = b["responses"][0].numpy()[:n]

    def col(key: str) -> np.ndarray:
        return b[key][0].float().numpy()[:n] if key in b.keys() else np.full(n, math.nan)

    new, ent, note = _current_policy(engine, one, n, temperature)
    old = col("old_log_probs")
    frame = pd.DataFrame(
        {
            "position": np.arange(n),
            "token_id": ids,
            "token": [tokenizer.decode([int(t)]) if tokenizer is not None else "" for t in ids],
            "loss_mask": mask.astype(int),
            "old_logprob": old,
            "rollout_logprob": np.where(
                mask > 0, col("rollout_log_probs"), math.nan
            ),  # the batch stores 0 off the mask
            "new_logprob": new,
            "ratio": np.exp(new - old),
            "entropy": ent,
            "advantage": col("rollout_advantages") * mask if "rollout_advantages" in b.keys() else col("advantages"),
            "loss_advantage": col("advantages") * mask if "rollout_advantages" in b.keys() else np.full(n, math.nan),
            "version": b["rollout_versions"][0].numpy()[:n] if "rollout_versions" in b.keys() else np.full(n, -1),
            "is_weight": col("rollout_is_weights"),
            "is_clipped": col("rollout_is_weights") < np.exp(old - col("rollout_log_probs")) * (1 - 1e-6),
        },
        columns=TOKEN_COLUMNS,
    )
    nt = one.non_tensor_batch
    frame.attrs.update(
        rollout_id=str(nt["rollout_id_list"][0]),
        first_call=int(nt["turn_index_list"][0]),
        policy_version=getattr(engine, "policy_version", None),
        temperature=temperature,
    )
    if note is not None:
        frame.attrs["note"] = note
        warnings.warn(note, stacklevel=3)
    if note is None and policy_version is not None and frame.attrs["policy_version"] != policy_version:
        warnings.warn(
            f"new_logprob and entropy are of policy version {frame.attrs['policy_version']}, not of "
            f"the version this update produced ({policy_version}): the engine trained again since",
            stacklevel=3,
        )
    return frame


def _current_policy(engine: Any, one: Any, n: int, temperature: float) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(new_logprob [n], entropy [n], note): one forward of `engine`'s model over the row; NaN and
    the engine's reason as the note where it has no model to run (a replay, verl's engine)."""
    try:
        new_lp, ent = engine.compute_log_probs_and_entropy(one, temperature=temperature)  # [1, R] each
    except NotImplementedError as e:
        nan = np.full(n, math.nan)
        return nan, nan.copy(), f"new_logprob, ratio and entropy are NaN: {e}"
    return new_lp[0].numpy()[:n], ent[0].numpy()[:n], None
