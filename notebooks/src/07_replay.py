# Source of notebooks/07_replay.ipynb — edit here, then: python scripts/build_notebooks.py 07

# %% [markdown]
# # 07 · Record, replay, ask "what if"
#
# Every `Trainer.step()` writes what it trained on to `RUN_DIR/recording/step_N.json.gz`: the
# completed rollouts (token ids, sampling logprobs, rewards, events, timings), the policy
# version that served them, the RNG states, and what the step made of them (metrics, the loss
# weight of every rollout, every drop). When something looks wrong at step N you can rebuild
# that step exactly — on a laptop, with no engine, server or agent — and then re-run it under
# other settings to see what they would have changed.
#
# This notebook records a short run, replays its worst step, checks the replay against what the
# run logged, and asks two questions of it.

# %%
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import Image

from agl_lab.replay import recorded_steps, replay_step, what_if
from agl_lab.trainer import Trainer

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.precision", 4)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
RUN = Path(tempfile.mkdtemp(prefix="agl-nb07-")) / "run"

# %% [markdown]
# ## 1 · A short recorded run
#
# Four `lookup` tasks × four rollouts per step, mini-batches of 3 tasks (12 rows): every step
# has to drop rows to fill whole mini-batches, which makes the selection worth replaying.
# Recording is on by default (`agl_lab.record.enabled`); `recording/bytes` is its cost per step.

# %%
overrides = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
             "trainer.test_freq=0", "trainer.save_freq=0", "trainer.logger=[console]", "agl_lab.task.n_val=0"]
with Trainer.from_config(ROOT / "configs/cpu_tiny.yaml", overrides=overrides, run_dir=RUN, console=False) as trainer:
    trainer.fit(4, progress=False)
    logged = trainer.metrics
logged[["training/reward", "training/n_zero_adv_groups", "training/n_sample_dropped/alignment", "recording/bytes"]]

# %% [markdown]
# ## 2 · Replay the worst step
#
# `replay_step` reads the recording and the run's own `config.yaml`, rebuilds the batch and runs
# the update stage without an engine (advantages, selection, loss weights). Every metric both
# sides have is compared: the engine-independent ones must be equal to the bit.

# %%
worst = int(logged["training/reward"].idxmin())
replay = replay_step(RUN, worst)
print(f"recorded steps {recorded_steps(RUN)}; step {worst} (lowest reward): "
      f"{len(replay.comparison)} metrics compared, all equal: {replay.equal}")
replay.comparison.head(8)

# %% [markdown]
# The replay holds the same objects a live step returns: the rows, the merge breaks, and the
# per-rollout loss weights — here the rollouts the alignment dropped, and who carried the loss.

# %%
replay.update.dropped

# %%
replay.update.weights.sort_values("loss_weight", ascending=False).head(6)

# %% [markdown]
# ## 3 · What if the step had trained one row per call?
#
# `what_if` replays the step twice — as run and under the overrides — and returns what moved:
# metrics, each rollout's share of the policy loss, and the drops that differ. At transition
# level a two-call rollout becomes two rows; with per-rollout normalisation its share of the loss
# stays the same, which the plot shows (the shares of the rollouts both settings train agree).

# %%
transition = what_if(RUN, worst, ["agentlightning.trace_aggregator.level=transition"])
transition.metrics.set_index("metric").loc[["training/n_sample", "training/n_sample_trained",
                                            "training/n_sample_dropped/alignment"]]

# %%
Image(transition.plot(RUN.parent / "transition.png"))

# %% [markdown]
# ## 4 · What if AGL v1's selection had chosen the rows?
#
# Agent Lightning v1 aligns the batch to whole mini-batches *before* computing advantages and
# drops rows, not rollouts (`agl_lab.parity.drop_order=agl`). On the same recorded rollouts:

# %%
agl_order = what_if(RUN, worst, ["agl_lab.parity.drop_order=agl"])
print(f"{len(agl_order.dropped)} rollouts dropped under one order and not the other")
agl_order.weights[["rollout_id", "share_base", "share_alt", "reward_base"]].head(8)
