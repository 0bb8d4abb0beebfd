"""On the real Trainer (local engine, tiny model, lookup): the zero-advantage metric, the per-group
view, the recording and the advantages the update trained on agree (issue 36)."""

from __future__ import annotations

import numpy as np

from agl_lab.replay import load_recording
from agl_lab.trainer import Trainer
from agl_lab.views import groups_df
from tests.trainer_runs import SMALL


def test_metric_groups_view_recording_and_trained_advantages_agree(tmp_path):
    with Trainer.from_config(
        "configs/cpu_tiny.yaml",
        overrides=[*SMALL, "agl_lab.model.warm_start_steps=20"],
        run_dir=tmp_path,
        console=False,
    ) as tr:
        for _ in range(2):
            metrics = tr.step()
            b, u = tr._last_batch, tr._last_update
            zero = set(b.groups.loc[b.groups.zero_adv, "data_id"])
            assert metrics["training/n_zero_adv_groups_collected"] == len(zero)
            assert metrics["training/n_zero_signal_rollouts_collected"] == int(
                b.groups.loc[b.groups.zero_adv, "n_rollouts"].sum()
            )
            recorded = groups_df(load_recording(tmp_path, tr.global_step).rollouts)
            assert set(recorded.loc[recorded.zero_adv, "data_id"]) == zero
            trained = u.trained
            adv, ids = trained.batch["advantages"], trained.non_tensor_batch["data_id_list"]
            for i, data_id in enumerate(ids):
                row_zero = bool((adv[i] == 0).all())
                assert row_zero == (data_id in zero) or not trained.batch["response_mask"][i].any(), data_id
            assert metrics["training/n_zero_adv_groups"] == len(zero & set(np.asarray(ids).tolist()))
