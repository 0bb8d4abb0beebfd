# Source of notebooks/10_async.ipynb — edit here, then: python scripts/build_notebooks.py 10

# %% [markdown]
# # 10 · Generating while the update trains (bounded staleness)
#
# In the synchronous loop the engine is paused for the whole update. With
# `agl_lab.rollout.max_staleness=N` (N > 0, local engine, carry-over on) the server keeps
# generating from a **serving copy** of the weights while `update()` trains the model; the trained
# weights reach the server at the step boundary (`publish`). A rollout therefore may have been
# sampled by an older policy version than the one it trains: its **staleness**. The bound N says
# how old a trained token may be; a group that would exceed it is dropped (or, with
# `stale_groups=wait`, waited for at exactly N). docs/engines.md "Overlap" has the design.
#
# The carry-over buffer here is one batch (`async_train_batch_size = train_batch_size`): the next
# batch generates while this one trains, so at N = 1 every trained token is exactly one version old
# (a buffer deeper than N batches would hold groups past the bound and drop them; a load warning
# says so).
#
# This notebook runs overlapped steps on the tiny model stage by stage and looks at the versions.

# %%
import tempfile
from pathlib import Path

import pandas as pd

from agl_lab.trainer import Trainer

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.precision", 4)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
RUN = Path(tempfile.mkdtemp(prefix="agl-nb10-")) / "run"

# %% [markdown]
# ## 1 · The configuration
#
# Overlap needs the carry-over manager (`agentlightning.async_rollout`; under overlap one batch in
# flight is enough) and a behaviour policy for stale tokens. Here the decoupled form: the old
# logprobs are recomputed by the trained version (the proximal policy) and each token's
# importance weight π_old / π_sampling, truncated at 2, corrects for the version that sampled it
# (`rollout_is=token`). With `bypass_mode=true` instead, the sampling logprobs the server recorded
# are PPO's old logprobs (the ratio is π_θ / π_sampling): one forward less, but no gap to show.

# %%
overrides = [
    "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "agl_lab.task.n_train=16", "agl_lab.task.n_val=0", "trainer.test_freq=0", "trainer.save_freq=0",
    "trainer.logger=[console]", "agl_lab.model.warm_start_steps=50",
    "agentlightning.async_rollout.enabled=true", "agentlightning.async_rollout.async_train_batch_size=4",
    "agl_lab.rollout.max_staleness=1", "algorithm.rollout_correction.bypass_mode=false",
    "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
]
trainer = Trainer.from_config(ROOT / "configs/cpu_tiny.yaml", overrides=overrides, run_dir=RUN, console=False)
engine = trainer.engine
print(f"serving copy: {engine.serving_model is not engine.model}; "
      f"trained version {engine.policy_version}, serving version {engine.serving_version}")

# %% [markdown]
# ## 2 · Step 1: every rollout sampled by version 0
#
# The first rollout phase starts from nothing, so it waits for its groups like the synchronous
# loop. At its end the carry-over manager already enqueues step 2's groups (`prefetch`): they
# generate on the serving copy while the update below trains.

# %%
def versions(result, trained_version):
    """One row per rollout: the version its group was enqueued under, the oldest version that
    answered one of its calls, and its staleness against the weights it trains."""
    return pd.DataFrame(
        [
            {"rollout_id": r.rollout_id, "enqueued_at_step": r.step, "enqueued_at_version": r.enqueue_policy_version,
             "policy_version": r.policy_version, "staleness": trained_version - r.policy_version,
             "reward": r.final_reward}
            for r in result.rollouts
        ]
    )


ro1 = trainer.rollout()
v1 = versions(ro1, engine.policy_version)
v1.head(4)

# %%
b1 = trainer.build_batch(ro1)
decoded_before = engine.serving_counters()["decode_steps"]
u1 = trainer.update(b1)
print(f"decode steps the server ran during update 1: {engine.serving_counters()['decode_steps'] - decoded_before:.0f}")
print(f"after publish: trained version {engine.policy_version}, serving version {engine.serving_version}")
{k: v for k, v in u1.metrics.items() if k.startswith("training/overlap/")}

# %% [markdown]
# ## 3 · Step 2: some rollouts are one version old
#
# Step 2 trains groups enqueued under version 0 (the carry-over of step 1's phase, generated in
# part on the serving copy while update 1 ran) with version 1's weights: staleness 1. A call
# finished after `publish` would carry version 1; a rollout's `policy_version` is the oldest
# version among its calls (`triplets` shows each call's `server_version`), and its staleness is
# counted against the weights that train on it. These per-rollout columns are the notebook's own
# small frame; the run records them (`CompletedRollout.policy_version`, `enqueue_policy_version`).

# %%
ro2 = trainer.rollout()
v2 = versions(ro2, engine.policy_version)
print(v2.groupby("staleness").size().rename("rollouts").to_string())
v2.head(6)

# %%
calls = ro2.triplets[["rollout_id", "call", "response_tokens", "server_version"]]
calls.groupby("server_version").size().rename("calls")

# %%
b2 = trainer.build_batch(ro2)
u2 = trainer.update(b2)
pd.Series({k: v for k, v in {**ro2.metrics, **u2.metrics}.items()
           if k.startswith(("training/overlap/", "training/async/"))})

# %% [markdown]
# ### Token by token: `u.staleness()`
#
# One line per trained loss token: the version that sampled it, its `age` against the trained
# version, its sampling logprob (`rollout_logprob`, the behaviour policy) and the old logprob
# (recomputed by the trained version), their gap `lp_diff`, and the truncated IS weight in
# `is_weight`. A token of age 1 was sampled by the weights before the update that produced the
# trained version: its gap is the policy's move in one step. (Under `bypass_mode` the two logprobs
# are the same by construction, and the `staleness/lp_diff_*` metrics are not logged.)

# %%
tokens = u2.staleness()
print(f"trained version {tokens.attrs['trained_version']}; {len(tokens)} loss tokens")
tokens.groupby("age").agg(tokens=("lp_diff", "size"), lp_diff_mean=("lp_diff", "mean"),
                          lp_diff_max=("lp_diff", "max"), is_clipped=("is_clipped", "mean"))

# %%
{k: v for k, v in u2.metrics.items() if k.startswith("staleness/")}

# %% [markdown]
# ## 4 · A few whole steps, and the staleness metrics in the run's history
#
# `trainer.step()` runs the same three stages and logs one line a step: the overlap metrics
# (groups dropped as too old, the serving version, the publish drain) and the token ages
# (`staleness/*`) sit beside the rest.

# %%
for _ in range(3):
    trainer.step()
history = trainer.metrics
cols = ["training/policy_version", "training/overlap/serving_version", "staleness/token_age_mean",
        "staleness/token_age_max", "training/overlap/n_stale_groups_dropped", "training/reward"]
history[[c for c in cols if c in history]]

# %% [markdown]
# `viz.plot_staleness` draws the same history: trained tokens per step stacked by age, and the
# mean |Δlogp| per age.

# %%
from agl_lab.viz import plot_staleness

axes = plot_staleness(history)

# %% [markdown]
# ## 5 · What this showed
#
# The bound held: no rollout trained in these steps was sampled more than `max_staleness` versions
# before the weights it trained, and after each update the server serves the trained weights.

# %%
staleness = pd.concat([v1, v2])["staleness"]
assert staleness.max() <= 1 and staleness.min() >= 0, staleness.describe()
assert (history["training/async/carry_over_age_max_versions"] <= 1).all()
assert tokens.age.max() <= 1 and (history["staleness/token_age_max"] <= 1).all()
assert engine.serving_version == engine.policy_version == 5
trainer.close()
print(f"max staleness {staleness.max()} ≤ 1 over {len(staleness)} rollouts; serving version {engine.serving_version}")
