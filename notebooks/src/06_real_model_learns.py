# Source of notebooks/06_real_model_learns.ipynb — edit here, then: python scripts/build_notebooks.py 06

# %% [markdown]
# # 06 · A real model learns to use a tool, on two CPU cores
#
# SmolLM2-135M-Instruct, untrained, on `calc`: questions like *What is 14 * 12?* with a
# `calculator` tool passed through the OpenAI SDK (`tools=`), two worked examples in the prompt,
# and a reward of 0.8 for the right number plus 0.2 for having called the calculator. Untrained,
# the model calls the tool in ~40 % of rollouts — often with a made-up function name or broken
# JSON — and answers directly otherwise, mostly wrong. Three runs of
#
#     agl-lab train configs/cpu_smollm2_learn.yaml --run-dir RUN agl_lab.seed=S    # S = 0, 1, 2
#
# on this project's 2-core CPU machine (LoRA rank 16 through verl's keys, the old-logprob pass
# skipped by verl's `bypass_mode`, zero-advantage micro-batches not forwarded and the shared prompt
# forwarded once per mini-batch through verl's `use_prefix_grouper`; docs/real-model.md has the
# settings and what they cost). Each run wrote `config.yaml`, `metrics.jsonl` and its validation
# rollouts (`recording/validation_*.json.gz`); those files are in
# `notebooks/recorded/smollm2_learn_fast/`, beside three earlier runs of the same config without
# the two update savings (`notebooks/recorded/smollm2_learn/`, 2026-12-01). This notebook reads
# them — it runs in seconds, trains nothing, and shows:
#
# 1. the reward and validation curves of the three seeds, and the numbers the claim rests on;
# 2. what changed in the model's behaviour: tool calls and right answers per validation;
# 3. transcripts of the same validation task before and after training;
# 4. where the time of a step went, and what the update no longer computes (against the earlier runs).
#
# The transcripts need SmolLM2's tokenizer (`./lab real-model`); without it the test suite skips
# this notebook, as it does 04.

# %%
from pathlib import Path

import pandas as pd

from agl_lab.logger import read_metrics
from agl_lab.replay import load_validation, validated_steps

pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
pd.set_option("display.max_colwidth", 90)
pd.set_option("display.precision", 3)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
RECORDED = ROOT / "notebooks" / "recorded" / "smollm2_learn_fast"
RUNS = sorted(RECORDED.glob("seed*"))
EARLIER = sorted((ROOT / "notebooks" / "recorded" / "smollm2_learn").glob("seed*"))  # padded update, 2026-12-01
print([run.name for run in RUNS])

# %% [markdown]
# ## 1 · The curves
#
# Training reward per step (16 rollouts: 4 questions × a GRPO group of 4, temperature 1) and
# validation reward (32 held-out questions, one rollout each, also at temperature 1:
# `agl_lab.server.val_temperature`) before training and every 5 steps.

# %%
def load_metrics(run: Path) -> pd.DataFrame:
    # one row per step: a validation before training shares step 0
    return pd.DataFrame(read_metrics(run / "metrics.jsonl")).groupby("step").first()


metrics = {run.name: load_metrics(run) for run in RUNS}
earlier = {run.name: load_metrics(run) for run in EARLIER}

import matplotlib.pyplot as plt  # noqa: E402

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
for (name, m), colour in zip(metrics.items(), ["C0", "C1", "C2"]):
    train = m["training/reward"].dropna()
    left.plot(train.index, train, color=colour, alpha=0.35, lw=1)
    left.plot(train.index, train.rolling(5, min_periods=1).mean(), color=colour, lw=2, label=f"{name} (mean of 5)")
    val = m["val/reward"].dropna()
    right.plot(val.index, val, "o-", color=colour, label=name)
for m in earlier.values():  # the earlier runs' validation, for comparison
    val = m["val/reward"].dropna()
    right.plot(val.index, val, "--", color="grey", alpha=0.6, lw=1)
right.plot([], [], "--", color="grey", label="earlier runs")
left.set(title="training reward per step", xlabel="step", ylabel="reward", ylim=(0, 1.02))
right.set(title="validation reward (32 held-out questions)", xlabel="step", ylim=(0, 1.02))
left.legend(), right.legend()
fig.tight_layout()

# %% [markdown]
# The claim — *mean training reward of the last 5 steps ≥ the first 5 + 0.15, and validation
# reward up, in every seed* — computed from the files. The minutes are the run's training steps
# and validations as timed by the trainer (`timing_s/step`, `timing_s/validate`): all of the run
# but loading the model (~3 s).

# %%
def summary(name: str, m: pd.DataFrame) -> dict:
    train, val = m["training/reward"].dropna(), m["val/reward"].dropna()
    seconds = m["timing_s/step"].sum() + m["timing_s/validate"].sum()
    return {"run": name, "steps": int(train.index.max()), "first 5": train.head(5).mean(),
            "last 5": train.tail(5).mean(), "gain": train.tail(5).mean() - train.head(5).mean(),
            "val before": val.iloc[0], "val after": val.iloc[-1], "minutes": seconds / 60}


table = pd.DataFrame([summary(name, m) for name, m in metrics.items()]).set_index("run")
table

# %%
# NBVAL_CHECK_OUTPUT
print("every seed: last 5 ≥ first 5 + 0.15:", bool((table["gain"] >= 0.15).all()))
print("every seed: validation reward up:", bool((table["val after"] > table["val before"]).all()))
print("every run within 45 minutes:", bool((table["minutes"] <= 45).all()))

# %% [markdown]
# ## 2 · What changed: tool calls and right answers
#
# Each validation rollout is recorded call by call, with the agent's own `task_result` event
# (its answer, whether it called the calculator). Per validation: the share of rollouts that called
# the tool and the share that were right — the model learns to call the tool, and the right
# answers follow.

# %%
def behaviour(run: Path, step: int) -> dict:
    rollouts = load_validation(run, step)
    results = [next(e["data"] for e in r.events if e["event_type"] == "task_result") for r in rollouts]
    return {"run": run.name, "step": step, "called the tool": sum(x["tool_called"] for x in results) / len(results),
            "right answer": sum(x["success"] for x in results) / len(results),
            "reward": sum(r.final_reward for r in rollouts) / len(rollouts)}


behave = pd.DataFrame([behaviour(run, step) for run in RUNS for step in validated_steps(run)])
behave.pivot(index="step", columns="run", values=["called the tool", "right answer"])

# %% [markdown]
# ## 3 · The same task, before and after
#
# One validation question of seed 0 that the untrained model got wrong and the trained one right
# (one where the untrained model began a tool call it could not finish, if there is one), as each
# handled it: each
# call's new prompt tokens (▸, only what the agent added since the previous call: the tool result)
# and the model's reply (◂), decoded with SmolLM2's tokenizer. The first call's prompt is the
# system message, the tool list and the two worked examples; it is cut in the middle.

# %%
from transformers import AutoTokenizer  # noqa: E402

from agl_lab.models import PresetNotInstalled, smollm2  # noqa: E402
from agl_lab.transcript import format_transcript  # noqa: E402

try:
    tokenizer = AutoTokenizer.from_pretrained(smollm2())
except PresetNotInstalled as err:
    raise SystemExit(f"the transcripts need SmolLM2's tokenizer: ./lab real-model\n{err}") from None

run = RUNS[0]
before, after = load_validation(run, 0), load_validation(run, validated_steps(run)[-1])
pairs = [(b, a) for b, a in zip(before, after) if a.final_reward > b.final_reward]


def tried_a_call(rollout) -> bool:  # the untrained model began a <tool_call> the engine could not parse
    return "<tool_call>" in tokenizer.decode(rollout.triplets[0].response_ids)


b, a = max(pairs, key=lambda p: (tried_a_call(p[0]), len(p[1].triplets))) if pairs else (before[0], after[0])
print("question:", b.input["question"], "· value:", b.input["value"], "\n")
print("BEFORE TRAINING ·", format_transcript(b, tokenizer, width=300), "\n")
print("AFTER TRAINING ·", format_transcript(a, tokenizer, width=300))

# %% [markdown]
# ## 4 · Where the time of a step went
#
# The trainer times each stage (`timing_s/*`, verl's names). Rollouts (`gen`) are the agents'
# calls through the gateway to the engine; `adv` builds the batch and the advantages; the actor
# update is LoRA's forward and backward passes (no old-logprob pass: bypass mode); `validate`
# runs every 5 steps. Mean seconds per step, per seed:

# %%
STAGES = ["timing_s/gen", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/step"]


def stage_means(runs: dict, label: str) -> pd.DataFrame:
    out = pd.DataFrame({f"{label} {name}": m[STAGES].mean() for name, m in runs.items()}).T
    out.columns = [c.removeprefix("timing_s/") for c in STAGES]
    out["validate (per validation)"] = [m["timing_s/validate"].mean() for m in runs.values()]
    out["minutes"] = [(m["timing_s/step"].sum() + m["timing_s/validate"].sum()) / 60 for m in runs.values()]
    return out


timing = pd.concat([stage_means(metrics, "now"), stage_means(earlier, "earlier")])
timing

# %%
ax = timing[["gen", "adv", "update_actor"]].plot.barh(stacked=True, figsize=(8, 3.2))
ax.set(xlabel="seconds per step", title="a training step, by stage: now and in the earlier runs")
ax.figure.tight_layout()

# %% [markdown]
# What the update computes, per step (the local engine's `actor/*` metrics): rows and tokens
# through the model body, the shared prefix's length, and the zero-advantage rows and
# micro-batches it did not forward (their gradient is exactly 0; the optimiser step still runs);
# and what the rollout phase computed (`rollout/*`). The earlier runs forwarded every row with
# its whole prompt: ~5,700 body tokens a step.

# %%
WORK = ["actor/diagnostic_rows", "actor/body_tokens", "actor/shared_prefix_tokens", "actor/skipped_zero_adv_rows",
        "actor/skipped_zero_adv_micro_batches", "rollout/prefill_tokens", "rollout/cached_tokens",
        "rollout/shared_prefills"]
work = pd.DataFrame({name: m[WORK].mean() for name, m in metrics.items()}).T
work.columns = [c.split("/", 1)[1] for c in WORK]
work

# %% [markdown]
# ## Run it yourself
#
#     ./lab real-model                                             # the extra + a one-time conversion
#     agl-lab train configs/cpu_smollm2_learn.yaml --run-dir runs/smollm2-seed0 agl_lab.seed=0
#
# then point `RUNS` above at your run directories. `agl_lab.compare(RUNS)` and
# `agl_lab.plot_compare(RUNS)` (notebook 05) give the mean over seeds with its standard error.
