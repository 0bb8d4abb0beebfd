# Source of notebooks/08_environments.ipynb — edit here, then: python scripts/build_notebooks.py 08

# %% [markdown]
# # 08 · Environments from the field: a GEM game, turn by turn
#
# `agl_lab.task.name=gem:<env id>` turns any GEM text environment into a task with a built-in
# multi-turn agent; `reasoning_gym:<dataset>` does the same for reasoning-gym's datasets
# ([docs/environments.md](../docs/environments.md)). This notebook plays GEM's
# `game:GuessTheNumber-v0-easy` with the tiny model and shows one episode the way the learning
# side sees it: the calls, the per-turn rewards, the merged row with its observation tokens
# masked, and what per-turn credit (`agl_lab.algorithm.turn_credit=return`) makes of it.
#
# Each step of the game is one model call through the gateway; the game's answer becomes the
# next user message; each step's reward is a `turn_reward` event and the rollout's reward is
# their sum. The tiny model is warm-started on episodes played with the game's own random
# moves, so it knows the move format (`\boxed{N}`) and plays several turns — poorly.

# %%
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import HTML

from agl_lab import viz
from agl_lab.trainer import Trainer

pd.set_option("display.width", 160)
pd.set_option("display.max_colwidth", 70)
pd.set_option("display.precision", 3)
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
RUN = Path(tempfile.mkdtemp(prefix="agl-nb08-")) / "run"

GAME = "game:GuessTheNumber-v0-easy"
overrides = [
    f"agl_lab.task.name=gem:{GAME}",
    "agl_lab.task.max_turns=3",
    "agl_lab.task.n_train=16",
    "agl_lab.task.n_val=4",
    "agl_lab.model.warm_start_steps=60",  # the move format, from random-move episodes
    "agl_lab.server.token_preserving=true",  # earlier turns keep the sampled token ids
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "agl_lab.runner.concurrency=8",
    "agentlightning.trace_aggregator.trajectory_max_prompt_length=1024",
    "agentlightning.trace_aggregator.trajectory_max_response_length=512",
    "data.max_prompt_length=1024",  # transition level (section 3): one call's prompt, the instructions included
]
trainer = Trainer.from_config(ROOT / "configs/cpu_tiny.yaml", overrides=overrides, run_dir=RUN, console=False)
rollouts = trainer.rollout()

# %% [markdown]
# ## 1 · The episodes and their turn rewards
#
# One line per rollout: how many calls it made, the reward of each turn (the `turn_reward`
# events, attached to the call before them) and the rollout's reward, their sum. GEM's
# GuessTheNumber (gem-llm 0.1.0) gives 0 for a valid guess that misses (and for a repeated or
# out-of-range one), −0.1 for a malformed move — which also ends the episode — and 1 for the right
# number. After its short warm start the tiny model still writes many malformed moves: about one
# episode in three gets past its first move.

# %%
episodes = pd.DataFrame(
    [
        {
            "rollout_id": r.rollout_id[:8],
            "task": r.data_id,
            "calls": len(r.triplets),
            "turn_rewards": [t.turn_reward for t in r.triplets],
            "reward": r.final_reward,
        }
        for r in rollouts.rollouts
    ]
)
episodes

# %% [markdown]
# ## 2 · One row per rollout, observations masked
#
# In token-preserving mode every call's prompt extends the previous context exactly, so each
# episode merges into a single training row: `loss_tokens` are the model's moves,
# `observation_tokens` the game's answers in between (attended, not trained).

# %%
b = trainer.build_batch(rollouts)
b.rows[["batch_index", "rollout_id", "n_calls", "prompt_tokens", "loss_tokens", "observation_tokens", "reward"]]

# %%
print(f"{len(b.rows)} rows for {len(rollouts.rollouts)} rollouts, {len(b.breaks)} merge breaks")
longest = b.rows[b.rows.batch_index >= 0].sort_values("n_calls", ascending=False).iloc[0]
i = int(longest.batch_index)
HTML(viz.render_batch_row(b.data, i, trainer.tokenizer,
                          title=f"batch row {i}: {longest.n_calls} calls of one episode, reward {longest.reward:.2f}"))

# %% [markdown]
# ## 3 · Per-turn credit
#
# By default every row of a rollout carries the rollout's reward. With
# `agl_lab.algorithm.turn_credit=return` each transition (one row per call:
# `trace_aggregator.level=transition`) carries its own discounted return
# G_t = r_t + γ·G_{t+1}, so a turn is credited for what happened from it on. The same rollouts,
# rebuilt both ways (γ = 0.9):

# %%
rollout_level = trainer.build_batch(rollouts, level="transition")
turn_level = trainer.build_batch(rollouts, level="transition", turn_credit="return", turn_gamma=0.9)
pd.DataFrame(
    {
        "rollout_id": [r.rollout_id[:8] for r in turn_level.built.rows],
        "call": [r.calls[0] for r in turn_level.built.rows],
        "turn_reward": [
            next(x for x in rollouts.rollouts if x.rollout_id == r.rollout_id).triplets[r.calls[0]].turn_reward
            for r in turn_level.built.rows
        ],
        "reward (turn_credit=rollout)": [r.reward for r in rollout_level.built.rows],
        "reward (turn_credit=return)": [r.reward for r in turn_level.built.rows],
    }
)

# %%
trainer.close()
