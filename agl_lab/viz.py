"""Pictures of a training step: matplotlib plots and HTML token renderings for notebooks.

Two kinds of output, both readable in a notebook that is opened without a kernel:

* **Plots** (matplotlib, headless-safe): the reward curve with a trailing moving average,
  rollout lifecycle timings (per-rollout bars or histograms), the distribution of
  per-rollout advantages, and the loss weight each rollout carries under two loss settings.
  Each takes a DataFrame of `agl_lab.views` / `UpdateResult` and returns its `Axes`, or
  the PNG path when `path=` is given.
* **Token renderings** (plain HTML strings): a row token by token, coloured by *kind*, and
  the token-level diff of a merge break. Jupyter sanitises the HTML of untrusted notebooks
  and drops ``<style>`` blocks, so every span carries an inline ``style`` (colours survive)
  *and* a class (semantics survive, tests read them). Everything the model or the agent
  wrote is escaped, special tokens such as ``<|im_end|>`` included.

Token kinds of a row (one class per token, ``agl-<kind>``):

| kind          | tokens                                                 | loss |
|---------------|--------------------------------------------------------|------|
| `prompt`      | the row's prompt (system, task, template scaffolding)  | 0    |
| `model`       | sampled by the model (`response_mask` = 1)             | 1    |
| `observation` | inside the response but not sampled (tool results …)   | 0    |
| `pad`         | padding (`attention_mask` = 0)                         | 0    |

A token in the tokenizer's special set (``<|im_start|>``, ``<|im_end|>`` …) keeps its kind
and also gets ``agl-special`` (boxed); every token with loss 1 gets ``agl-loss``
(underlined), so the loss mask is visible at a glance and checkable in the HTML.
"""

from __future__ import annotations

import html
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agl_lab.diagnose import WINDOW, decode_ids

TOKEN_KINDS = ("prompt", "model", "observation", "pad")
_STYLE = {  # inline CSS per kind; only properties the Jupyter sanitiser keeps
    "prompt": "background-color:#e8edf3;color:#24292f",
    "model": "background-color:#c9f0d3;color:#0b3d1a",
    "observation": "background-color:#ffe2b8;color:#4a2a00",
    "pad": "background-color:#f6f6f6;color:#aaaaaa",
}
_LOSS_STYLE = "border-bottom:2px solid #1a7f37"
_SPECIAL_STYLE = "outline:1px dashed #8250df;font-style:italic"
_TOKEN_STYLE = "border-radius:2px;padding:0 1px;margin:0 1px 0 0"
_BOX_STYLE = (
    "font-family:monospace;font-size:12px;line-height:1.9;white-space:pre-wrap;word-break:break-all;max-width:100%"
)
_KIND_COLOURS = {"retokenization": "#0969da", "template": "#8250df", "history_edit": "#cf222e", "other": "#6e7781"}


# =========================================================================== plots


def _pyplot():
    import matplotlib

    if not os.environ.get("DISPLAY") and "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(ax, figsize=(6, 3.2)):
    """(plt, ax, own): a fresh figure unless the caller passed an Axes."""
    plt = _pyplot()
    if ax is not None:
        return plt, ax, False
    _, ax = plt.subplots(figsize=figsize, dpi=110)
    return plt, ax, True


def _finish(plt, ax, own: bool, path):
    """Save to `path` (closing a figure we own) and return the Path; else return the Axes."""
    if path is None:
        return ax
    ax.figure.tight_layout()
    ax.figure.savefig(path)
    if own:
        plt.close(ax.figure)
    return Path(path)


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (shorter at the start), same length."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return x
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def plot_reward_curve(
    rewards: Sequence[float],
    *,
    window: int = 10,
    path: str | os.PathLike | None = None,
    title: str = "training reward",
    ax=None,
    steps: Sequence[int] | None = None,
    val: Mapping[int, float] | None = None,
):
    """Per-step mean reward with a trailing moving average. Saves a PNG when `path` is given.

    `steps` [len(rewards)]: the step of each reward (default 0, 1, …); `val`: `{step: val
    reward}` drawn as points where validation ran.
    """
    plt, ax, own = _axes(ax)
    steps = np.arange(len(rewards)) if steps is None else np.asarray(steps)
    ax.plot(steps, rewards, color="#9ab", lw=1, marker=".", label="per step")
    ax.plot(steps, moving_average(rewards, window), color="#c33", lw=2, label=f"moving avg ({window})")
    if val:
        ax.plot(list(val), list(val.values()), color="#2a7", lw=1.5, marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _finish(plt, ax, own, path)


def plot_run_metrics(metrics, path: str | os.PathLike | None = None):
    """`plot_reward_curve` of a run's metrics frame (`Trainer.metrics`: indexed by step,
    `training/reward` and, where validation ran, `val/reward`); None before the first step."""
    if "training/reward" not in metrics:
        return None
    train = metrics["training/reward"].dropna()
    val = metrics["val/reward"].dropna() if "val/reward" in metrics else None
    return plot_reward_curve(
        train.to_numpy(),
        steps=train.index.to_numpy(),
        path=path,
        val=None if val is None or val.empty else val.to_dict(),
        window=max(1, min(10, len(train) // 3)),
    )


_LIFECYCLE = (("queue_wait_s", "queue wait", "#f0a040"), ("run_s", "run", "#3a7bd5"), ("total_s", "total", "#555555"))


def plot_lifecycle(
    lifecycle, *, kind: str = "bars", ax=None, path: str | os.PathLike | None = None, title: str = "rollout lifecycle"
):
    """Queue wait / run / total time per rollout, from `lifecycle_df` (or `RolloutResult.lifecycle`).

    kind="bars": one horizontal bar per rollout, queue wait then run stacked (their sum is
    the total), rollouts of a group adjacent. kind="hist": the three distributions overlaid.
    Missing timestamps (NaN) count as 0 in the bars and are left out of the histograms.
    """
    missing = {c for c, _, _ in _LIFECYCLE} - set(getattr(lifecycle, "columns", []))
    if missing:
        raise ValueError(
            f"plot_lifecycle: lifecycle frame lacks columns {sorted(missing)}; "
            "pass agl_lab.views.lifecycle_df(rollouts) or RolloutResult.lifecycle"
        )
    if kind not in ("bars", "hist"):
        raise ValueError(f"plot_lifecycle: kind must be 'bars' or 'hist', got {kind!r}")
    plt, ax, own = _axes(ax, figsize=(6, 0.6 + 0.22 * max(len(lifecycle), 4)) if kind == "bars" else (6, 3))
    if kind == "bars":
        y = np.arange(len(lifecycle))[::-1]
        wait = lifecycle["queue_wait_s"].fillna(0).to_numpy(float)
        run = lifecycle["run_s"].fillna(0).to_numpy(float)
        ax.barh(y, wait, color=_LIFECYCLE[0][2], label="queue wait")
        ax.barh(y, run, left=wait, color=_LIFECYCLE[1][2], label="run")
        labels = [f"{str(g)[:6]}·{str(r)[:6]}" for g, r in zip(lifecycle["data_id"], lifecycle["rollout_id"])]
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_ylabel("group·rollout")
    else:
        for column, label, colour in _LIFECYCLE:
            values = lifecycle[column].dropna().to_numpy(float)
            if len(values):
                ax.hist(values, bins=min(20, max(len(values), 1)), alpha=0.55, color=colour, label=label)
        ax.set_ylabel("rollouts")
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="x")
    if kind == "bars":  # outside the axes: the legend never covers a bar
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize=8, loc="upper right")
    return _finish(plt, ax, own, path)


def plot_architecture(
    *, ax=None, path: str | os.PathLike | None = None, title: str = "one training step: who talks to whom"
):
    """The execution side around the Trainer, as boxes and arrows (matplotlib, no data).

    agent (run by the runner, one per rollout) → gateway → engine; the gateway records each
    call as an event in the store; the trainer enqueues rollouts in the store and reads the
    finished ones back, then updates the engine's weights.
    """
    plt, ax, own = _axes(ax, figsize=(7.5, 4.0))
    boxes = {  # name: (x, y, label, colour)
        "trainer": (0.12, 0.68, "Trainer\nrollout · build_batch\n· update", "#dbeafe"),
        "runner": (0.48, 0.68, "runner\nclaims queued rollouts", "#e0e7ff"),
        "engine": (0.86, 0.68, "engine\nmodel: serve + train", "#f3f4f6"),
        "store": (0.12, 0.30, "store\nrollouts · events", "#fef3c7"),
        "agent": (0.48, 0.30, "your agent(task, ctx)\nOpenAI SDK", "#dcfce7"),
        "gateway": (0.86, 0.30, "gateway\n…/rollout/{id}/…/v1", "#fce7f3"),
    }
    for x, y, label, colour in boxes.values():
        ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=8.5,
            transform=ax.transAxes,
            bbox=dict(boxstyle="round,pad=0.5", facecolor=colour, edgecolor="#555"),
        )
    # (from, to, label, curvature, label position (x, y))
    arrows = [
        ("trainer", "store", "enqueue tasks ×n;\nread finished rollouts", 0.0, (0.12, 0.49)),
        ("store", "runner", "queued", 0.0, (0.30, 0.49)),
        ("runner", "agent", "one per rollout", 0.0, (0.48, 0.49)),
        ("agent", "gateway", "chat.completions", 0.0, (0.67, 0.36)),
        ("gateway", "engine", "generate (token\nids + logprobs)", 0.0, (0.86, 0.49)),
        ("gateway", "store", "model_request events", -0.25, (0.48, 0.12)),
        ("trainer", "engine", "update weights, sync", -0.22, (0.48, 0.87)),
    ]
    for a, b, label, rad, (lx, ly) in arrows:
        (xa, ya), (xb, yb) = boxes[a][:2], boxes[b][:2]
        ax.annotate(
            "",
            xy=(xb, yb),
            xytext=(xa, ya),
            xycoords="axes fraction",
            arrowprops=dict(arrowstyle="->", color="#444", shrinkA=30, shrinkB=30, connectionstyle=f"arc3,rad={rad}"),
        )
        ax.text(
            lx,
            ly,
            label,
            ha="center",
            va="center",
            fontsize=7,
            color="#333",
            transform=ax.transAxes,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1),
        )
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    return _finish(plt, ax, own, path)


def plot_staleness(metrics, *, path: str | os.PathLike | None = None, title: str = "token staleness"):
    """Two panels from a run's metrics frame (`Trainer.metrics`: indexed by step, the `staleness/*`
    columns): the trained tokens per step stacked by age (`staleness/tokens_age_k`), and the mean
    |Δlogp| (old − sampling logprob) per step for each age (`staleness/lp_diff_mean_age_k`; under
    `bypass_mode` none is logged and the panel says so).
    Returns the two Axes, or the saved PNG's Path when `path` is given."""
    ages = sorted(int(c.rsplit("_", 1)[1]) for c in metrics.columns if c.startswith("staleness/tokens_age_"))
    if not ages:
        raise ValueError("plot_staleness: no staleness/tokens_age_* columns (a run trained by this agl_lab version)")
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), dpi=110, sharex=True)
    steps, below = metrics.index.to_numpy(), np.zeros(len(metrics))
    for age in ages:
        counts = metrics[f"staleness/tokens_age_{age}"].fillna(0).to_numpy(float)
        top.bar(steps, counts, bottom=below, label=f"age {age}")
        below += counts
        lp = f"staleness/lp_diff_mean_age_{age}"
        if lp in metrics:
            bottom.plot(steps, metrics[lp].to_numpy(float), marker="o", label=f"age {age}")
    top.set_ylabel("trained tokens")
    top.set_title(title)
    bottom.set_ylabel("mean |Δlogp|")
    bottom.set_xlabel("step")
    bottom.set_xticks(steps)
    if not bottom.lines:  # bypass_mode: the old logprobs are the sampling ones, no gap is measured
        bottom.text(
            0.5,
            0.5,
            "no |Δlogp| logged (bypass_mode:\nold logprobs = sampling logprobs)",
            ha="center",
            va="center",
            transform=bottom.transAxes,
            fontsize=8,
            color="#555",
        )
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.lines or ax.patches:
            ax.legend(fontsize=8)
    if path is None:
        return top, bottom
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_advantages(
    advantages, *, ax=None, path: str | os.PathLike | None = None, bins: int = 21, title: str = "per-rollout advantage"
):
    """Distribution of the rollout-level advantage A_r (`UpdateResult.weights`).

    GRPO advantages of small groups take few distinct values (n=4: ±0.5, ±1.5, …), so when
    there are at most `bins` distinct values (to 1e-3) each gets its own bar of exact
    count; otherwise a histogram with `bins` bins. Rollouts of zero-advantage groups
    (A_r = 0: every reward of the group equal) are a separate grey bar.
    """
    if "advantage" not in getattr(advantages, "columns", []):
        raise ValueError(
            "plot_advantages: expected a frame with an 'advantage' column "
            "(UpdateResult.weights or agl_lab.algorithms.rollout_weights_table)"
        )
    plt, ax, own = _axes(ax, figsize=(6, 3))
    a = advantages["advantage"].dropna().to_numpy(float)
    zero = np.isclose(a, 0.0, atol=1e-6)
    span = max(float(np.abs(a).max()) if len(a) else 1.0, 1e-3)
    values, counts = np.unique(np.round(a[~zero], 3), return_counts=True)
    width = 2 * span / bins
    label = f"A ≠ 0 ({int((~zero).sum())})"
    if len(values) <= bins:
        # Critical: exact values, not bins — a bin edge falling on -0.5 would split one value in two.
        ax.bar(values, counts, width=width * 0.8, color="#3a7bd5", label=label)
    else:
        ax.hist(a[~zero], bins=np.linspace(-span, span, bins + 1), color="#3a7bd5", label=label)
    ax.bar([0.0], [int(zero.sum())], width=width * 0.8, color="#999999", label=f"zero-advantage ({int(zero.sum())})")
    ax.axvline(0, color="#333", lw=0.8)
    ax.set_xlim(-span - width, span + width)
    ax.set_xlabel("advantage A_r")
    ax.set_ylabel("rollouts")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _finish(plt, ax, own, path)


def plot_loss_weights(
    tables: Mapping[str, Any], *, ax=None, path: str | os.PathLike | None = None, title: str = "loss weight per rollout"
):
    """Grouped bars: the `loss_weight` of each rollout under several loss settings.

    `tables` maps a label (e.g. "token-mean") to a `rollout_weights_table` frame; rollouts
    are matched by `rollout_id` and drawn in the order of the first table, with their
    number of loss tokens under the bars.
    """
    if not tables:
        raise ValueError("plot_loss_weights: pass at least one {label: rollout_weights_table} entry")
    frames = {k: v.set_index("rollout_id") for k, v in tables.items()}
    first = next(iter(frames.values()))
    ids = list(first.index)
    plt, ax, own = _axes(ax, figsize=(max(6, 0.45 * len(ids) + 2), 3.2))
    width = 0.8 / len(frames)
    x = np.arange(len(ids))
    for k, (label, frame) in enumerate(frames.items()):
        ax.bar(
            x + (k - (len(frames) - 1) / 2) * width,
            frame.reindex(ids)["loss_weight"].to_numpy(float),
            width=width,
            label=label,
        )
    ax.set_xticks(x, [f"{str(r)[:6]}\n{int(t)} tok" for r, t in zip(ids, first["loss_tokens"])], fontsize=7)
    ax.set_ylabel("share of the loss")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _finish(plt, ax, own, path)


# =========================================================================== tokens of a row


@dataclass(frozen=True)
class TokenCell:
    """One token of a row as the renderer sees it (pure data; `position` in the full row)."""

    position: int
    token_id: int
    piece: str
    kind: str  # one of TOKEN_KINDS
    special: bool
    loss: bool


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens, added special tokens included (<|im_start|>…)."""
    if tokenizer is None:
        return set()
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return ids


def _flat_ints(values: Any, name: str) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = list(values)
    if any(isinstance(v, (list, tuple)) for v in out):
        raise ValueError(
            f"{name} must be one row (a flat sequence), got nested values; pass e.g. data.batch['{name}'][i]"
        )
    return [int(v) for v in out]


def token_cells(
    token_ids: Sequence[int],
    tokenizer: Any = None,
    *,
    prompt_len: int,
    response_mask: Sequence[int],
    attention_mask: Sequence[int] | None = None,
) -> list[TokenCell]:
    """Classify every token of one row (pure; the renderers below only format the result).

    | argument        | shape      | meaning                                                 |
    |-----------------|------------|---------------------------------------------------------|
    | token_ids       | [L]        | prompt then response (padding included if any)          |
    | prompt_len      | int        | positions [0, prompt_len) are the prompt (incl. padding)|
    | response_mask   | [L − P]    | 1 = model token (loss), 0 = observation or padding      |
    | attention_mask  | [L] | None | 0 = padding; None = no padding                          |
    """
    ids = _flat_ints(token_ids, "token_ids")
    mask = _flat_ints(response_mask, "response_mask")
    if not 0 <= prompt_len <= len(ids):
        raise ValueError(
            f"prompt_len={prompt_len} is outside the row of {len(ids)} tokens; "
            "pass the number of prompt positions (the width of `prompts`)"
        )
    if len(mask) != len(ids) - prompt_len:
        raise ValueError(
            f"response_mask has {len(mask)} entries but the row has {len(ids) - prompt_len} "
            "response positions (len(token_ids) - prompt_len); pass the mask of this row"
        )
    attention = [1] * len(ids) if attention_mask is None else _flat_ints(attention_mask, "attention_mask")
    if len(attention) != len(ids):
        raise ValueError(f"attention_mask has {len(attention)} entries but token_ids has {len(ids)}")
    specials, cache = special_ids(tokenizer), {}
    cells = []
    for pos, (tid, att) in enumerate(zip(ids, attention)):
        loss = pos >= prompt_len and mask[pos - prompt_len] == 1 and att == 1
        kind = "pad" if att == 0 else "prompt" if pos < prompt_len else "model" if loss else "observation"
        if tid not in cache:
            cache[tid] = decode_ids([tid], tokenizer) if tokenizer is not None else f"[{tid}]"
        cells.append(TokenCell(pos, tid, cache[tid], kind, tid in specials, loss))
    return cells


def _control_escaped(text: str) -> str:
    """Control characters other than newline and tab written as `\\xNN` (they are invisible or
    break the layout when rendered raw; a tiny model samples them often)."""
    return "".join(f"\\x{ord(ch):02x}" if (ord(ch) < 32 and ch not in "\n\t") or ord(ch) == 127 else ch for ch in text)


def _visible(piece: str) -> str:
    """Escaped piece with newlines and tabs made visible (the newline still breaks the line)."""
    if piece == "":
        return "∅"
    return html.escape(_control_escaped(piece)).replace("\t", "⇥").replace("\n", "↵\n")


def _span(cell: TokenCell) -> str:
    classes = ["agl-tok", f"agl-{cell.kind}"] + ["agl-special"] * cell.special + ["agl-loss"] * cell.loss
    style = ";".join([_TOKEN_STYLE, _STYLE[cell.kind]] + [_SPECIAL_STYLE] * cell.special + [_LOSS_STYLE] * cell.loss)
    title = f"#{cell.position} id={cell.token_id} {cell.kind}{' special' * cell.special} loss={int(cell.loss)}"
    return (
        f'<span class="{" ".join(classes)}" style="{style}" title="{html.escape(title)}">{_visible(cell.piece)}</span>'
    )


def _pad_run(run: list[TokenCell]) -> str:
    first, last = run[0].position, run[-1].position
    return (
        f'<span class="agl-tok agl-pad" style="{_TOKEN_STYLE};{_STYLE["pad"]}" '
        f'title="#{first}–#{last} padding">⟨pad ×{len(run)}⟩</span>'
    )


def legend_html() -> str:
    """A one-line key of the colours and marks."""
    parts = [
        f'<span style="{_TOKEN_STYLE};{_STYLE[k]}{";" + _LOSS_STYLE if k == "model" else ""}">{k}</span>'
        for k in TOKEN_KINDS
    ]
    parts.append(f'<span style="{_TOKEN_STYLE};{_SPECIAL_STYLE}">special</span>')
    return (
        '<div class="agl-legend" style="font-size:11px;margin:2px 0">'
        + " ".join(parts)
        + " · underlined = in the loss mask</div>"
    )


def render_tokens(
    cells: Sequence[TokenCell], *, title: str | None = None, collapse_pad: bool = True, legend: bool = True
) -> str:
    """HTML of classified tokens: one span per token (runs of padding folded into one)."""
    body, run = [], []
    for cell in cells:
        if collapse_pad and cell.kind == "pad":
            run.append(cell)
            continue
        if run:
            body.append(_pad_run(run))
            run = []
        body.append(_span(cell))
    if run:
        body.append(_pad_run(run))
    counts = {k: sum(c.kind == k for c in cells) for k in TOKEN_KINDS}
    summary = " · ".join(f"{n} {k}" for k, n in counts.items() if n) + f" · {sum(c.loss for c in cells)} in loss"
    head = f"<b>{html.escape(title)}</b> — " if title else ""
    return (
        f'<div class="agl-row">{legend_html() if legend else ""}'
        f'<div style="font-size:11px;color:#57606a">{head}{html.escape(summary)}</div>'
        f'<div class="agl-tokens" style="{_BOX_STYLE}">{"".join(body)}</div></div>'
    )


def render_row_html(
    token_ids: Sequence[int],
    tokenizer: Any = None,
    *,
    prompt_len: int,
    response_mask: Sequence[int],
    attention_mask: Sequence[int] | None = None,
    title: str | None = None,
    collapse_pad: bool = True,
    legend: bool = True,
) -> str:
    """One row token by token (arguments as in `token_cells`), as an HTML string."""
    cells = token_cells(
        token_ids, tokenizer, prompt_len=prompt_len, response_mask=response_mask, attention_mask=attention_mask
    )
    return render_tokens(cells, title=title, collapse_pad=collapse_pad, legend=legend)


def _check_index(data: Any, index: int) -> None:
    if not 0 <= index < len(data):
        raise IndexError(f"row index {index} is outside the batch of {len(data)} rows")


def batch_row_cells(data: Any, index: int, tokenizer: Any = None) -> list[TokenCell]:
    """Cells of row `index` of a batch DataProto (`prompts` [N,P], `responses` [N,R], masks)."""
    _check_index(data, index)
    batch = data.batch
    prompt_len = int(batch["prompts"].shape[1])
    return token_cells(
        batch["input_ids"][index],
        tokenizer,
        prompt_len=prompt_len,
        response_mask=batch["response_mask"][index],
        attention_mask=batch["attention_mask"][index],
    )


def render_batch_row(
    data: Any,
    index: int,
    tokenizer: Any = None,
    *,
    title: str | None = None,
    collapse_pad: bool = True,
    legend: bool = True,
) -> str:
    """Row `index` of a batch DataProto, exactly as it is trained (padding folded)."""
    _check_index(data, index)
    if title is None:
        nt = data.non_tensor_batch
        rid = nt["rollout_id_list"][index] if "rollout_id_list" in nt else "?"
        title = f"row {index} · rollout {rid}"
    return render_tokens(batch_row_cells(data, index, tokenizer), title=title, collapse_pad=collapse_pad, legend=legend)


# =========================================================================== merge-break diff


def _diff_fields(diff: Any) -> dict[str, Any]:
    """Normalise a TokenDiff, a MergeBreak or a `breaks_df` row to one dict."""
    get = (lambda k, d=None: diff.get(k, d)) if hasattr(diff, "get") else (lambda k, d=None: getattr(diff, k, d))
    if get("a_ids") is not None:  # TokenDiff
        return dict(
            index=get("index"),
            start=get("start"),
            a_ids=get("a_ids"),
            b_ids=get("b_ids"),
            a_pieces=get("a_pieces"),
            b_pieces=get("b_pieces"),
        )
    index = get("first_divergent_token")
    if index is None or index != index:  # None, or NaN in a frame without diagnoses
        raise ValueError(
            "render_token_diff_html: expected a TokenDiff, a MergeBreak or a row of "
            "breaks_df with a diagnosis (first_divergent_token is missing; build the "
            "batch with diagnose=True)"
        )

    def first(*keys):
        return next((get(k) for k in keys if get(k) is not None), None)

    prev, prompt = first("prev_ids_window", "prev_ids"), first("prompt_ids_window", "prompt_ids")
    start = get("window_start")
    return dict(
        index=int(index),
        start=int(start) if start is not None else max(0, int(index) - WINDOW),
        a_ids=prev,
        b_ids=prompt,
        a_pieces=get("prev_pieces"),
        b_pieces=get("prompt_pieces"),
        kind=get("kind"),
        reason=get("reason"),
        removed_text=get("removed_text"),
        inserted_text=get("inserted_text"),
        rollout_id=get("rollout_id"),
        call=get("call"),
    )


def _diff_side(ids: Sequence[int], pieces: Sequence[str], start: int, index: int, side: str) -> str:
    spans = []
    for k, (tid, piece) in enumerate(zip(ids, pieces)):
        pos = start + k
        if pos < index:
            cls, style = "agl-same", "background-color:#eaeef2;color:#57606a"
        elif pos == index:
            cls, style = (
                "agl-diverge",
                "background-color:#ff8182;color:#000000;font-weight:bold;outline:2px solid #cf222e",
            )
        else:
            cls, style = "agl-after", "background-color:#ffebe9;color:#6e7781"
        spans.append(
            f'<span class="agl-tok {cls}" style="{_TOKEN_STYLE};{style}" '
            f'title="{side}[{pos}] id={int(tid)}">{_visible(str(piece))}</span>'
        )
    if not ids:
        spans.append('<span class="agl-tok agl-end" style="color:#6e7781">(ends here)</span>')
    return "".join(spans)


def render_token_diff_html(diff: Any, *, title: str | None = None) -> str:
    """The first divergent token of a merge break, both sides decoded, as an HTML string.

    `diff` is an `agl_lab.diagnose.TokenDiff`, a `MergeBreak`, or a row of `breaks_df`
    (`b.breaks.iloc[i]`). A = the previous context (prompt + response of the row so far),
    B = the new call's prompt. Tokens before the divergence are grey (`agl-same`), the first
    divergent token is red (`agl-diverge`), the rest of the window pink (`agl-after`).
    """
    f = _diff_fields(diff)
    index, start = int(f["index"]), int(f["start"])
    a_ids, b_ids = list(f["a_ids"] or []), list(f["b_ids"] or [])
    a_pieces, b_pieces = list(f["a_pieces"] or []), list(f["b_pieces"] or [])

    def at(ids, pieces):
        k = index - start
        return f"id {ids[k]} {pieces[k]!r}" if k < len(ids) else "nothing (sequence ends)"

    head = []
    if title or f.get("rollout_id") is not None:
        where = title or f"rollout {f['rollout_id']} · call {f['call']}"
        head.append(f"<b>{html.escape(str(where))}</b>")
    if f.get("kind"):
        colour = _KIND_COLOURS.get(str(f["kind"]), "#6e7781")
        head.append(
            f'<span class="agl-kind agl-kind-{html.escape(str(f["kind"]))}" style="background-color:'
            f'{colour};color:#ffffff;border-radius:3px;padding:0 4px">{html.escape(str(f["kind"]))}</span>'
        )
    if f.get("reason"):
        head.append(f'<span style="color:#57606a">{html.escape(str(f["reason"]))}</span>')
    rows = [
        ("A · previous context", a_ids, a_pieces, "A"),
        ("B · new prompt", b_ids, b_pieces, "B"),
    ]
    table = "".join(
        f'<tr><td style="white-space:nowrap;vertical-align:top;padding-right:8px;font-size:11px">{label}</td>'
        f'<td style="{_BOX_STYLE}">{_diff_side(ids, pieces, start, index, side)}</td>'
        f'<td style="{_BOX_STYLE};color:#57606a;padding-left:8px">{html.escape(repr("".join(map(str, pieces))))}</td></tr>'
        for label, ids, pieces, side in rows
    )
    lines = [f"first divergent token #{index}: A has {at(a_ids, a_pieces)}, B has {at(b_ids, b_pieces)}"]
    for key, label in (("removed_text", "removed from A"), ("inserted_text", "inserted in B")):
        if f.get(key):
            lines.append(f"{label}: {f[key]!r}")
    notes = "".join(f'<div style="font-size:11px;font-family:monospace">{html.escape(x)}</div>' for x in lines)
    return (
        f'<div class="agl-diff" style="margin:4px 0 10px 0;font-size:12px"><div>{" ".join(head)}</div>'
        f'<table style="border-collapse:collapse"><tr><th></th><th style="font-size:11px">window (tokens '
        f'{start}…)</th><th style="font-size:11px">decoded</th></tr>{table}</table>{notes}</div>'
    )
