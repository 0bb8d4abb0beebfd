"""Plots for notebooks and the demo (matplotlib, headless-safe)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np


def _pyplot():
    import matplotlib

    if not os.environ.get("DISPLAY") and "ipykernel" not in __import__("sys").modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (shorter at the start), same length."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return x
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def plot_reward_curve(rewards: Sequence[float], *, window: int = 10, path: str | os.PathLike | None = None,
                      title: str = "training reward", ax=None):
    """Per-step mean reward with a trailing moving average. Saves a PNG when `path` is given."""
    plt = _pyplot()
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
    steps = np.arange(len(rewards))
    ax.plot(steps, rewards, color="#9ab", lw=1, marker=".", label="per step")
    ax.plot(steps, moving_average(rewards, window), color="#c33", lw=2, label=f"moving avg ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    if path is not None:
        ax.figure.tight_layout()
        ax.figure.savefig(path)
        if own:
            plt.close(ax.figure)
        return Path(path)
    return ax
