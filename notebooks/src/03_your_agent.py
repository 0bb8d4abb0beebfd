# Source of notebooks/03_your_agent.ipynb — edit here, then: python scripts/build_notebooks.py 03

# %% [markdown]
# # 03 · Your own agent: write it, register it, warm-start it, train it
#
# Notebooks 01 and 02 train the built-in `lookup` agent. This one trains an agent written
# here, in a cell, with its own reward — the path from an idea to a training run. The
# **agent contract** is one function:
#
# ```python
# def agent(task: dict, ctx) -> float | None: ...
# ```
#
# | `ctx` field | what it is |
# |---|---|
# | `ctx.openai_client()` | an `openai.OpenAI` client bound to this rollout's gateway URL: every call is recorded (token ids, logprobs) and served by the policy being trained. Any `model=` name reaches the served model. |
# | `ctx.base_url`, `ctx.api_key` | the same URL and key, for any other OpenAI-compatible client (LangChain, LiteLLM, raw HTTP) |
# | `ctx.emit(type, data)` | record an event of this rollout in the store (a reward, a note to tabulate later) |
# | `ctx.rollout_id`, `ctx.is_train` | which rollout this is; `False` during validation |
#
# Return the reward as a float (or `None` and emit a `reward` event yourself). An exception
# fails the rollout; its message shows in the step's warning and in `ro.lifecycle`.

# %%
import random
import tempfile
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from agl_lab import config
from agl_lab.tasks import Task, register_task
from agl_lab.trainer import Trainer

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.precision", 3)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()

# %% [markdown]
# ## 1 · The agent: two calls, its own reward
#
# The task: the user names a colour; the agent must say it, hear "again", and say it once
# more. Two model calls per rollout with an observation between them — the smallest
# multi-turn shape — and a reward of 0.5 per correct reply. The model is the built-in tiny
# model (0.46 M parameters): it can learn to copy a word it has seen, not to reason; keep
# tasks for it to a few tokens.

# %%
WORDS = ["red", "blue", "green", "apple", "banana", "paris", "london", "tokyo"]
SYSTEM = "Say the word twice."


def make_tasks(n, seed):
    rng = random.Random(seed)
    return [{"word": rng.choice(WORDS)} for _ in range(n)]


def echo_reward(task, replies):
    return 0.5 * sum(reply.strip() == task["word"] for reply in replies)


def echo_agent(task, ctx):
    client = ctx.openai_client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["word"]}]
    replies = []
    for _ in range(2):
        reply = client.chat.completions.create(model="my-echo-agent", messages=messages, max_tokens=4)
        text = reply.choices[0].message.content or ""
        replies.append(text)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    ctx.emit("replies", {"replies": replies})  # tabulated below
    return echo_reward(task, replies)


# %% [markdown]
# ## 2 · Register it as a task, with demonstrations for the warm start
#
# A fresh tiny model emits byte soup: every rollout would score 0 and GRPO would see no
# signal. A **warm start** fits the model on a few hundred demonstration transcripts first
# (cached after the first run, keyed by the demonstrations). Here a quarter of them answer
# the second turn with a wrong word, so the model starts able but imperfect and RL has
# something to improve. `register_task` makes the task a config value
# (`agl_lab.task.name=echo`), exactly like the built-in `lookup`.

# %%
def demonstrations(n, seed):
    rng = random.Random(seed)
    out = []
    for task in make_tasks(n, seed + 1):
        second = rng.choice(WORDS) if rng.random() < 0.25 else task["word"]
        out.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["word"]},
                    {"role": "assistant", "content": task["word"]}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": second}])
    return out


register_task(Task(name="echo", agent=echo_agent, train_tasks=make_tasks,
                   val_tasks=lambda n, seed: make_tasks(n, seed + 1000), demonstrations=demonstrations,
                   description="say a word twice"))

OVERRIDES = ["agl_lab.task.name=echo", "agl_lab.task.n_train=64", "agl_lab.task.n_val=8",
             "agl_lab.model.warm_start_steps=60", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
trainer = Trainer.from_config(ROOT / "configs/cpu_tiny.yaml", overrides=OVERRIDES,
                              run_dir=tempfile.mkdtemp(prefix="agl-nb03-"), console=False)
trainer

# %% [markdown]
# ## 3 · `dry_run`: one rollout, as text, before training
#
# Agent Lightning's `dev()` equivalent: the agent runs once against the engine, and the
# transcript shows each call's *new* prompt tokens (`▸`, after the context the previous
# call ended with) and the reply (`◂`), with token counts and the reward. Check this first:
# a prompt that "does not extend the previous context" is a merge break (notebook 02).

# %%
dry = trainer.dry_run()

# %% [markdown]
# ## 4 · Train a handful of steps
#
# `fit(n)` runs `n` steps (rollout → build_batch → update) and writes the reward curve to the
# run directory; `trainer.metrics` is every logged step as a DataFrame. Five steps show the
# loop, not learning: `agl-lab train` runs for longer.

# %%
trainer.fit(5, progress=False)
trainer.metrics[["training/reward", "training/n_sample_trained", "training/n_failed_rollouts",
                 "actor/pg_loss", "training/policy_version"]]

# %%
trainer.plot_metrics();

# %% [markdown]
# ## 5 · Inspect: triplets, rows, breaks, the events the agent emitted
#
# One more rollout phase and batch, stage by stage, to look at what the agent produced.

# %%
ro = trainer.rollout()
b = trainer.build_batch()
ro

# %%
ro.triplets[["rollout_id", "call", "prompt_tokens", "response_tokens", "reward", "server_version"]].head(6)

# %%
b.rows[["rollout_id", "n_calls", "prompt_tokens", "response_tokens", "loss_tokens",
        "observation_tokens", "reward"]].head(6)

# %%
replies = pd.DataFrame([{"rollout_id": r.rollout_id[:8], "word": r.input["word"],
                         "replies": e["data"]["replies"], "reward": r.final_reward}
                        for r in ro.rollouts for e in r.events if e.get("event_type") == "replies"])
replies.head(8)

# %% [markdown]
# Breaks, if any: an append-only agent like this one merges its two calls into one row
# unless the chat API re-encodes a reply to other token ids (retokenization, notebook 02).

# %%
b.breaks[["rollout_id", "call", "kind", "reason"]].head(4)

# %%
u = trainer.update()
u

# %% [markdown]
# ## 6 · The same agent on the verl engine
#
# Nothing in the agent or the task depends on the engine. On a GPU machine (see the README
# for the install), the same registered task trains under verl with FSDP and vLLM by
# switching the config: `configs/gpu_verl.yaml` sets `agl_lab.engine: verl` and a Hugging
# Face model. Here we only compose that config, to show which keys change:
#
# ```python
# trainer = Trainer.from_config("configs/gpu_verl.yaml", overrides=["agl_lab.task.name=echo",
#                                                                    "agl_lab.model.warm_start_steps=0"])
# ```
#
# (A real model needs no warm start: it can already follow the instruction.) From the
# command line, an agent in a module of yours is `agl_lab.agent=my_module:echo_agent`.

# %%
# NBVAL_CHECK_OUTPUT
verl_cfg = config.load_config(ROOT / "configs/gpu_verl.yaml",
                              ["agl_lab.task.name=echo", "agl_lab.model.warm_start_steps=0"])
for key in ["agl_lab.engine", "agl_lab.model.path", "agl_lab.task.name", "actor_rollout_ref.rollout.n"]:
    print(f"{key:30s} cpu_tiny={OmegaConf.select(trainer.cfg, key)!s:12s} "
          f"gpu_verl={OmegaConf.select(verl_cfg, key)}")

# %% [markdown]
# ## What this notebook claims, checked
#
# * a task registered here is a config value like `lookup`, and its demonstrations
#   warm-start the model (it earns reward from the first step: byte soup would score 0);
# * the agent's own reward is the rollout's reward, and its emitted events are in the store;
# * the dry run is one rollout with the agent's two calls;
# * the trainer took the steps it was asked for, and each of its rows trains exactly the
#   tokens the model sampled.

# %%
assert trainer.task.name == "echo" and trainer.agent is echo_agent
assert len(dry.triplets) == 2 and dry.final_reward is not None
# warm start: a cold model's byte soup scores 0 on every one of the 80 rollouts of the 5 steps
assert trainer.metrics["training/reward"].mean() > 0.1
for r in ro.rollouts:
    (event,) = [e for e in r.events if e.get("event_type") == "replies"]
    assert r.final_reward == echo_reward(r.input, event["data"]["replies"])
assert list(trainer.metrics.index) == [1, 2, 3, 4, 5] and not u.skipped  # verl's 1-based global_steps
for _, row in b.rows[b.rows.batch_index >= 0].iterrows():
    rollout = next(x for x in ro.rollouts if x.rollout_id == row.rollout_id)
    assert row.loss_tokens == sum(len(t.response_ids) for t in rollout.triplets[row.first_call:row.last_call + 1])
trainer.close()
print("all claims hold")
