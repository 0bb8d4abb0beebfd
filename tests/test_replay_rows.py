"""Per-row numbers in replay and what-if (#49 item 4): under `turn_credit: return` the rows of one
rollout carry different advantages, and replay, what-if, `u.weights` and `tokens()` say so.

One recorded step of a real Trainer (tiny model, gateway, runner) at transition level: an agent
makes two model calls per rollout and emits a turn reward after each, so each call is a row
whose advantage is its own discounted return's, normalised in its group.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings

import numpy as np
import pytest
import torch

from agl_lab.recording import load_recording
from agl_lab.replay import replay_step, what_if
from agl_lab.trainer import Trainer
from tests.trainer_runs import SMALL

RETURN_CREDIT = [
    "agl_lab.algorithm.turn_credit=return",
    "agentlightning.trace_aggregator.level=transition",
    "algorithm.enable_rollout_level_advantage=false",
    "trainer.save_freq=0",
]
TASKS = [{"key": k} for k in "abcd"]


def _two_turn_agent():
    """Two calls, a turn reward after each; the rewards cycle over rollouts, so within a group
    the rows' returns spread and within a rollout G_0 = r_0 + γ·r_1 ≠ G_1 = r_1 mostly."""
    counter, lock = itertools.count(), threading.Lock()

    def agent(task: dict, ctx) -> float:
        with lock:
            k = next(counter)
        rewards = [0.5 * (k % 3), float(k % 2)]
        client = ctx.openai_client()
        messages = [{"role": "user", "content": f"get {task['key']}"}]
        for turn, reward in enumerate(rewards):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "and again"},
            ]
            ctx.emit("turn_reward", {"turn": turn, "reward": reward})
        return sum(rewards)

    return agent


@pytest.fixture(scope="module")
def turn_credit_run(tmp_path_factory):
    """(run_dir, the live UpdateResult of its one recorded step)."""
    run = tmp_path_factory.mktemp("rows") / "run"
    with Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=[*SMALL, *RETURN_CREDIT],
        agent=_two_turn_agent(),
        train_dataset=TASKS,
        run_dir=run,
        console=False,
    ) as trainer:
        trainer.step()
        live = trainer._last_update  # what the run trained: the numbers the replay must give back
    assert not live.skipped
    return run, live


def _live_row_advantages(live) -> dict[tuple[str, int], float]:
    """{(rollout_id, first_call): the row's raw advantage} of the batch the run trained."""
    data = live.trained
    adv, mask = data.batch["rollout_advantages"], data.batch["response_mask"].bool()
    ids, calls = data.non_tensor_batch["rollout_id_list"], data.non_tensor_batch["turn_index_list"]
    out = {}
    for i in range(len(data)):
        on = adv[i][mask[i]]
        assert torch.equal(on, on[:1].expand_as(on))  # one advantage per row, on every loss token
        out[(str(ids[i]), int(calls[i]))] = float(on[0]) if on.numel() else math.nan
    return out


def test_replays_rows_carry_each_rows_own_advantage_exactly(turn_credit_run):
    run, live = turn_credit_run
    r = replay_step(run, 1)
    assert r.equal, r.differences  # the recorded weights table too, with its new columns
    expected = _live_row_advantages(live)
    trained = r.rows[r.rows.trained]
    assert len(trained) == len(expected) > 0
    got = {(rid, call): adv for rid, call, adv in zip(trained.rollout_id, trained.first_call, trained.advantage)}
    assert got == expected  # exact: the same floats, row by row
    # at least one rollout whose rows differ: what one advantage per rollout would have hidden
    spread = trained.groupby("rollout_id").advantage.agg(lambda a: a.max() - a.min())
    assert (spread > 0).any()
    # a rollout's loss weight is the sum of its rows'
    per_rollout = trained.groupby("rollout_id").loss_weight.sum()
    w = r.update.weights.set_index("rollout_id")
    np.testing.assert_allclose(per_rollout.loc[w.index], w.loss_weight, rtol=1e-12)
    assert (r.rows.loc[~r.rows.trained, "loss_weight"] == 0).all()
    assert r.rows.loc[~r.rows.trained, "advantage"].isna().all()


def test_weights_flag_a_rollout_whose_rows_differ(turn_credit_run):
    run, live = turn_credit_run
    rec = load_recording(run, 1)
    for w in (live.weights, rec.weights):  # as trained and as recorded
        assert {"advantage_min", "advantage_max", "rows_advantages_differ"} <= set(w.columns)
        differ = w[w.rows_advantages_differ]
        same = w[~w.rows_advantages_differ]
        assert len(differ) > 0
        assert differ.advantage.isna().all() and (differ.advantage_min < differ.advantage_max).all()
        assert (same.advantage == same.advantage_min).all() and (same.advantage == same.advantage_max).all()
    rows = replay_step(run, 1).rows
    by_rollout = rows[rows.trained].groupby("rollout_id").advantage
    w = rec.weights.set_index("rollout_id")
    assert (w.advantage_min == by_rollout.min().loc[w.index]).all()
    assert (w.advantage_max == by_rollout.max().loc[w.index]).all()
    # signed_weight: Σ over the rows of advantage × loss weight, not the first row's advantage × all
    signed = (rows.advantage * rows.loss_weight)[rows.trained].groupby(rows.rollout_id).sum()
    np.testing.assert_allclose(w.signed_weight, signed.loc[w.index], rtol=1e-6, atol=1e-12)


def test_what_if_shows_each_rows_advantage_before_and_after(turn_credit_run):
    run, live = turn_credit_run
    diff = what_if(run, 1, ["agl_lab.algorithm.turn_credit=rollout"])
    rows = diff.rows
    assert {"advantage_base", "advantage_alt", "loss_weight_base", "loss_weight_alt"} <= set(rows.columns)
    both = rows[rows.trained_base & rows.trained_alt]
    assert len(both) > 0
    base = {(rid, c): a for rid, c, a in zip(both.rollout_id, both.first_call, both.advantage_base)}
    assert base == {k: v for k, v in _live_row_advantages(live).items() if k in base}
    # under `rollout` every row of a rollout carries the rollout's reward: one advantage per rollout
    alt_spread = both.groupby("rollout_id").advantage_alt.agg(lambda a: a.max() - a.min())
    assert (alt_spread == 0).all()
    assert (both.advantage_base != both.advantage_alt).any()
    assert not diff.weights.rows_advantages_differ_alt.fillna(False).any()
    assert diff.weights.rows_advantages_differ_base.fillna(False).any()


def test_tokens_of_a_replayed_update_need_no_engine(turn_credit_run):
    run, _ = turn_credit_run
    r = replay_step(run, 1)
    row = r.rows[r.rows.trained].iloc[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = r.update.tokens(row)
    assert "a replay has no engine" in tok.attrs["note"] and any("no engine" in str(c.message) for c in caught)
    assert tok.new_logprob.isna().all() and tok.ratio.isna().all() and tok.entropy.isna().all()
    assert len(tok) == row.response_tokens and (tok.token != "").any()
    assert int(tok.loss_mask.sum()) == row.loss_tokens
    on = tok[tok.loss_mask == 1]
    assert (on.advantage == row.advantage).all()  # the row's own advantage, from the replayed update
    assert on.rollout_logprob.notna().all()  # the sampler's logprobs, as recorded
    # what the loss multiplies, summed over the row: its advantage × its loss weight
    assert tok.loss_advantage.sum() == pytest.approx(row.advantage * row.loss_weight, rel=1e-5, abs=1e-9)
