# Source of notebooks/01_rollouts.ipynb — edit here, then: python scripts/build_notebooks.py 01

# %% [markdown]
# # 01 · Rollouts: stepping the training loop
#
# One GRPO training step of an LLM agent is three calls, and this notebook runs them one
# cell at a time on the CPU preset (the built-in tiny model learning the multi-turn
# `lookup` task; about a minute on two cores):
#
# | call | stage | what comes back |
# |---|---|---|
# | `trainer.rollout()` | the agent runs on a batch of **tasks**, `n` times each: one **group** of `n` **rollouts** per task. Every LLM call goes through the gateway, which records it as a `model_request` **event**; each call becomes a **triplet** (prompt ids, response ids + logprobs, reward) | `RolloutResult` |
# | `trainer.build_batch()` | triplets → training **rows**. At trajectory level the calls of a rollout merge into one row while each prompt extends the previous context token for token; the tokens in between are **observations** (attended, not trained) | `BatchResult` (a verl `DataProto` + views) |
# | `trainer.update()` | rollout-level GRPO advantage per group → per-rollout loss normalisation → one policy update → new weights served | `UpdateResult` |
#
# Every result displays as a summary and exposes pandas DataFrames, so each stage can be
# inspected before the next one runs. The pieces that take part, all started by the Trainer
# in this process (with `agl_lab.server.embedded=false` they are separate processes):

# %%
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from IPython.display import HTML

from agl_lab import viz
from agl_lab.tasks import get_task
from agl_lab.trainer import Trainer
from agl_lab.widgets import RolloutBrowser

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.precision", 3)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
viz.plot_architecture();

# %%
# A small batch so that the notebook runs in about a minute: 4 tasks × 4 rollouts per step.
# The warm start (a short supervised fit on well-formed transcripts, cached after the first
# run) teaches the tiny model the reply format, so rewards differ within a group.
OVERRIDES = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             f"agl_lab.model.warm_start_steps={get_task('lookup').warm_start_steps}"]
trainer = Trainer.from_config(ROOT / "configs/cpu_tiny.yaml", overrides=OVERRIDES,
                              run_dir=tempfile.mkdtemp(prefix="agl-nb01-"), console=False)
print(f"engine {trainer.cfg.agl_lab.engine} · task {trainer.cfg.agl_lab.task.name} · "
      f"{trainer.cfg.data.train_batch_size} tasks × n={trainer.cfg.actor_rollout_ref.rollout.n} rollouts per step")

# %% [markdown]
# ## 1 · `rollout()`: run the agent
#
# The trainer takes the next `train_batch_size` tasks, enqueues `n` rollouts per task
# (one group, keyed by a fresh `data_id`), and waits until every rollout is terminal. The
# runner executes the agent for each queued rollout; the agent is ordinary OpenAI-SDK code
# (`agl_lab.tasks.lookup.lookup_agent`) that talks to the gateway, never to the model
# directly. The gateway writes one `model_request` event per call with the exact token ids
# the engine saw and sampled.

# %%
ro = trainer.rollout()
ro

# %% [markdown]
# **Triplets**: one line per LLM call. A `lookup` rollout makes two or three calls (`get
# KEY`, then `answer VALUE`); the reward sits on the last call of the rollout, and
# `server_version` is the policy version of the weights that served the call.

# %%
ro.triplets.head(8)

# %%
# NBVAL_CHECK_OUTPUT
print("triplet columns:", list(ro.triplets.columns))
print("rollouts:", len(ro.rollouts), "· groups:", ro.triplets.data_id.nunique())

# %% [markdown]
# **Lifecycle**: each rollout waits in the queue until a runner claims it (`queue_wait_s`),
# then runs (`run_s`); their sum is `total_s`. A long queue wait means too few runners; a
# long tail of run times is what asynchronous rollout (section 5) is for.

# %%
ro.lifecycle[["rollout_id", "data_id", "state", "queue_wait_s", "run_s", "total_s"]].head(8)

# %%
viz.plot_lifecycle(ro.lifecycle, title="rollout lifecycle (one bar per rollout, groups adjacent)");

# %% [markdown]
# ## 2 · `build_batch()`: triplets → rows
#
# At trajectory level (`agentlightning.trace_aggregator.level: trajectory`) the calls of a
# rollout are merged into **one row** as long as each call's prompt starts, token for
# token, with the previous prompt + response. The tokens the model did not sample — the
# tool's answer, the chat-template scaffolding around it — become **observation** tokens
# inside the row's response: the model attends to them, but the loss mask
# (`response_mask`) is 0 there. When a prompt does *not* extend the context, the row ends:
# a **merge break** (notebook 02 is about those).

# %%
b = trainer.build_batch()
b

# %%
b.rows[["batch_index", "rollout_id", "n_calls", "prompt_tokens", "response_tokens", "loss_tokens",
        "observation_tokens", "reward"]].head(8)

# %% [markdown]
# The same row as the update will see it, token by token: grey = the row's prompt, green
# and underlined = model tokens (in the loss mask), orange = observation tokens (attended,
# not trained), dashed box = special tokens, `⟨pad ×N⟩` = padding folded into one mark.
# Hover a token for its position and id.

# %%
merged = b.rows[(b.rows.n_calls > 1) & (b.rows.batch_index >= 0)]
row = merged.iloc[0] if len(merged) else b.rows[b.rows.batch_index >= 0].iloc[0]
i = int(row.batch_index)
HTML(viz.render_batch_row(b.data, i, trainer.tokenizer,
                          title=f"batch row {i}: {row.n_calls} calls of one rollout, reward {row.reward:.2f}"))

# %% [markdown]
# The batch itself is a verl `DataProto`; its tensors are what the policy update consumes.

# %%
# NBVAL_CHECK_OUTPUT
for key in ["prompts", "responses", "response_mask", "attention_mask", "token_level_scores"]:
    print(f"{key:20s} dims={b.data.batch[key].dim()} dtype={b.data.batch[key].dtype}")

# %% [markdown]
# ## 3 · `update()`: advantages and who carries the loss
#
# GRPO compares the rollouts of a group: a rollout's advantage is its reward minus the
# group mean, divided by the group's standard deviation, and every trained token of the
# rollout gets that same advantage (rollout-level advantage, however many rows the rollout
# became). A **zero-advantage group** — all its rewards equal — teaches nothing. The loss
# is then normalised **per rollout**: every rollout carries the same share of it,
# `loss_weight` = 1 / (number of rollouts), split evenly over its trained tokens, so a long
# rollout does not outweigh a short one (notebook 02 compares this with token-mean).

# %%
u = trainer.update()
u

# %% [markdown]
# Reading the update: `actor/pg_loss` is close to 0 — not a sign that nothing was learnt.
# GRPO advantages sum to zero within a group, and with every rollout carrying the same loss
# weight, the policy-gradient loss at ratio 1 is Σ advantage × weight ≈ 0; its *gradient*
# is not zero, because each rollout's term pushes on different tokens. In the table below,
# `loss_weight` is a rollout's share of the loss and `signed_weight` = advantage ×
# `loss_weight`: positive rows are made more likely, negative ones less, and the column sums
# to about 0 for the same reason pg_loss does.

# %%
u.weights

# %%
ro.groups[["data_id", "n_rollouts", "rewards", "reward_mean", "reward_std", "zero_adv", "n_rows"]]

# %%
viz.plot_advantages(u.weights);

# %% [markdown]
# ## 4 · `step()`: the loop
#
# `trainer.step()` is the three calls above plus a line of metrics; `trainer.fit(n)` is
# `n` steps with a progress bar. A few steps on the CPU preset (a handful of steps is a
# demonstration of the loop, not of learning: `./lab demo` trains for longer):

# %%
history = [trainer.step() for _ in range(5)]
rewards = [b.metrics["training/reward"]] + [h["training/reward"] for h in history]
pd.DataFrame(history)[["training/reward", "training/n_sample", "actor/pg_loss", "training/policy_version"]]

# %%
viz.plot_reward_curve(rewards, window=3, title="mean training reward per step");

# %% [markdown]
# ## 5 · Asynchronous rollout: carry-over groups
#
# With `agentlightning.async_rollout.enabled=true`, `async_train_batch_size` groups are in
# flight at all times. A step trains on the first `train_batch_size` groups to finish and
# **carries the others over**, untouched, to the next step, so slow rollouts no longer
# stall the batch. A carried group was enqueued under an older policy: its *age* (in steps
# and in policy versions) is the staleness this buys.

# %%
async_trainer = Trainer.from_config(
    ROOT / "configs/cpu_tiny.yaml",
    overrides=OVERRIDES + ["agentlightning.async_rollout.enabled=true",
                           "agentlightning.async_rollout.async_train_batch_size=6"],
    run_dir=tempfile.mkdtemp(prefix="agl-nb01-async-"), console=False)
carry = []
for _ in range(3):
    m = async_trainer.step()
    step, version = async_trainer.global_step, async_trainer.engine.policy_version  # of the next step
    for g in async_trainer.async_manager.carry_over_groups():
        carry.append({"after_step": step - 1, "data_id": g["data_id"][:8], "enqueued_at_step": g["step"],
                      "age_steps": step - g["step"], "age_versions": version - g["policy_version"],
                      "n_finished": g["n_finished"], "n": g["n"]})
pd.DataFrame(carry)

# %%
# NBVAL_CHECK_OUTPUT
print("groups in flight per step :", async_trainer.cfg.agentlightning.async_rollout.async_train_batch_size)
print("groups trained per step   :", async_trainer.cfg.data.train_batch_size)
print("carry-over groups per step:", sorted({sum(1 for c in carry if c["after_step"] == s) for s in range(3)}))

# %% [markdown]
# ## 6 · Browse the rows
#
# `RolloutBrowser` shows any row of a batch: pick a group, a rollout and one of its rows.
# With a live kernel it is a widget; in a saved notebook (or without ipywidgets) it falls
# back to the static tree below.

# %%
last = trainer.build_batch()
RolloutBrowser(last, trainer.tokenizer, static_rows=3)

# %% [markdown]
# ## What this notebook claims, checked
#
# * every rollout of a step is in the batch, grouped `n` per task;
# * a row's loss mask covers exactly its model tokens: the response tokens the model
#   sampled, never the prompt, the observations or the padding;
# * each trained rollout carries the same share of the loss under per-rollout
#   normalisation, and zero-advantage groups have advantage 0;
# * async steps keep `async_train_batch_size − train_batch_size` groups in flight.

# %%
n = int(trainer.cfg.actor_rollout_ref.rollout.n)
assert len(ro.rollouts) == 4 * n and (ro.groups.n_rollouts == n).all()

# loss mask == model tokens, row by row, recomputed from the rollouts' own triplets
for _, r in b.rows[b.rows.batch_index >= 0].iterrows():
    mask = b.data.batch["response_mask"][int(r.batch_index)]
    attention = b.data.batch["attention_mask"][int(r.batch_index), b.data.batch["prompts"].shape[1]:]
    rollout = next(x for x in ro.rollouts if x.rollout_id == r.rollout_id)
    sampled = sum(len(t.response_ids) for t in rollout.triplets[r.first_call:r.last_call + 1])
    assert int(mask.sum()) == r.loss_tokens == sampled
    assert int(attention.sum()) == r.response_tokens == r.loss_tokens + r.observation_tokens
    assert not (mask.bool() & ~attention.bool()).any()  # never on padding

trained = u.weights[u.weights.loss_tokens > 0]
assert np.allclose(trained.loss_weight, trained.loss_weight.iloc[0])
zero = set(ro.groups.data_id[ro.groups.zero_adv])
assert np.allclose(u.weights[u.weights.data_id.isin(zero)].advantage, 0.0)
assert all(c["n"] == n for c in carry) and {c["after_step"] for c in carry} == {0, 1, 2}
async_trainer.close()
trainer.close()
print("all claims hold")
