# Source of notebooks/02_merge_debug.ipynb — edit here, then: python scripts/build_notebooks.py 02

# %% [markdown]
# # 02 · Merge debugging: why rows break and what to do
#
# At trajectory level the calls of a rollout are merged into one training **row** while
# each call's prompt is an exact token-prefix extension of the previous context (prompt +
# response). When it is not, the running row ends and a new one starts: a **merge break**.
# A break costs compute (the shared history is encoded again in the new row) and often
# reveals a train/inference mismatch (the model is trained on prompt tokens it never saw).
#
# `build_batch` explains every break: the first divergent token, both sides decoded around
# it, and a class:
#
# | class | what happened | typical cause | what to do |
# |---|---|---|---|
# | `retokenization` | the text is the same, the ids differ | the chat API re-encodes the model's reply (byte-level BPE picks other merges than were sampled) | the token-preserving gateway (`agl_lab.server.token_preserving=true`) |
# | `template` | only earlier *model* text changed | a chat template that re-renders old turns (drops `<think>` reasoning) | a template that keeps history, or train at transition level |
# | `history_edit` | context text removed or rewritten | the agent edits its memory (sliding window, summaries, truncated tool output) | transition level, or `multi_segment` |
# | `other` | most of the opening is gone | a different conversation (sub-agent, new episode) | `multi_segment=true` keeps one open row per conversation |
#
# This notebook runs three agents on the same `lookup` tasks (`agl_lab.tasks.merge_breakers`),
# each breaking the merge in its own way, then diagnoses the breaks and compares the two
# aggregation levels.

# %%
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from IPython.display import HTML

from agl_lab import viz
from agl_lab.algorithms import rollout_weights_table
from agl_lab.diagnose import KINDS
from agl_lab.engines.warmstart import warm_start
from agl_lab.tasks import get_task, lookup
from agl_lab.trainer import Trainer

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.max_colwidth", 60)
pd.set_option("display.precision", 3)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()

# %% [markdown]
# ## 1 · Four agents, one task
#
# | agent | between two calls it … |
# |---|---|
# | `append_only` | appends the reply and the observation (the default agent) |
# | `reasoning_dropping` | thinks in `<think>…</think>`, and strips that reasoning from earlier replies, as Qwen3's chat template does |
# | `history_editing` | rewrites its system message after the first call (offers only `answer`), as agents that change their tool list do |
# | `verifying` | asks a *sub-agent* — the same model in a separate conversation — to check each observation before it goes on; defined below |
#
# One trainer runs them all: each task carries the name of the agent that plays it, and a
# three-line dispatcher picks the agent. The first three come with the `lookup` task
# (`agl_lab.tasks.merge_breakers`); the fourth shows how little it takes to write one.

# %%
spec = get_task("lookup")


def verifying_agent(task, ctx):
    """The append-only agent, plus one sub-agent call per observation (its own conversation)."""
    client = lookup.openai_client(ctx)

    def check_then_append(sent, reply, observation):
        lookup.chat(client, [{"role": "system", "content": "Check the value."},
                             {"role": "user", "content": f"Is {observation} right?"}])
        return lookup.append_turn(sent, reply, observation)

    return lookup.finish(task, ctx, lookup.play(task, ctx, next_messages=check_then_append))


AGENTS = {**spec.agents, "verifying": verifying_agent}


def agent(task, ctx):
    return AGENTS[task["agent"]](task, ctx)


def tasks_for(names, seed):
    """Two tasks per agent name, each tagged with the agent that plays it."""
    return [{**t, "agent": name} for name, t in zip(np.repeat(names, 2), spec.train_tasks(2 * len(names), seed=seed))]


trainer = Trainer.from_config(
    ROOT / "configs/cpu_tiny.yaml",
    overrides=["actor_rollout_ref.rollout.n=4", "agl_lab.model.warm_start_steps=0"],
    agent=agent, train_dataset=tasks_for(list(AGENTS), 3),
    run_dir=tempfile.mkdtemp(prefix="agl-nb02-"), console=False)
print(f"{len(AGENTS)} agents · 2 tasks each · n={trainer.cfg.actor_rollout_ref.rollout.n} rollouts per task")

# %% [markdown]
# **First, a cold model.** Retokenization needs a model that samples token splits the
# tokenizer would not produce itself (`"get"` as `"g"`,`"et"`). A fresh model does that
# all the time, so the append-only agent runs once on the model *before* its warm start.
# The warm start (a short supervised fit on well-formed transcripts, cached after the first
# run) then teaches the format: `get KEY`, `answer VALUE`, and `<think>` blocks when asked.

# %%
cold = trainer.rollout(tasks_for(["append_only"], 5))
warm_start(trainer.engine.model, trainer.tokenizer, spec, steps=spec.warm_start_steps, seed=0)
ro = trainer.rollout(tasks_for(list(AGENTS), 3))
agent_of = {r.rollout_id: r.input["agent"] for r in ro.rollouts}
agent_of.update({r.rollout_id: "append_only (cold)" for r in cold.rollouts})
NAMES = ["append_only (cold)", *AGENTS]
ro

# %% [markdown]
# ## 2 · The breaks table
#
# One line per merge break: the rollout, the call whose prompt did not extend the row
# (`call`) and the call it was measured against (`against_call`), the class, the
# reason in words and the position of the first divergent token.

# %%
b, b_cold = trainer.build_batch(ro), trainer.build_batch(cold)
breaks = pd.concat([b_cold.breaks, b.breaks], ignore_index=True)
breaks = breaks.assign(agent=breaks.rollout_id.map(agent_of))
breaks[["agent", "rollout_id", "call", "against_call", "kind", "first_divergent_token", "reason"]]

# %%
# NBVAL_CHECK_OUTPUT
print("diagnosis classes:", list(KINDS))
print("a break is located by:", [c for c in b.breaks.columns if c.startswith(("call", "against", "first"))])

# %%
triplets = pd.concat([cold.triplets, ro.triplets]).assign(agent=lambda d: d.rollout_id.map(agent_of))
by_agent = pd.crosstab(breaks.agent, breaks.kind).reindex(index=NAMES, columns=list(KINDS), fill_value=0)
by_agent.insert(0, "later calls", triplets.groupby("agent").size() - triplets.groupby("agent").rollout_id.nunique())
by_agent

# %% [markdown]
# `later calls` counts the calls that could have merged (every call but a rollout's first).
# Each agent leaves its own signature. The cold model's replies re-encode to other ids
# (retokenization); once warm, the append-only agent merges (nearly) every call. Dropping old
# reasoning changes only model text (template). Rewriting the system message removes
# context text the model saw (history edit). The verifying agent's sub-agent call is a
# different conversation (other). Its main conversation's next call is then measured
# against the sub-agent's row, the only row left open, and that comparison says `other` or
# `history_edit` depending on how much text the two conversations share (the observation
# is in both): a diagnosis is always relative to the row the call failed to extend.

# %% [markdown]
# ## 3 · A break of each class, token by token
#
# `A` is the previous context (the row so far), `B` the prompt of the call that broke it.
# Grey tokens are shared, the first divergent token is red on both sides, the rest of the
# window is pink; the *decoded* column shows the window's text, and the notes below say
# what `A` lost and `B` gained.

# %%
shown = breaks.drop_duplicates("kind").set_index("kind").reindex([k for k in KINDS if k in set(breaks.kind)])
HTML("".join(viz.render_token_diff_html(m, title=f"{m.agent} · rollout {m.rollout_id[:8]} · call {m.call}")
             for _, m in shown.reset_index().iterrows()))

# %% [markdown]
# ## 4 · What if: the same rollouts at another level
#
# `build_batch` takes the aggregation options as arguments, so the same rollouts can be
# re-aggregated without running anything again. At **transition** level every call is its
# own row; with **multi_segment** the trajectory merge keeps one open row per conversation,
# so a call extends whichever open row its prompt continues. Compare, per agent: rows,
# trained tokens (the loss mask) and the tokens a forward pass has to process (prompt +
# response of every row).

# %%
levels = {"trajectory": b, "transition": trainer.build_batch(ro, level="transition"),
          "multi_segment": trainer.build_batch(ro, multi_segment=True)}


def level_table(batch):
    rows = batch.rows[batch.rows.batch_index >= 0].assign(agent=lambda d: d.rollout_id.map(agent_of))
    rows = rows.assign(forward_tokens=rows.prompt_tokens + rows.response_tokens)
    return rows.groupby("agent")[["loss_tokens", "forward_tokens"]].sum().assign(
        rows=rows.groupby("agent").size()).reindex(list(AGENTS))


compare = pd.concat({level: level_table(x) for level, x in levels.items()}, axis=1)
compare

# %% [markdown]
# The trained tokens are the same everywhere (the same sampled replies carry the loss);
# what merging saves is forward-pass work: a merged row encodes the shared history once.
# The warm append-only agent merges almost everything; the template and history-edit
# agents save only where a third call merges again; the verifying agent's interleaved
# conversations merge only with `multi_segment` (`agentlightning.trace_aggregator.multi_segment=true`).
# An agent that breaks every call gets nothing from trajectory level: for it transition
# level is the honest choice.

# %% [markdown]
# ## 5 · Who carries the loss: token-mean vs per-rollout mean
#
# Under verl's default `token-mean`, every trained token of the batch weighs the same, so
# a rollout's share of the loss grows with its length: here the reasoning agent's rollouts,
# three times longer, weigh three times more. agl_lab's `per_rollout_mean` (Eq. 16 of the
# [Agent Lightning v1 technical report](https://arxiv.org/abs/2608.17528); AGL v1 divided by
# rows instead: [agent-lightning#593](https://github.com/microsoft/agent-lightning/issues/593))
# gives every rollout the same share, however many tokens or rows it has, at either level. `rollout_weights_table` computes each rollout's share from the batch itself.

# %%
token_mean = rollout_weights_table(b.data, loss_mode="vanilla", loss_agg_mode="token-mean")
per_rollout = rollout_weights_table(b.data, loss_mode="per_rollout_mean", divisor="rollouts")
weights = token_mean[["rollout_id", "n_rows", "loss_tokens", "loss_weight"]].merge(
    per_rollout[["rollout_id", "loss_weight"]], on="rollout_id", suffixes=(" token-mean", " per-rollout mean"))
weights.assign(agent=weights.rollout_id.map(agent_of)).sort_values("loss_tokens").iloc[::4]

# %%
every_other = token_mean.sort_values("loss_tokens").iloc[::2]  # bars in order of length
viz.plot_loss_weights({"token-mean": every_other, "per-rollout mean": per_rollout},
                      title="share of the loss per rollout (every other rollout, by length)");

# %% [markdown]
# ## What this notebook claims, checked
#
# * every merge break has a class, each agent's breaks have the class its history function
#   implies (plus retokenization, which any reply can cause), every history-editing and
#   verifying rollout breaks at its second call, and each of the four classes occurs;
# * all three aggregations train exactly the same tokens; merging never needs more forward
#   tokens than transition level, and multi_segment gives the verifying agent fewer rows;
# * under per-rollout mean every rollout carries 1 / (number of rollouts) of the loss at
#   both levels; under token-mean the share is proportional to the rollout's tokens.

# %%
# Retokenization can come on top of any agent's own signature (a later call's reply re-encodes).
expected = {"append_only (cold)": set(), "append_only": set(), "reasoning_dropping": {"template"},
            "history_editing": {"history_edit"}, "verifying": {"other", "history_edit"}}
assert breaks.kind.isin(KINDS).all() and breaks.first_divergent_token.notna().all()
for name, kinds in expected.items():
    found = set(breaks[breaks.agent == name].kind)
    assert found <= kinds | {"retokenization"}, (name, found)
for name in ["history_editing", "verifying"]:  # both change the conversation before the second call
    multi_call = {r.rollout_id for r in ro.rollouts if agent_of[r.rollout_id] == name and len(r.triplets) > 1}
    second = breaks[(breaks.agent == name) & (breaks.call == 1)]
    assert multi_call and multi_call == set(second.rollout_id)
    assert set(second.kind) == ({"other"} if name == "verifying" else expected[name])
assert set(breaks.kind) == set(KINDS)  # a break of each class was shown above
assert (breaks.agent == "append_only (cold)").any()  # a fresh model's samples re-encode differently

for level in ["trajectory", "multi_segment"]:
    assert (compare[(level, "loss_tokens")] == compare[("transition", "loss_tokens")]).all()
    assert (compare[(level, "forward_tokens")] <= compare[("transition", "forward_tokens")]).all()
assert compare.loc["verifying", ("multi_segment", "rows")] < compare.loc["verifying", ("trajectory", "rows")]

n_rollouts = len(ro.rollouts)
for batch in levels.values():
    w = rollout_weights_table(batch.data, loss_mode="per_rollout_mean", divisor="rollouts")
    assert np.allclose(w.loss_weight, 1 / n_rollouts)
assert np.allclose(token_mean.loss_weight, token_mean.loss_tokens / token_mean.loss_tokens.sum())
trainer.close()
print("all claims hold")
