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

import agl_lab.algorithms as alg
from agl_lab.algorithms.loss import row_weights_table
from agl_lab.batch import build_batch
from agl_lab.recording import load_recording
from agl_lab.records import CompletedRollout, triplets_from_events
from agl_lab.replay import replay_step, what_if
from agl_lab.trainer import Trainer
from agl_lab.update import with_row_advantages
from tests.trainer_runs import SMALL

RETURN_CREDIT = [
    "agl_lab.algorithm.turn_credit=return",
    "agentlightning.trace_aggregator.level=transition",
    "algorithm.enable_rollout_level_advantage=false",
    "trainer.save_freq=0",
]
TASKS = [{"key": k} for k in "abcd"]


# ---------------------------------------------------------------------------------------------
# Golden numbers on a hand-built group: two two-turn rollouts
# ---------------------------------------------------------------------------------------------


def _call(prompt: list[int], response: list[int]) -> dict:
    return {
        "event_type": "model_request",
        "data": {"prompt_token_ids": prompt, "response_token_ids": response, "response_log_probs": None},
    }


def _two_turn_rollout(rollout_id: str, copy_idx: int, r0: float, r1: float) -> CompletedRollout:
    """prompt [1, 2, 3] → reply [7, 8] (2 loss tokens); obs [9] → reply [10] (1); a turn reward after each."""
    turn = [{"event_type": "turn_reward", "data": {"turn": t, "reward": r}} for t, r in enumerate((r0, r1))]
    events = [_call([1, 2, 3], [7, 8]), turn[0], _call([1, 2, 3, 7, 8, 9], [10]), turn[1]]
    return CompletedRollout(
        rollout_id,
        "task-0",
        0,
        0,
        copy_idx=copy_idx,
        triplets=triplets_from_events(events),
        final_reward=r0 + r1,
        input={},
    )


def _data(turn_credit: str):
    """The group's transition rows with GRPO advantages at row level (verl's estimator)."""
    rollouts = [_two_turn_rollout("a", 0, 0.0, 1.0), _two_turn_rollout("b", 1, 0.5, 0.0)]
    built = build_batch(
        rollouts, "transition", max_prompt_length=8, max_response_length=4, turn_credit=turn_credit, turn_gamma=0.5
    )
    alg.fill_reward_defaults(built.data)
    data, _ = alg.compute_advantages(built.data, rollout_level=False, adv_estimator="grpo", num_repeat=2)
    return data


def test_row_numbers_and_the_flag_on_a_hand_built_group():
    rows = row_weights_table(_data("return"))
    # G = (0.5, 1.0) and (0.5, 0.0) (γ = 0.5); GRPO over the group's 4 rows: mean 0.5, std √(1/6)
    a = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    assert rows.rollout_id.tolist() == ["a", "a", "b", "b"] and rows.first_call.tolist() == [0, 1, 0, 1]
    np.testing.assert_allclose(rows.advantage, [0.0, a, 0.0, -a], rtol=1e-6)
    # per_rollout_mean over D = 2 rollouts: a row's weight = its loss tokens / (its rollout's 3 × 2)
    np.testing.assert_allclose(rows.loss_weight, [2 / 6, 1 / 6, 2 / 6, 1 / 6], rtol=1e-12)
    assert rows.loss_tokens.tolist() == [2, 1, 2, 1]
    weights = with_row_advantages(alg.rollout_weights_table(_data("return")), rows)
    assert weights.rows_advantages_differ.tolist() == [True, True] and weights.advantage.isna().all()
    np.testing.assert_allclose(weights.advantage_min, [0.0, -a], rtol=1e-6)
    np.testing.assert_allclose(weights.advantage_max, [a, 0.0], rtol=1e-6)
    np.testing.assert_allclose(weights.signed_weight, [a / 6, -a / 6], rtol=1e-6)  # Σ rows, not 0 × ½


def test_rows_that_agree_leave_the_rollouts_advantage_as_it_was():
    data = _data("rollout")  # every row its rollout's reward (1.0 and 0.5): one advantage per rollout
    plain = alg.rollout_weights_table(data)
    weights = with_row_advantages(plain, row_weights_table(data))
    assert not weights.rows_advantages_differ.any()
    assert weights.advantage.equals(plain.advantage) and weights.signed_weight.equals(plain.signed_weight)
    assert weights.advantage.equals(weights.advantage_min) and weights.advantage.equals(weights.advantage_max)


# ---------------------------------------------------------------------------------------------
# A recorded run
# ---------------------------------------------------------------------------------------------


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
