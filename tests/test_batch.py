"""Golden tests of agl_lab.batch on hand-built rollouts (fake tokenizer = space-joined ids).

Covers every rule of the module docstring, AGL v1's tests/verl/test_rollout_adapter.py
(reference §7.7) with a fake W&B module, and the invariances: reordering rollouts, running
twice, trajectory row ≡ last transition row's tokens.
"""

from __future__ import annotations

import copy
import io
import json
import random
import zipfile

import numpy as np
import pytest
import torch

from agl_lab.batch import (
    MISMATCH_COLUMNS,
    build_batch,
    build_validation,
    log_batch_artifacts,
    validation_metrics,
)
from agl_lab.rollout import CompletedRollout, Triplet


class SpaceTokenizer:
    """The upstream tests' fake tokenizer: decode = space-joined ids."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def lp(n: int) -> list[float]:
    return [-0.1] * n


def T(prompt, response, logprobs="auto") -> Triplet:
    return Triplet(list(prompt), list(response), lp(len(response)) if logprobs == "auto" else logprobs)


def R(rid, triplets, reward=1.0, data_id="d", step=0, sample_idx=0) -> CompletedRollout:
    return CompletedRollout(rollout_id=rid, data_id=data_id, step=step, sample_idx=sample_idx,
                            triplets=triplets, final_reward=reward)


def rows_of(result, key):
    return result.data.batch[key].tolist()


# =========================================================================== transition level


def test_transition_golden_tensors():
    r1 = R("r1", [T([1, 2], [3]), T([1, 2, 3, 4], [5, 6])], reward=0.7, data_id="g1")
    res = build_batch([r1], "transition", max_prompt_length=4, max_response_length=3, pad_token_id=0)
    assert rows_of(res, "prompts") == [[0, 0, 1, 2], [1, 2, 3, 4]]
    assert rows_of(res, "responses") == [[3, 0, 0], [5, 6, 0]]
    assert rows_of(res, "input_ids") == [[0, 0, 1, 2, 3, 0, 0], [1, 2, 3, 4, 5, 6, 0]]
    assert rows_of(res, "attention_mask") == [[0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert rows_of(res, "position_ids") == [[0, 0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5, 5]]
    # transition: response_mask is the response attention mask
    assert rows_of(res, "response_mask") == [[1, 0, 0], [1, 1, 0]]
    assert rows_of(res, "is_drop_mask") == [False, False]
    scores = res.data.batch["token_level_scores"]
    assert scores.dtype == torch.float32  # deviation: AGL v1 uses bfloat16 (0.7 → 0.69921875)
    assert scores.tolist() == [[np.float32(0.7), 0, 0], [0, np.float32(0.7), 0]]
    np.testing.assert_allclose(res.data.batch["rollout_log_probs"], [[-0.1, 0, 0], [-0.1, -0.1, 0]], rtol=1e-6)
    nt = res.data.non_tensor_batch
    assert list(nt["data_id_list"]) == ["g1", "g1"] and list(nt["uid"]) == ["g1", "g1"]
    assert list(nt["rollout_id_list"]) == ["r1", "r1"]
    assert list(nt["turn_index_list"]) == [0, 1]


def test_metrics_names_and_values():
    rollouts = [
        R("a", [T([1], [2, 3]), T([1, 2, 3, 4], [5])], reward=1.0, sample_idx=0),
        R("b", [T([7], [8, 9, 10, 11])], reward=None, sample_idx=1),
        R("c", [], reward=0.5, sample_idx=2),
    ]
    m = build_batch(rollouts, "transition", max_prompt_length=4, max_response_length=3,
                    reward_fillna_value=-1.0).metrics
    assert m == {
        "training/reward": pytest.approx((1.0 - 1.0 + 0.5) / 3),  # averaged over all rollouts
        "training/n_sample": 3,
        "training/n_rollouts": 3,
        "training/n_rollouts_w_trace": 2,
        "training/n_rollouts_w_reward": 2,
        "training/n_truncated_sample": 1,
        "training/n_skipped_empty_rows": 0,
        "training/n_dropped_prompt_too_long": 0,
        "training/n_rows_without_logprobs": 0,
        "training/n_turns": 3,
        "response_length/training/avg_by_turn": pytest.approx(7 / 3),
        "response_length/training/max_by_turn": 4,
        "response_length/training/min_by_turn": 1,
    }
    traj = build_batch(rollouts, "trajectory", max_prompt_length=4, max_response_length=8).metrics
    for key in ("training/n_unmerged_rollouts", "training/n_trace_merge_mismatch_rows",
                "training/merge_breaks/retokenization", "training/merge_breaks/template",
                "training/merge_breaks/history_edit", "training/merge_breaks/other"):
        assert traj[key] == 0


# =========================================================================== trajectory merge


def test_trajectory_merge_masks_observations():
    r = R("r1", [T([1, 2], [3, 4]), T([1, 2, 3, 4, 5, 6], [7]), T([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])], reward=2.0)
    res = build_batch([r], "trajectory", max_prompt_length=3, max_response_length=10)
    assert len(res.data) == 1
    assert rows_of(res, "prompts") == [[0, 1, 2]]
    assert rows_of(res, "responses") == [[3, 4, 5, 6, 7, 8, 9, 10, 0, 0]]
    assert rows_of(res, "response_mask") == [[1, 1, 0, 0, 1, 0, 1, 1, 0, 0]]
    assert rows_of(res, "attention_mask") == [[0, 1, 1] + [1] * 8 + [0, 0]]  # observations attended
    np.testing.assert_allclose(res.data.batch["rollout_log_probs"],
                               [[-0.1, -0.1, 0.0, 0.0, -0.1, 0.0, -0.1, -0.1, 0.0, 0.0]], rtol=1e-6)
    assert res.data.batch["token_level_scores"].tolist() == [[0] * 7 + [2.0, 0, 0]]
    assert list(res.data.non_tensor_batch["turn_index_list"]) == [0]
    row = res.rows.iloc[0]
    assert (row.first_turn, row.last_turn, row.n_turns) == (0, 2, 3)
    assert (row.loss_tokens, row.observation_tokens, row.prompt_tokens) == (5, 3, 2)
    assert res.metrics["training/n_unmerged_rollouts"] == 0 and res.merges.empty


def test_trajectory_row_equals_last_transition_row():
    calls = [T([5, 6, 7], [8, 9]), T([5, 6, 7, 8, 9, 1], [2, 3, 4]), T([5, 6, 7, 8, 9, 1, 2, 3, 4, 11, 12], [13])]
    r = R("r", calls)
    traj = build_batch([r], "trajectory", max_prompt_length=3, max_response_length=12)
    trans = build_batch([r], "transition", max_prompt_length=12, max_response_length=3)
    t_ids = traj.data.batch["input_ids"][0][traj.data.batch["attention_mask"][0].bool()].tolist()
    last = trans.data.batch["input_ids"][-1][trans.data.batch["attention_mask"][-1].bool()].tolist()
    assert t_ids == last  # same tokens as the full context of the last call
    # model tokens are exactly the transition rows' responses, at their context positions
    full_mask = torch.cat([torch.zeros(3, dtype=torch.long), traj.data.batch["response_mask"][0]])
    model_positions = torch.nonzero(full_mask).flatten().tolist()
    expected = []
    for t in calls:
        expected += list(range(len(t.prompt_ids), len(t.prompt_ids) + len(t.response_ids)))
    assert [p - 0 for p in model_positions] == expected
    model_tokens = [t_ids[p] for p in expected]
    assert model_tokens == [tok for t in calls for tok in t.response_ids]


def test_merge_break_emits_new_row_and_unmerged_count():
    r = R("r", [T([1], [2]), T([1, 2, 3], [4]), T([9], [10]), T([9, 10], [11])], reward=1.0)
    res = build_batch([r], "trajectory", max_prompt_length=4, max_response_length=4)
    assert rows_of(res, "prompts") == [[0, 0, 0, 1], [0, 0, 0, 9]]
    assert rows_of(res, "responses") == [[2, 3, 4, 0], [10, 11, 0, 0]]
    assert rows_of(res, "response_mask") == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert list(res.data.non_tensor_batch["turn_index_list"]) == [0, 2]
    assert res.metrics["training/n_unmerged_rollouts"] == 1
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 1
    b = res.merges.iloc[0]
    assert (b.turn_index, b.against_turn, b.kind) == (2, 1, "other")
    assert res.metrics["training/merge_breaks/other"] == 1


def test_multi_segment_keeps_interleaved_subagent_chains():
    main1, sub1 = T([1, 2], [3]), T([50, 51], [52])
    main2, sub2 = T([1, 2, 3, 4], [5]), T([50, 51, 52, 53], [54])
    r = R("r", [main1, sub1, main2, sub2])
    single = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4)
    assert len(single.data) == 4 and len(single.merges) == 3
    multi = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4, multi_segment=True)
    assert rows_of(multi, "prompts") == [[1, 2], [50, 51]]  # ordered by first call
    assert rows_of(multi, "responses") == [[3, 4, 5, 0], [52, 53, 54, 0]]
    assert rows_of(multi, "response_mask") == [[1, 0, 1, 0], [1, 0, 1, 0]]
    assert list(multi.data.non_tensor_batch["turn_index_list"]) == [0, 1]
    assert multi.merges.turn_index.tolist() == [1]  # only the sub-agent's first call breaks
    assert multi.metrics["training/n_unmerged_rollouts"] == 1


def test_multi_segment_extends_the_longest_matching_context():
    # call 1 re-asks a shorter prompt (not an extension of [1,2,3]) → second segment [1,2]+[3,4];
    # call 2 extends both contexts ([1,2,3] and [1,2,3,4]) → it joins the longer one.
    r = R("r", [T([1], [2, 3]), T([1, 2], [3, 4]), T([1, 2, 3, 4, 5], [6])])
    res = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=4, multi_segment=True)
    assert rows_of(res, "prompts") == [[0, 1], [1, 2]]
    assert rows_of(res, "responses") == [[2, 3, 0, 0], [3, 4, 5, 6]]
    assert rows_of(res, "response_mask") == [[1, 1, 0, 0], [1, 1, 0, 1]]
    assert res.rows.n_turns.tolist() == [1, 2]


# =========================================================================== limits and logprobs


def test_prompt_over_limit_is_marked_drop_and_cut_to_head():
    r = R("r", [T([1, 2, 3, 4, 5, 6], [7])])
    res = build_batch([r], "transition", max_prompt_length=4, max_response_length=2)
    assert rows_of(res, "prompts") == [[1, 2, 3, 4]]
    assert rows_of(res, "is_drop_mask") == [True]
    assert res.metrics["training/n_dropped_prompt_too_long"] == 1
    assert res.rows.is_drop.tolist() == [True] and res.rows.tokens_cut.tolist() == [2]


def test_response_over_limit_keeps_head_and_reward_on_last_kept_token():
    # trajectory response = [3, 4(obs), 5(obs), 6] cut to 3 → last kept token is an observation
    r = R("r", [T([1, 2], [3]), T([1, 2, 3, 4, 5], [6])], reward=1.5)
    res = build_batch([r], "trajectory", max_prompt_length=2, max_response_length=3)
    assert rows_of(res, "responses") == [[3, 4, 5]]
    assert rows_of(res, "response_mask") == [[1, 0, 0]]
    assert res.data.batch["token_level_scores"].tolist() == [[0, 0, 1.5]]
    assert res.metrics["training/n_truncated_sample"] == 1
    assert res.rows.truncated.tolist() == [True] and res.rows.tokens_cut.tolist() == [1]


@pytest.mark.parametrize("bad_turn", [
    T([1, 2, 3, 4], [5], logprobs=None),        # a turn without logprobs
    T([1, 2, 3, 4], [5], logprobs=[-0.1, -0.2]),  # length disagrees with the response
])
def test_row_loses_logprobs_when_any_turn_lacks_them(bad_turn):
    merged = R("a", [T([1, 2], [3]), bad_turn], sample_idx=0)
    clean = R("b", [T([8], [9])], sample_idx=1)
    res = build_batch([merged, clean], "trajectory", max_prompt_length=2, max_response_length=3)
    assert "rollout_log_probs" not in res.data.batch.keys()  # all-or-nothing
    assert res.metrics["training/n_rows_without_logprobs"] == 1
    assert res.rows.has_logprobs.tolist() == [False, True]
    only_clean = build_batch([clean], "trajectory", max_prompt_length=2, max_response_length=3)
    assert "rollout_log_probs" in only_clean.data.batch.keys()


def test_empty_rows_are_skipped_and_zero_rows_raise():
    r = R("r", [T([1], []), T([5], [6])])
    res = build_batch([r], "transition", max_prompt_length=2, max_response_length=2)
    assert len(res.data) == 1 and res.metrics["training/n_skipped_empty_rows"] == 1
    assert res.rows.batch_index.tolist() == [-1, 0] and res.rows.skipped_empty.tolist() == [True, False]
    with pytest.raises(RuntimeError, match="get_train_data_batch emitted zero training rows"):
        build_batch([R("x", [T([1], [])]), R("y", [])], "trajectory", max_prompt_length=2, max_response_length=2)


def test_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="Unknown trace_aggregator_level: 'turn'"):
        build_batch([R("r", [T([1], [2])])], "turn", max_prompt_length=2, max_response_length=2)
    with pytest.raises(ValueError, match="max_response_length must be a positive int"):
        build_batch([R("r", [T([1], [2])])], "trajectory", max_prompt_length=2, max_response_length=0)


# =========================================================================== invariances


def _snapshot(res):
    tensors = {k: v.tolist() for k, v in res.data.batch.items()}
    non = {k: list(v) for k, v in res.data.non_tensor_batch.items()}
    return tensors, non, res.metrics, res.rows.to_dict("list"), res.merges.to_dict("list")


def _mixed_rollouts():
    out = []
    for k in range(6):
        calls = [T([k, 1], [2]), T([k, 1, 2, 3], [4, 5])]
        if k % 2:
            calls.append(T([99, k], [7]))  # a break
        out.append(R(f"r{k}", calls, reward=float(k), data_id=f"g{k // 3}", step=k % 2, sample_idx=k // 3))
    return out


def test_reordering_rollouts_does_not_change_the_batch():
    rollouts = _mixed_rollouts()
    reference = _snapshot(build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5,
                                      tokenizer=SpaceTokenizer()))
    shuffled = rollouts[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != rollouts
    again = _snapshot(build_batch(shuffled, "trajectory", max_prompt_length=3, max_response_length=5,
                                  tokenizer=SpaceTokenizer()))
    assert again == reference
    # carry-overs from an older step come first
    assert build_batch(rollouts, "trajectory", max_prompt_length=3,
                       max_response_length=5).rows.rollout_id.tolist()[:3] == ["r0", "r2", "r4"]


def test_build_batch_does_not_mutate_inputs():
    rollouts = _mixed_rollouts()
    before = copy.deepcopy(rollouts)
    first = _snapshot(build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5))
    assert rollouts == before  # AGL v1 extended the first triplet's logprob list in place
    assert _snapshot(build_batch(rollouts, "trajectory", max_prompt_length=3, max_response_length=5)) == first


# =========================================================================== §7.7 W&B uploads


class FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


class FakeArtifact:
    def __init__(self, name, type, metadata):
        self.name, self.type, self.metadata, self.files = name, type, metadata, {}

    def add_file(self, local_path, name):
        with open(local_path, "rb") as fh:
            self.files[name] = fh.read()


class FakeWandb:
    Table, Artifact = FakeTable, FakeArtifact


class FakeRun:
    id = "fake-run"

    def __init__(self):
        self.logged, self.artifacts = [], []

    def log(self, data, step):
        self.logged.append((step, data))

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def tables(self, key):
        return [(step, d[key]) for step, d in self.logged if key in d]


def _adapter(rollouts):
    return build_batch(rollouts, "trajectory", max_prompt_length=4, max_response_length=3,
                       pad_token_id=0, tokenizer=SpaceTokenizer())


def test_trajectory_prefix_mismatch_uploads_trace_merge_table_to_wandb():
    r = R("r1", [T([1], [2]), T([9], [10])], reward=0.5, data_id="data-1", step=17)
    res = _adapter([r])
    assert res.metrics["training/n_unmerged_rollouts"] == 1
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 1
    assert rows_of(res, "prompts") == [[0, 0, 0, 1], [0, 0, 0, 9]]
    assert rows_of(res, "responses") == [[2, 0, 0], [10, 0, 0]]
    assert rows_of(res, "response_mask") == [[1, 0, 0], [1, 0, 0]]
    run = FakeRun()
    log_batch_artifacts(run, res, 17, "train", wandb_module=FakeWandb)
    [(step, table)] = run.tables("training/trace_merge_mismatches")
    assert step == 17 and table.columns == MISMATCH_COLUMNS
    assert table.columns[0] == "global_steps" and table.columns[-2:] == ["previous_trace", "current_trace"]
    assert table.data == [[17, "r1", "data-1", 1, False, False, True, 1, 1, 2, 2, "1 2", "9 10"]]


def test_trajectory_prefix_mismatch_table_is_capped_at_100():
    r = R("r1", [T([10 * i + 1], [10 * i + 2]) for i in range(103)], data_id="data-1", step=3)
    res = _adapter([r])
    run = FakeRun()
    log_batch_artifacts(run, res, 3, "train", wandb_module=FakeWandb)
    [(_, table)] = run.tables("training/trace_merge_mismatches")
    assert len(table.data) == 100 and len(res.merges) == 102  # the DataFrame keeps every break
    assert table.data[0][3] == 1 and table.data[-1][3] == 100
    assert res.metrics["training/n_trace_merge_mismatch_rows"] == 100
    assert res.metrics["training/n_merge_breaks"] == 102


def _read_zip(blob):
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        names = zf.namelist()
        assert all(info.compress_type == zipfile.ZIP_DEFLATED for info in zf.infolist())
        return names, [json.loads(line) for line in zf.read(names[0]).decode().splitlines()]


def test_training_step_uploads_24_compact_rollout_trajectories_to_wandb_zip():
    rollouts = [R(f"r{i}", [T([i], [i + 100]), T([i, i + 100, i + 200], [i + 300])], reward=float(i),
                  data_id=f"d{i}", step=23, sample_idx=i - 1) for i in range(1, 27)]
    res = _adapter(rollouts)
    run = FakeRun()
    log_batch_artifacts(run, res, 23, "train", wandb_module=FakeWandb)
    [(step, table)] = run.tables("training/rollout_trajectories")
    assert step == 23
    assert table.columns == ["global_steps", "trajectory_artifact", "trajectory_artifact_path", "row_count"]
    assert table.data == [[23, "train-trajectories-fake-run-step-23", "step_23/train_trajectories.jsonl.zip", 24]]
    [artifact] = run.artifacts
    assert (artifact.name, artifact.type) == ("train-trajectories-fake-run-step-23", "train_trajectories")
    assert artifact.metadata == {"global_steps": 23, "row_count": 24, "format": "jsonl.zip"}
    assert list(artifact.files) == ["step_23/train_trajectories.jsonl.zip"]
    names, records = _read_zip(artifact.files["step_23/train_trajectories.jsonl.zip"])
    assert names == ["train_trajectories.jsonl"]
    assert [r["rollout_id"] for r in records] == [f"r{i}" for i in range(1, 25)]
    assert all(set(r) == {"rollout_id", "reward", "prompt", "response"} for r in records)
    assert records[0] == {"rollout_id": "r1", "reward": 1.0, "prompt": "1 101 201", "response": "301"}
    assert records[-1] == {"rollout_id": "r24", "reward": 24.0, "prompt": "24 124 224", "response": "324"}


def test_validation_uploads_all_compact_rollout_trajectories_to_wandb_zip():
    rollouts = [R(f"vr{i}", [T([i], [i + 10]), T([i, i + 10, i + 20], [i + 30])], reward=float(i),
                  data_id=f"d{i}", step=31, sample_idx=i - 1) for i in range(1, 8)]
    val = build_validation(rollouts, 0.0, SpaceTokenizer())
    assert val.metrics == {
        "val/reward": 4.0, "val/n_rollouts": 7, "val/n_rollouts_w_trace": 7, "val/n_rollouts_w_reward": 7,
        "val/mean_response_length_per_turn": 1.0, "val/mean_total_response_length_per_rollout": 2.0,
        "val/turn_count": 2.0,
    }
    assert validation_metrics(rollouts, 0.0) == val.metrics
    run = FakeRun()
    log_batch_artifacts(run, val, 31, "validation", wandb_module=FakeWandb)
    assert run.tables("training/trace_merge_mismatches") == []
    [(step, table)] = run.tables("val/rollout_trajectories")
    assert table.data == [[31, "validation-trajectories-fake-run-step-31",
                           "step_31/validation_trajectories.jsonl.zip", 7]]
    [artifact] = run.artifacts
    assert artifact.type == "validation_trajectories" and artifact.metadata["row_count"] == 7
    names, records = _read_zip(artifact.files["step_31/validation_trajectories.jsonl.zip"])
    assert names == ["validation_trajectories.jsonl"] and len(records) == 7
    assert records[0] == {"rollout_id": "vr1", "reward": 1.0, "prompt": "1 11 21", "response": "31"}
    assert records[-1] == {"rollout_id": "vr7", "reward": 7.0, "prompt": "7 17 27", "response": "37"}


def test_validation_without_trace_raises_and_fills_missing_rewards():
    with pytest.raises(RuntimeError, match="get_test_metrics received zero completed rollouts with trace"):
        validation_metrics([R("a", [])], 0.0)
    m = validation_metrics([R("a", [T([1], [2, 3])], reward=None), R("b", [], reward=1.0, sample_idx=1)], -1.0)
    assert m["val/reward"] == 0.0 and m["val/n_rollouts_w_trace"] == 1 and m["val/n_rollouts_w_reward"] == 1
    assert m["val/mean_total_response_length_per_rollout"] == 2.0


def test_log_batch_artifacts_with_real_wandb_objects(tmp_path, monkeypatch):
    """The real `wandb.Table` / `wandb.Artifact` accept what we pass (no run, no network)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path))
    wandb = pytest.importorskip("wandb")
    r = R("r1", [T([1], [2]), T([9], [10])], reward=0.5, data_id="data-1", step=5)
    run = FakeRun()
    run.id = "odd/id:1"
    log_batch_artifacts(run, _adapter([r]), 5, "train", wandb_module=wandb)
    [(_, table)] = run.tables("training/trace_merge_mismatches")
    assert isinstance(table, wandb.Table) and table.data[0][:4] == [5, "r1", "data-1", 1]
    [artifact] = run.artifacts
    assert artifact.name == "train-trajectories-odd_id_1-step-5"
    assert list(artifact.manifest.entries) == ["step_5/train_trajectories.jsonl.zip"]
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        log_batch_artifacts(run, _adapter([r]), 5, "val", wandb_module=wandb)


def test_log_batch_artifacts_failure_warns_and_continues():
    class BrokenRun(FakeRun):
        def log_artifact(self, artifact):
            raise ConnectionError("wandb unreachable")

    run = BrokenRun()
    res = _adapter([R("r1", [T([1], [2])])])
    with pytest.warns(UserWarning, match="W&B upload for step 4 failed: ConnectionError"):
        log_batch_artifacts(run, res, 4, "train", wandb_module=FakeWandb)
    assert len(run.tables("training/trace_merge_mismatches")) == 1  # the table went out first
    with pytest.raises(TypeError, match="needs the BatchResult"):
        log_batch_artifacts(run, build_validation([R("r1", [T([1], [2])])]), 4, "train", wandb_module=FakeWandb)
